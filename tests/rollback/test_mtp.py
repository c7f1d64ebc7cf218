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
from worker.engine.proposers.base import Proposer
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
        assert engine.mtp is not None
        # An idle engine admits into slot 0; greedy, so the head drafts its argmax.
        recording = Recording(engine.mtp.proposer(0, make_sampler(SamplingParams(), len(PROMPT))))
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
