"""Speculation must not change a single token: every run equals plain greedy token by token.

MTP on the hybrid model and n-gram on the dense and hybrid models, every draft width 1..7,
fixed or adaptive width, with and without p-min, over 200 generated tokens. Acceptance must
be strictly between 0 and 1, so the runs really contain both accepted and rejected drafts
(and therefore real rollbacks).
"""

from __future__ import annotations

import pytest

from shared.protocol import SpecMethod, SpecSettings

from .conftest import PROMPT, TOKENS, Subject, assert_consistent, first_difference

WIDTHS = range(1, 8)


def _check(subject: Subject, spec: SpecSettings) -> None:
    result = subject.engine.generate(PROMPT, TOKENS, spec)
    assert first_difference(result.tokens, subject.reference) is None
    assert 0.0 < result.telemetry.acceptance < 1.0
    assert result.telemetry.spec_method == spec.method
    assert_consistent(result)


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "adaptive"])
@pytest.mark.parametrize("width", WIDTHS)
def test_mtp_on_hybrid_equals_plain_greedy(hybrid_mtp: Subject, width: int,
                                           adaptive: bool) -> None:
    _check(hybrid_mtp, SpecSettings(method=SpecMethod.MTP, draft_max=width, adaptive=adaptive))


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "adaptive"])
@pytest.mark.parametrize("width", WIDTHS)
def test_mtp_with_p_min_equals_plain_greedy(soft_hybrid_mtp: Subject, width: int,
                                            adaptive: bool) -> None:
    """On the soft-output hybrid the head is unsure often enough for p-min to cut drafts."""
    spec = SpecSettings(method=SpecMethod.MTP, draft_max=width, adaptive=adaptive, p_min=0.6)
    _check(soft_hybrid_mtp, spec)


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "adaptive"])
@pytest.mark.parametrize("width", WIDTHS)
def test_ngram_on_dense_equals_plain_greedy(dense_ngram: Subject, width: int,
                                            adaptive: bool) -> None:
    _check(dense_ngram, SpecSettings(method=SpecMethod.NGRAM, draft_max=width, adaptive=adaptive))


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "adaptive"])
@pytest.mark.parametrize("width", WIDTHS)
def test_ngram_on_hybrid_equals_plain_greedy(hybrid_mtp: Subject, width: int,
                                             adaptive: bool) -> None:
    """N-gram drafting on an MTP engine: a request may narrow MTP to n-gram."""
    _check(hybrid_mtp, SpecSettings(method=SpecMethod.NGRAM, draft_max=width, adaptive=adaptive))


def test_p_min_cuts_drafts_without_changing_output(soft_hybrid_mtp: Subject) -> None:
    """p-min stops drafting at an unsure head: fewer drafted tokens, the same text."""
    free = soft_hybrid_mtp.engine.generate(PROMPT, TOKENS, SpecSettings(method="mtp", draft_max=4))
    capped = soft_hybrid_mtp.engine.generate(
        PROMPT, TOKENS, SpecSettings(method="mtp", draft_max=4, p_min=0.6))
    assert capped.tokens == free.tokens == soft_hybrid_mtp.reference
    assert capped.telemetry.drafted < free.telemetry.drafted
    assert capped.telemetry.acceptance > free.telemetry.acceptance


def test_adaptive_width_drafts_less_when_wide_drafts_fail(hybrid_mtp: Subject) -> None:
    """At width 7 the head's later positions are mostly wrong: adaptation narrows the drafts."""
    fixed = hybrid_mtp.engine.generate(PROMPT, TOKENS, SpecSettings(method="mtp", draft_max=7))
    adaptive = hybrid_mtp.engine.generate(
        PROMPT, TOKENS, SpecSettings(method="mtp", draft_max=7, adaptive=True))
    assert adaptive.tokens == fixed.tokens
    assert adaptive.telemetry.drafted < fixed.telemetry.drafted
    assert len(adaptive.telemetry.drafted_per_position) == 7
