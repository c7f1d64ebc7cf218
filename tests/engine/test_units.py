"""Pure logic of the loop: the width policy, the n-gram lookup, the drafter factory."""

from __future__ import annotations

import pytest

from shared.protocol import SpecMethod, SpecSettings
from worker.engine.drafting.shape import best_lengths
from worker.engine.drafting.width import AdaptiveWidth, FixedWidth
from worker.engine.proposers.factory import make_proposer
from worker.engine.proposers.ngram import NgramProposer
from worker.engine.proposers.none import NoDraft


def test_fixed_width_never_moves() -> None:
    policy = FixedWidth(4)
    for drafted, accepted in [(4, 0), (4, 0), (4, 4)]:
        policy.update(drafted, accepted)
    assert policy.width() == 4


def test_adaptive_width_follows_seed_003() -> None:
    policy = AdaptiveWidth(5)
    assert policy.width() == 5
    policy.update(5, 2)
    assert policy.width() == 5          # one poor ceiling draft is not enough
    policy.update(3, 0)                 # cut short (p-min, budget): does not count...
    policy.update(5, 1)
    assert policy.width() == 4          # ...nor break the streak: two in a row lower it
    policy.update(4, 3)                 # 3 accepted is not "fewer than 3": streak reset
    policy.update(4, 0)
    assert policy.width() == 4
    policy.update(4, 4)                 # full accept raises
    assert policy.width() == 5
    policy.update(5, 5)
    assert policy.width() == 5          # never above draft_max
    for _ in range(20):
        policy.update(policy.width(), 0)
    assert policy.width() == 1          # never below 1


def test_ngram_prefers_the_longest_most_recent_match() -> None:
    proposer = NgramProposer(1, 3)
    history = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    proposer.start(history)
    # [2, 3] last occurred at index 5..6, followed by 7, 8, 5.
    assert proposer.propose(history, 3, 0.0).tokens == [7, 8, 5]
    history += [4]
    assert proposer.propose(history, 3, 0.0).tokens == []      # 4 never seen before
    history += [1, 2]
    # [4, 1, 2] is new, [1, 2] last at 4..5 -> 3, 7
    assert proposer.propose(history, 2, 0.0).tokens == [3, 7]


def test_verify_shape_trims_to_cheaper_row_counts() -> None:
    # Costs per row count shaped like a CPU build's: odd counts cost more than the next even.
    costs = [0.0, 1.0, 2.1, 3.5, 2.7, 4.1, 3.4, 5.0, 4.0]
    shape = best_lengths(costs)
    assert shape == [0, 0, 0, 3, 3, 5, 5, 7]
    assert best_lengths([0.0, 1.0, 1.0, 1.0, 1.0]) == [0, 1, 2, 3]  # flat (GPU-like): identity


def test_adaptive_width_counts_a_shaped_ceiling_as_reached() -> None:
    policy = AdaptiveWidth(4, shape=[0, 0, 0, 3, 3])
    policy.update(3, 1)
    policy.update(3, 0)
    assert policy.width() == 3          # two poor drafts that reached shape[4] = 3
    policy.update(3, 3)
    assert policy.width() == 4


def test_a_drafter_whose_engine_part_is_missing_is_an_error_not_no_drafting() -> None:
    assert isinstance(make_proposer(SpecMethod.NONE, SpecSettings(), None), NoDraft)
    for method in (SpecMethod.MTP, SpecMethod.SUFFIX, SpecMethod.MTP_SUFFIX):
        with pytest.raises(ValueError, match="needs a part of the engine"):
            make_proposer(method, SpecSettings(), None, None)
