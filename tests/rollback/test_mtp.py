"""Compact rollback under the real MTP drafter: exact output, replays only on deep rejections.

The MTP head decides the schedule here, so a recording wrapper notes every verify's draft
length and accepted count, and the expected replays are derived from those outcomes.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
from helpers import PROMPT

from shared.protocol import CheckpointMode, SamplingParams, SpecMethod, SpecSettings
from worker.engine.core.draft import Draft, VerifyOutcome
from worker.engine.drafting.width import BudgetedWidth, FixedWidth
from worker.engine.proposers.base import Proposer
from worker.engine.proposers.mtp import MtpDrafter
from worker.engine.sampling import make_sampler

from .conftest import LONG_TOKENS, engine_for
from .oracle import Planned


class Recording:
    """Delegates to a proposer and keeps what each verify of its drafts established."""

    def __init__(self, inner: Proposer) -> None:
        self.inner = inner
        self.verifies: list[Planned] = []

    def start(self, prompt: Sequence[int]) -> None:
        self.verifies.clear()
        self.inner.start(prompt)

    def propose(self, history: Sequence[int], width: int, p_min: float) -> Draft:
        return self.inner.propose(history, width, p_min)

    def observe(self, outcome: VerifyOutcome) -> None:
        self.verifies.append(Planned(len(outcome.draft), outcome.n_accepted))
        self.inner.observe(outcome)


@pytest.mark.parametrize(("draft_max", "depth", "mode", "varied"), [
    (3, 1, CheckpointMode.DEVICE, False),
    (5, 1, CheckpointMode.DEVICE, False),
    (5, 2, CheckpointMode.HOST, False),
    (7, 1, CheckpointMode.HOST, False),
    (7, 3, CheckpointMode.DEVICE, False),
    (7, 2, CheckpointMode.DEVICE, True),
], ids=lambda v: getattr(v, "value", str(v)))
def test_mtp_drafter_with_compact_rollback_is_exact(
        hybrid_model: Path, hybrid_reference: list[int], draft_max: int, depth: int,
        mode: CheckpointMode, varied: bool) -> None:
    """``varied``: adaptive width and a p-min floor, so drafts both within and beyond D occur
    (a checkpoint is taken only for the latter)."""
    spec = SpecSettings(method=SpecMethod.MTP, draft_max=draft_max, rollback_depth=depth,
                        adaptive=varied, p_min=0.5 if varied else 0.0)
    with engine_for(hybrid_model, draft_max, depth, mode, method=SpecMethod.MTP) as engine:
        assert isinstance(engine.head, MtpDrafter)
        # An idle engine admits into slot 0; greedy, so the head drafts its argmax.
        recording = Recording(engine.head.proposer(0, make_sampler(SamplingParams(),
                                                                   len(PROMPT))))
        result = engine.generate(PROMPT, LONG_TOKENS, spec, proposer=recording)

    assert result.tokens == hybrid_reference[:LONG_TOKENS]
    verifies = recording.verifies
    deep = [v for v in verifies if v.rejected > depth]
    assert deep, "the MTP head never missed deeper than D: the replay path went untested"
    assert result.telemetry.replay_events == len(deep)
    assert result.telemetry.replay_tokens == sum(v.accept + 1 for v in deep)
    assert result.telemetry.checkpoint_saves == sum(v.width > depth for v in verifies)
    assert result.telemetry.checkpoint_mode == mode.value
    assert 0 < result.telemetry.acceptance < 1
    if varied:
        assert any(0 < v.width <= depth for v in verifies), "no draft within D"


class EveryOther:
    """Drafts with the head on even steps only, as ``mtp+suffix`` does when the lookup's draft
    fills the width on the others (``asks_between``: the head is still asked there, and its
    draft thrown away, so the verify schedule is the same either way)."""

    def __init__(self, head: Proposer, asks_between: bool) -> None:
        self.head = head
        self.asks_between = asks_between
        self.steps = 0

    def start(self, prompt: Sequence[int]) -> None:
        self.head.start(prompt)

    def propose(self, history: Sequence[int], width: int, p_min: float) -> Draft:
        self.steps += 1
        if self.steps % 2 and not self.asks_between:
            return Draft([])
        draft = self.head.propose(history, width, p_min)
        return Draft([]) if self.steps % 2 else draft

    def observe(self, outcome: VerifyOutcome) -> None:
        self.head.observe(outcome)


class AlwaysAsks(BudgetedWidth):
    """A width policy that asks the drafter at every step, whatever it proposed: the two runs
    below must verify on the same schedule, which a planner skipping the stub's empty steps
    (``BudgetedWidth.proposed``) would make depend on the head's own drafts."""

    def proposed(self, drafted: int) -> None:
        """Never skips."""


def test_the_head_catches_up_on_every_verify_it_did_not_draft_for(
        hybrid_model: Path, hybrid_reference: list[int]) -> None:
    """A head not asked to draft for a step is still told of that step's verify: when next
    asked, its draft context holds every position of both verifies, as a head asked at every
    step does (the size of its saved sequence state counts the cells it holds). Each observe
    used to replace the waiting catch-up: the earlier verify's accepted drafts were never fed
    and the context held about half the positions (5,368 bytes of state against 10,080)."""
    spec = SpecSettings(method=SpecMethod.MTP, draft_max=4)
    held = []
    for asks_between in (True, False):
        with engine_for(hybrid_model, 4, None, CheckpointMode.DEVICE,
                        method=SpecMethod.MTP) as engine:
            head = engine.head
            assert isinstance(head, MtpDrafter)
            engine.planner.policy = (  # type: ignore[method-assign]
                lambda draft_max, adaptive, idle_skips=True: AlwaysAsks(FixedWidth(draft_max)))
            proposer = EveryOther(head.proposer(0, make_sampler(SamplingParams(), len(PROMPT))),
                                  asks_between)
            result = engine.generate(PROMPT, 60, spec, proposer=proposer)
            assert result.tokens == hybrid_reference[:60]
            assert result.telemetry.accepted > 0  # accepted drafts: something to lose
            held.append(head._draft.state_size(0, 0))  # noqa: SLF001  the slot stays cached
    assert held[0] == held[1]
