"""The suffix drafter only proposes: every combination equals plain greedy token by token.

Suffix lookup on the dense and the hybrid model, MTP + suffix on the hybrid (and the narrower
methods a ``mtp+suffix`` engine serves), every draft width 1..7, fixed or adaptive width, with
the worker-wide output cache cold and warm, and a request after others whose outputs it may
draft from but must never copy.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from shared.protocol import SpecMethod, SpecSettings
from worker.engine.engine import SpeculativeEngine
from worker.engine.proposers import confidence
from worker.engine.proposers.suffix import LEAD_IN

from .conftest import (
    N_MAX,
    PROMPT,
    TOKENS,
    Subject,
    assert_consistent,
    first_difference,
    open_engine,
    subject_fixture,
)

WIDTHS = range(1, N_MAX + 1)
#: Another prompt, and its plain reference is computed on the same engine.
OTHER_PROMPT = [11, 250, 3, 99, 42, 17, 5, 8, 200]


dense_suffix = subject_fixture("dense_model", SpecMethod.SUFFIX, scope="module")
hybrid_mtp_suffix = subject_fixture("hybrid_model", SpecMethod.MTP_SUFFIX, scope="module")


#: (engine fixture, the request's method).
CASES = {
    "suffix-dense": ("dense_suffix", SpecMethod.SUFFIX),
    "suffix-hybrid": ("hybrid_mtp_suffix", SpecMethod.SUFFIX),
    "mtp+suffix-hybrid": ("hybrid_mtp_suffix", SpecMethod.MTP_SUFFIX),
    "mtp-on-mtp+suffix-engine": ("hybrid_mtp_suffix", SpecMethod.MTP),
}


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "adaptive"])
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("case", CASES)
def test_suffix_combinations_equal_plain_greedy(request: pytest.FixtureRequest, case: str,
                                                width: int, adaptive: bool) -> None:
    fixture, method = CASES[case]
    subject: Subject = request.getfixturevalue(fixture)
    spec = SpecSettings(method=method, draft_max=width, adaptive=adaptive)
    result = subject.engine.generate(PROMPT, TOKENS, spec)
    assert first_difference(result.tokens, subject.reference) is None
    assert result.telemetry.spec_method == method
    if width >= 3:
        # It really speculated. Whether one or two drafts pay for their rows is the cost
        # rule's call on measured timings (a loaded machine can say no); three or more, on a
        # model whose rows are nearly free, always do.
        assert result.telemetry.drafted > 0
    assert_consistent(result)


def _plain(engine: SpeculativeEngine, prompt: list[int]) -> list[int]:
    return engine.generate(prompt, TOKENS, SpecSettings(method=SpecMethod.NONE)).tokens


@pytest.mark.parametrize("fixture", ["dense_suffix", "hybrid_mtp_suffix"])
def test_cached_outputs_speed_up_a_repeat_and_never_leak(request: pytest.FixtureRequest,
                                                         fixture: str) -> None:
    """A repeated request drafts its earlier output from the cache; a different request
    after it, drafting from the same cache, still writes exactly its own plain text."""
    subject: Subject = request.getfixturevalue(fixture)
    engine = subject.engine
    assert engine.suffix is not None
    spec = SpecSettings(method=SpecMethod.SUFFIX, draft_max=N_MAX)
    first = engine.generate(PROMPT, TOKENS, spec)
    repeat = engine.generate(PROMPT, TOKENS, spec)
    assert first.tokens == repeat.tokens == subject.reference
    assert len(engine.suffix.cache) >= 2
    other_reference = _plain(engine, OTHER_PROMPT)
    other = engine.generate(OTHER_PROMPT, TOKENS, spec)
    assert first_difference(other.tokens, other_reference) is None
    assert other.tokens != subject.reference


def test_the_cache_marks_an_outputs_near_ties_from_the_targets_own_rows(
        dense_suffix: Subject, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the engine records as fragile is where the target's lead over its runner-up was
    small, and how small: the verify rows' margins against the logprobs of the same text. The
    tiny model's leads are all wide (above 0.5), so the bounds are moved to their quartiles
    here: half of the output is then fragile, exactly that half, and its closer half
    near-ties."""
    engine = dense_suffix.engine
    cold(engine)
    spec = SpecSettings(method=SpecMethod.SUFFIX, draft_max=N_MAX)
    result = engine.generate(PROMPT, TOKENS, spec, logprobs=2)
    leads = [lp.logprob - max(a.logprob for a in lp.top_logprobs if a.token != lp.token)
             for lp in result.logprobs]
    near, bound = (float(q) for q in np.quantile(leads, [0.25, 0.5]))
    assert engine.suffix is not None
    monkeypatch.setattr(confidence, "FRAGILE_MARGIN", bound)
    monkeypatch.setattr(confidence, "NEAR_TIE_MARGIN", near)
    cold(engine)
    again = engine.generate(PROMPT, TOKENS, spec)
    assert again.tokens == result.tokens == dense_suffix.reference
    cache = engine.suffix.cache
    entry, _ = next(cache.others(None))  # the newest output: this one's
    lead_in = len(PROMPT[-LEAD_IN:])      # the entry starts with the prompt's tail
    fragile = {i - lead_in: level for i, level in cache.fragile(entry).items()
               if i - lead_in < len(again.tokens)}
    assert fragile == {i: 2 if lead < near else 1 for i, lead in enumerate(leads) if lead < bound}
    assert 1 in fragile.values() and 2 in fragile.values()
    assert 0 < len(fragile) < len(leads)


def test_suffix_needs_an_engine_loaded_for_it(dense_model: Path) -> None:
    """A request may narrow, never widen: suffix on an n-gram engine names the fix."""
    with open_engine(dense_model, SpecMethod.NGRAM) as engine:
        assert engine.suffix is None
        with pytest.raises(ValueError, match="--spec suffix"):
            engine.generate(PROMPT, 4, SpecSettings(method=SpecMethod.SUFFIX))


def test_mtp_suffix_needs_a_head(headless_model: Path) -> None:
    with pytest.raises(ValueError, match="no MTP"):
        open_engine(headless_model, SpecMethod.MTP_SUFFIX)


def test_mtp_suffix_drafts_with_the_head_where_lookup_has_nothing(
        hybrid_mtp_suffix: Subject) -> None:
    """The head drafts where nothing repeats (most of a cold request on the tiny model), the
    lookup where the text does: together they draft more than the lookup alone, and the same
    text."""
    engine = hybrid_mtp_suffix.engine
    runs = {}
    for method in (SpecMethod.SUFFIX, SpecMethod.MTP_SUFFIX):
        cold(engine)
        runs[method] = engine.generate(PROMPT, TOKENS, SpecSettings(method=method, draft_max=4))
    lookup, both = runs[SpecMethod.SUFFIX], runs[SpecMethod.MTP_SUFFIX]
    assert lookup.tokens == both.tokens == hybrid_mtp_suffix.reference
    assert both.telemetry.drafted > lookup.telemetry.drafted
    assert both.telemetry.tokens_per_verify > lookup.telemetry.tokens_per_verify


def cold(engine: SpeculativeEngine) -> None:
    """Forget every earlier output and calibration (the measured row costs stay)."""
    assert engine.suffix is not None
    engine.suffix = engine.suffix.cold()
