"""Speculation must not change a single token: every run equals plain greedy token by token.

MTP on the hybrid model and n-gram on the dense and hybrid models, every draft width 1..7,
fixed or adaptive width, with and without p-min, over 200 generated tokens. Acceptance must
be strictly between 0 and 1, so the runs really contain both accepted and rejected drafts
(and therefore real rollbacks).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from shared.protocol import SpecMethod, SpecSettings
from worker.engine.core.draft import Draft, VerifyOutcome
from worker.engine.engine import EngineConfig, SpeculativeEngine
from worker.launch import EngineCapacity

from .conftest import N_MAX, PROMPT, TOKENS, Subject, assert_consistent, first_difference

WIDTHS = range(1, 8)
#: (engine fixture, drafting method, extra settings). The soft-output hybrid is the one whose
#: MTP head is unsure often enough for p-min to cut drafts; n-gram on the hybrid is a request
#: narrowing an MTP engine to n-gram.
CASES = {
    "mtp-hybrid": ("hybrid_mtp", SpecMethod.MTP, {}),
    "mtp-hybrid-pmin": ("soft_hybrid_mtp", SpecMethod.MTP, {"p_min": 0.6}),
    "ngram-dense": ("dense_ngram", SpecMethod.NGRAM, {}),
    "ngram-hybrid": ("hybrid_mtp", SpecMethod.NGRAM, {}),
}


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "adaptive"])
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("case", CASES)
def test_speculation_equals_plain_greedy(request: pytest.FixtureRequest, case: str, width: int,
                                         adaptive: bool) -> None:
    fixture, method, extra = CASES[case]
    subject: Subject = request.getfixturevalue(fixture)
    spec = SpecSettings(method=method, draft_max=width, adaptive=adaptive, **extra)
    result = subject.engine.generate(PROMPT, TOKENS, spec)
    assert first_difference(result.tokens, subject.reference) is None
    assert 0.0 < result.telemetry.acceptance < 1.0
    assert result.telemetry.spec_method == method
    assert_consistent(result)


def test_p_min_cuts_drafts_without_changing_output(soft_hybrid_mtp: Subject) -> None:
    """p-min stops drafting at an unsure head: fewer drafted tokens, the same text."""
    free = soft_hybrid_mtp.engine.generate(PROMPT, TOKENS, SpecSettings(method="mtp", draft_max=4))
    capped = soft_hybrid_mtp.engine.generate(
        PROMPT, TOKENS, SpecSettings(method="mtp", draft_max=4, p_min=0.6))
    assert capped.tokens == free.tokens == soft_hybrid_mtp.reference
    assert capped.telemetry.drafted < free.telemetry.drafted


class WrongProposer:
    """Drafts a full-width continuation that is wrong at every position."""

    def __init__(self, reference: list[int]) -> None:
        self.reference = reference

    def start(self, prompt: Sequence[int]) -> None:
        """Stateless."""

    def propose(self, history: Sequence[int], width: int, p_min: float) -> Draft:
        done = len(history) - len(PROMPT)
        right = self.reference[done + 1 : done + 1 + width]
        return Draft([(t + 1) % 256 for t in right])

    def observe(self, outcome: VerifyOutcome) -> None:
        """Stateless."""


def test_adaptive_width_narrows_drafts_that_keep_failing(dense_ngram: Subject) -> None:
    """The width policy (docs/engine.md, "Width policy") through the engine: every draft is
    rejected at position 0, so the ceiling falls from 7 to 1 after 12 drafts (two poor drafts
    per step) and stays there."""
    wrong = WrongProposer(dense_ngram.reference)
    spec = SpecSettings(method=SpecMethod.NGRAM, draft_max=7)
    fixed = dense_ngram.engine.generate(PROMPT, TOKENS, spec, proposer=wrong)
    adaptive = dense_ngram.engine.generate(
        PROMPT, TOKENS, spec.model_copy(update={"adaptive": True}), proposer=wrong)
    assert fixed.tokens == adaptive.tokens == dense_ngram.reference
    assert fixed.telemetry.accepted == adaptive.telemetry.accepted == 0
    # One token per step; the token budget caps the width over the last steps.
    budget = [TOKENS - 1 - g for g in range(TOKENS)]
    assert fixed.telemetry.drafted == sum(min(7, b) for b in budget)
    ramp = 2 * sum(range(2, 8))                            # 7,7,6,6,..,2,2
    assert adaptive.telemetry.drafted == ramp + sum(min(1, b) for b in budget[12:])


def test_calibrated_verify_shape_keeps_output_exact(dense_model: Path,
                                                   dense_ngram: Subject) -> None:
    """Trimming drafts to the measured cheapest verify widths changes speed, not tokens."""
    spec = SpecSettings(method=SpecMethod.NGRAM, draft_max=N_MAX)
    config = EngineConfig(str(dense_model), n_ctx=512, n_threads=1, calibrate_verify=True,
                          capacity=EngineCapacity(method=SpecMethod.NGRAM, draft_max=N_MAX))
    with SpeculativeEngine(config) as engine:
        assert len(engine.planner.shape) == N_MAX + 1
        assert all(m <= n for n, m in enumerate(engine.planner.shape))
        for adaptive in (False, True):
            result = engine.generate(PROMPT, TOKENS, spec.model_copy(update={"adaptive": adaptive}))
            assert first_difference(result.tokens, dense_ngram.reference) is None
            assert_consistent(result)
