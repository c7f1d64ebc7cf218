"""The native token index, walk and calibration (``worker/engine/proposers/_lookup.c``) against
plain Python statements of what they must do: the walk's token choice, agreement, fragility,
wrapping, confidences and stops, the calibration's arithmetic, the index as a sequence, its
byte accounting at every size, and copies of each."""

from __future__ import annotations

import copy
import importlib
import pickle
import random
import sys
from collections.abc import Callable

import pytest

from worker.engine.drafting.width import DraftLength
from worker.engine.proposers.confidence import (
    DEPTH_PRIOR,
    FRAGILE_PRIOR,
    MAX_TRIALS,
    PRIOR_OCCURRENCES,
    PRIOR_TRIALS,
    AcceptanceStats,
)
from worker.engine.proposers.suffix import MIN_REACH
from worker.engine.proposers.token_index import ORDERS, TokenIndex, follow, tail_keys

Occurrence = tuple[TokenIndex, int, dict[int, int]]


def _reference_confidence(stats: AcceptanceStats, depth: int, support: int, agree: int,
                          shared: bool, fragile: int) -> tuple[float, int]:
    """confidence.py's rule, spelled out: the cell's bucket numbers and the count estimate
    shrunk towards the depth prior, then towards the cell's measured hits."""
    share = agree / support
    agreement = 0 if share >= 1.0 else 1 if share >= 0.75 else 2 if share >= 0.5 else 3
    depth_bucket = min(depth.bit_length(), len(DEPTH_PRIOR)) - 1
    cell = (((int(shared) * 7 + depth_bucket) * 5 + min(support.bit_length(), 4)) * 4
            + agreement) * 3 + fragile
    guess = (agree + PRIOR_OCCURRENCES * DEPTH_PRIOR[depth_bucket]) / (
        support + PRIOR_OCCURRENCES) * FRAGILE_PRIOR[fragile]
    state = stats.__getstate__()
    hits, trials = state[5][cell], state[6][cell]  # type: ignore[index]
    return (hits + PRIOR_TRIALS * guess) / (trials + PRIOR_TRIALS), cell


def _reference_walk(occurrences: list[Occurrence], width: int, wraps: bool,
                    ends: Callable[[int], bool] | None, stats: AcceptanceStats, depth: int,
                    shared: bool, scale: float, p_min: float,
                    length: DraftLength) -> tuple[list[int], list[float], list[int]]:
    """What ``follow`` must draft, written the slow obvious way: the token most live
    occurrences go on with (ties: the earliest occurrence's), at the confidence of its
    evidence (live, agreeing, the highest fragility an agreeing one holds it at)."""
    live = [(list(index.tokens), start, fragile) for index, start, fragile in occurrences]
    tokens: list[int] = []
    confidences: list[float] = []
    cells: list[int] = []
    reach = 1.0
    for i in range(width):
        going = []
        for seq, start, fragile in live:
            j = start + i
            if j < len(seq):
                going.append(((seq, start, fragile), seq[j]))
            elif wraps and j - len(seq) < len(tokens):
                going.append(((seq, start, fragile), tokens[j - len(seq)]))
        if not going:
            break
        seen = [t for _, t in going]
        token = max(seen, key=lambda t: (seen.count(t), -seen.index(t)))
        if ends is not None and ends(token):
            break
        agreeing = [occ for occ, t in going if t == token]
        fragile = max(occ[2].get(occ[1] + i, 0) for occ in agreeing)
        p, cell = _reference_confidence(stats, depth + i, len(going), len(agreeing), shared,
                                        fragile)
        p *= scale
        reach *= p
        if p < p_min or reach < MIN_REACH:
            break
        tokens.append(token)
        confidences.append(p)
        cells.append(cell)
        if not length.add(p, width - i - 1):
            break
        live = agreeing
    return tokens, confidences, cells


def _trained_stats(rng: random.Random) -> AcceptanceStats:
    """Calibration with outcomes in many cells, halved where they pass the cap."""
    stats = AcceptanceStats()
    for _ in range(4000):
        _, cell = stats.confidence(rng.randrange(1, 90), support := rng.randrange(1, 20),
                                   rng.randrange(1, support + 1), rng.random() < 0.5,
                                   rng.randrange(3))
        stats.record(cell, rng.random() < 0.7)
    return stats


@pytest.mark.parametrize("seed", range(60))
def test_the_walk_drafts_what_a_plain_walk_of_the_occurrences_does(seed: int) -> None:
    rng = random.Random(seed)
    alphabet = rng.choice((2, 3, 5))  # small: occurrences agree, part and tie
    indexes = [TokenIndex([rng.randrange(alphabet) for _ in range(rng.randrange(4, 60))])
               for _ in range(rng.randrange(1, 4))]
    occurrences: list[Occurrence] = []
    for _ in range(rng.randrange(1, 12)):
        index = rng.choice(indexes)
        start = rng.randrange(1, len(index))
        marked = rng.sample(range(len(index)), min(5, len(index)))
        fragile = {p: rng.choice((1, 2)) for p in marked} if rng.random() < 0.5 else {}
        occurrences.append((index, start, fragile))
    stats = _trained_stats(rng)
    width, wraps = rng.randrange(1, 40), rng.random() < 0.5
    ends = (lambda t: t == alphabet - 1) if rng.random() < 0.3 else None
    depth, shared = rng.choice((1, 2, 5, 16, 64, 300)), rng.random() < 0.5
    scale, p_min = rng.choice((1.0, 0.9, 0.5)), rng.choice((0.0, 0.3, 0.6))
    seconds = [0.0] + [1.0 + rng.choice((0.0, 0.05, 0.3)) * r for r in range(1, 50)]
    walked = follow(occurrences, width, wraps, ends, stats, depth, shared, scale, p_min,
                    MIN_REACH, DraftLength(seconds))
    assert walked == _reference_walk(occurrences, width, wraps, ends, stats, depth, shared,
                                     scale, p_min, DraftLength(seconds))


def test_the_calibration_follows_its_outcomes_and_halves_past_the_cap() -> None:
    stats, rng = AcceptanceStats(), random.Random(1)
    for _ in range(300):
        evidence = (rng.randrange(1, 200), s := rng.randrange(1, 40), rng.randrange(1, s + 1),
                    rng.random() < 0.5, rng.randrange(3))
        p, cell = stats.confidence(*evidence)
        assert (p, cell) == _reference_confidence(stats, *evidence)
        stats.record(cell, rng.random() < 0.2)
    _, cell = stats.confidence(40, 4, 4, True, 0)
    for _ in range(int(MAX_TRIALS)):
        stats.record(cell, True)
    stats.record(cell, False)  # the trial past the cap halves the counts
    state = stats.__getstate__()
    assert (state[5][cell], state[6][cell]) == (MAX_TRIALS / 2, (MAX_TRIALS + 1) / 2)  # type: ignore[index]
    clone = copy.deepcopy(stats)
    assert clone.__getstate__() == state and type(clone) is AcceptanceStats
    with pytest.raises(ValueError, match="agree"):
        stats.confidence(4, 2, 3, False, 0)


def test_a_request_looping_on_itself_is_walked_past_its_end() -> None:
    """The request's own text repeating with period 3: the occurrence three back goes on
    with the draft itself when ``wraps``, and ends with the text when not."""
    index = TokenIndex([1, 2, 3, 1, 2, 3, 1, 2])
    walked = {wraps: follow([(index, 5, {})], 10, wraps, None, AcceptanceStats(), 64, False,
                            1.0, 0.0, 0.0, DraftLength([0.0] + [1.0] * 20))[0]
              for wraps in (True, False)}
    assert walked[True] == [3, 1, 2, 3, 1, 2, 3, 1, 2, 3]
    assert walked[False] == [3, 1, 2]


def test_the_walk_refuses_what_is_not_an_occurrence() -> None:
    stats, length = AcceptanceStats(), DraftLength([0.0] + [1.0] * 20)
    with pytest.raises(TypeError, match="triples"):
        follow([([1, 2, 3], 1, {})], 4, False, None, stats, 4, False, 1.0, 0.0, 0.0,  # type: ignore[list-item]
               length)
    with pytest.raises(ZeroDivisionError):  # a callback's own error comes through
        follow([(TokenIndex([1, 2, 3]), 1, {})], 4, False, lambda t: 1 / 0 > 0, stats, 4,
               False, 1.0, 0.0, 0.0, length)


def test_the_index_reads_as_its_token_sequence() -> None:
    tokens = [5, 0, 262_143, 7, 7, 2**40]
    index = TokenIndex()
    index.append(tokens[:2])
    index.extend(tokens[2:])
    assert len(index) == len(tokens) and index.tokens == tokens
    assert [index[i] for i in range(-6, 6)] == tokens[-6:] + tokens
    for a, b in ((0, 6), (2, 4), (4, 2), (-3, None), (None, 100), (7, 9)):
        assert index[a:b] == tokens[a:b]
    with pytest.raises(IndexError):
        index[6]
    with pytest.raises(ValueError, match="step 1"):
        index[::2]
    with pytest.raises(ValueError, match="negative"):
        index.append([-1])
    with pytest.raises(IndexError, match="order 7"):
        index.occurrences(len(ORDERS), 0)
    with pytest.raises(TypeError, match="once"):
        TokenIndex.__init__(index, [1])
    bare = TokenIndex.__new__(TokenIndex)  # never initialised: empty, and usable
    assert (len(bare), bare[0:3], bare.tail_keys()) == (0, [], [None] * len(ORDERS))
    bare.extend([4, 5, 4])
    assert bare.occurrences(ORDERS.index(1), tail_keys([4])[-1]) == [1]


def test_a_copy_is_an_index_of_the_same_tokens() -> None:
    rng = random.Random(3)
    tokens = [rng.randrange(4) for _ in range(300)]
    index = TokenIndex(tokens[:200])
    index.append(tokens[200:])  # not yet indexed: a copy still finds them
    keys = tail_keys(tokens[:150])
    for clone in (copy.deepcopy(index), pickle.loads(pickle.dumps(index))):
        assert clone.tokens == tokens and clone is not index
        assert [clone.occurrences(k, key) for k, key in enumerate(keys)] == \
            [index.occurrences(k, key) for k, key in enumerate(keys)]


@pytest.mark.parametrize("vocab", [3, 262_144])
def test_the_accounted_bytes_bound_the_allocation_at_every_size(vocab: int) -> None:
    """What the output cache counts (``nbytes``) is at least what the arrays and tables hold,
    from an empty index on, through every doubling, however repetitive the text."""
    rng = random.Random(vocab)
    index = TokenIndex()
    for _ in range(3000):
        index.append([rng.randrange(vocab) for _ in range(rng.choice((1, 3, 17)))])
        index.catch_up()
        assert index.allocated() <= index.nbytes(), len(index)


def test_a_worker_without_the_native_index_is_told_how_to_build_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A gateway-only install may lack the extension (setup.py: optional, no compiler); a
    worker that imports the drafter there fails naming the module and the fix."""
    monkeypatch.setitem(sys.modules, "worker.engine.proposers._lookup", None)
    monkeypatch.delitem(sys.modules, "worker.engine.proposers.token_index")
    with pytest.raises(ImportError, match=r"_lookup, the suffix drafter's native token index, "
                                          r"is not built: reinstall specfleet with a C compiler"):
        importlib.import_module("worker.engine.proposers.token_index")
