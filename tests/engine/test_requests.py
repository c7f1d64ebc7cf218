"""What a request can ask for, and what it gets back: limits, stop strings, streaming,
cancellation, sampling, and the errors for what the engine cannot do."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.capacity import CapacityError
from shared.protocol import FinishReason, SamplingParams, SpecMethod, SpecSettings
from worker.engine.engine import EngineConfig, SpeculativeEngine
from worker.engine.proposers.mtp import MtpUnavailableError
from worker.engine.slot import SlotRequest
from worker.launch import EngineCapacity

from .conftest import PROMPT, Subject, assert_consistent, open_engine

NGRAM4 = SpecSettings(method=SpecMethod.NGRAM, draft_max=4)


def test_headless_model_with_mtp_fails_at_load_with_a_message(headless_model: Path) -> None:
    with pytest.raises(MtpUnavailableError, match="no MTP \\(NextN\\) head"):
        open_engine(headless_model, SpecMethod.MTP)


def test_auto_picks_suffix_with_mtp_beside_it_where_there_is_a_head(
        hybrid_model: Path, headless_model: Path) -> None:
    with open_engine(hybrid_model, SpecMethod.AUTO) as engine:
        assert engine.method is SpecMethod.MTP_SUFFIX
    with open_engine(headless_model, SpecMethod.AUTO) as engine:
        assert engine.method is SpecMethod.SUFFIX


def test_request_cannot_widen_the_engine_method(dense_ngram: Subject) -> None:
    with pytest.raises(ValueError, match="not available"):
        dense_ngram.engine.generate(PROMPT, 5, SpecSettings(method=SpecMethod.MTP))


def test_sampling_without_speculation_is_seeded(soft_hybrid_mtp: Subject) -> None:
    """On the soft-output model a temperature really changes the choice of tokens, and the
    seed a request gave is the one it reports."""
    plain = SpecSettings(method=SpecMethod.NONE)
    runs = [soft_hybrid_mtp.engine.generate(PROMPT, 40, plain,
                                            sampling=SamplingParams(temperature=1.5, seed=s))
            for s in (1, 1, 2)]
    assert runs[0].tokens == runs[1].tokens
    assert runs[0].tokens != runs[2].tokens
    assert runs[0].tokens != soft_hybrid_mtp.reference[:40]
    assert [r.seed for r in runs] == [1, 1, 2]


def test_a_request_without_a_seed_is_given_one_that_reproduces_it(
        soft_hybrid_mtp: Subject) -> None:
    sampled = SamplingParams(temperature=1.5)
    first = soft_hybrid_mtp.engine.generate(PROMPT, 30, sampling=sampled)
    again = soft_hybrid_mtp.engine.generate(
        PROMPT, 30, sampling=sampled.model_copy(update={"seed": first.seed}))
    assert again.tokens == first.tokens


def test_a_draft_max_above_the_capacity_is_refused_and_one_within_it_runs(
        dense_ngram: Subject) -> None:
    """The rule of shared/capacity.py, as at submit: never a silent clamp to N."""
    with pytest.raises(CapacityError, match="draft_max 30 exceeds the worker's draft width 7"):
        dense_ngram.engine.generate(PROMPT, 100, SpecSettings(method="ngram", draft_max=30))
    result = dense_ngram.engine.generate(PROMPT, 100, SpecSettings(method="ngram", draft_max=5))
    assert result.telemetry.draft_max == 5
    assert len(result.telemetry.drafted_per_position) <= 5
    assert result.tokens == dense_ngram.reference[:100]


def test_what_a_request_leaves_unset_is_the_capacity(dense_model: Path) -> None:
    """N = 12 is above SpecSettings' own default width (8): a request without settings, or
    one that sets only a knob, runs with the capacity's method and N (shared/capacity.py,
    as at submit) and the engine's request defaults' knobs."""
    config = EngineConfig(str(dense_model), n_ctx=256, n_threads=1, slots=3,
                          capacity=EngineCapacity(SpecMethod.NGRAM, draft_max=12),
                          request_defaults=SpecSettings(p_min=0.25, adaptive=True, ngram_max=3))
    with SpeculativeEngine(config) as engine:
        bare = engine.admit(SlotRequest(PROMPT, 4))
        knob = engine.admit(SlotRequest(PROMPT, 4, SpecSettings(draft_min=2)))
        narrow = engine.admit(SlotRequest(PROMPT, 4, SpecSettings(draft_max=3)))
        assert [(s.method, s.draft_max) for s in (bare, knob, narrow)] == [
            (SpecMethod.NGRAM, 12), (SpecMethod.NGRAM, 12), (SpecMethod.NGRAM, 3)]
        assert (bare.spec.p_min, bare.spec.adaptive, bare.spec.ngram_max) == (0.25, True, 3)
        assert (knob.spec.p_min, knob.spec.draft_min) == (0.0, 2)
        while engine.active:
            engine.step()


@pytest.mark.parametrize("prompt, max_tokens, message", [
    ([], 5, "empty"),
    (PROMPT, 0, "max_tokens"),
    ([1] * 512, 5, "context holds"),
    ([1, 256], 5, "outside the vocabulary"),
])
def test_bad_requests_are_clear_value_errors(dense_ngram: Subject, prompt: list[int],
                                            max_tokens: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dense_ngram.engine.generate(prompt, max_tokens, NGRAM4)


def test_a_bias_outside_the_vocabulary_is_a_clear_value_error(dense_ngram: Subject) -> None:
    """An engine driven directly refuses a ``logit_bias`` id past its vocabulary, naming the
    field, before anything runs: on the device the id would be gathered out of bounds."""
    bias = SamplingParams(temperature=0.8, logit_bias={3: 1.0, 256: 2.0})
    with pytest.raises(ValueError, match=r"sampling\.logit_bias: token id\(s\) 256 outside"):
        dense_ngram.engine.generate(PROMPT, 5, NGRAM4, sampling=bias)


def test_generation_stops_at_the_end_of_the_context(dense_model: Path) -> None:
    with open_engine(dense_model, SpecMethod.NGRAM, n_ctx=64) as engine:
        result = engine.generate(PROMPT, 500, NGRAM4)
        assert result.finish_reason is FinishReason.CONTEXT
        # Every position of the context was decoded; the last token is committed unverified.
        assert len(PROMPT) + len(result.tokens) == 64 + 1
        assert_consistent(result)


def test_max_tokens_is_exact(dense_ngram: Subject) -> None:
    for n in (1, 2, 9, 33):
        result = dense_ngram.engine.generate(PROMPT, n, NGRAM4)
        assert result.tokens == dense_ngram.reference[:n]
        assert result.finish_reason is FinishReason.LENGTH


def test_stop_string_cuts_text_and_tokens(dense_ngram: Subject) -> None:
    engine, reference = dense_ngram.engine, dense_ngram.reference
    full = engine.detokenize(reference)
    stop = full[60:64]
    cut = full.find(stop)
    # The tokens up to the one that completes the first occurrence of the stop string.
    n = next(i for i in range(1, len(reference) + 1)
             if stop in engine.detokenize(reference[:i]))
    pieces: list[str] = []
    result = engine.generate(PROMPT, 200, NGRAM4, stop=[stop, "never-there"],
                             on_tokens=lambda t, s: pieces.append(s))
    assert result.finish_reason is FinishReason.STOP
    assert result.text == full[:cut]
    assert result.tokens == reference[:n]
    assert "".join(pieces) == result.text  # held-back text is flushed, the stop string is not


def test_streamed_pieces_add_up_to_the_result(dense_ngram: Subject) -> None:
    pieces: list[tuple[list[int], str]] = []
    result = dense_ngram.engine.generate(PROMPT, 200, NGRAM4,
                                         on_tokens=lambda t, s: pieces.append((t, s)))
    assert [t for chunk, _ in pieces for t in chunk] == result.tokens
    assert "".join(s for _, s in pieces) == result.text
    assert len(pieces) == result.telemetry.target_decodes
    assert any(len(chunk) > 1 for chunk, _ in pieces)  # speculation committed groups


def test_should_stop_cancels_between_steps(dense_ngram: Subject) -> None:
    polls: list[int] = []

    def should_stop() -> bool:
        polls.append(1)
        return len(polls) > 5

    result = dense_ngram.engine.generate(PROMPT, 200, NGRAM4, should_stop=should_stop)
    assert result.finish_reason is FinishReason.CANCELLED
    assert result.telemetry.target_decodes == 5
    assert result.tokens == dense_ngram.reference[: len(result.tokens)]


def test_engine_telemetry_is_cumulative(hybrid_model: Path) -> None:
    with open_engine(hybrid_model, SpecMethod.MTP) as engine:
        runs = [engine.generate(PROMPT, 50, SpecSettings(method="mtp", draft_max=w))
                for w in (2, 5)]
        total = engine.telemetry()
    assert total.generated_tokens == 100
    assert total.drafted == sum(r.telemetry.drafted for r in runs)
    assert total.accepted == sum(r.telemetry.accepted for r in runs)
    assert total.target_decodes == sum(r.telemetry.target_decodes for r in runs)
    assert total.accepted_per_position[:2] == [
        sum(r.telemetry.accepted_per_position[i] for r in runs) for i in range(2)]
    assert total.tokens_per_verify == pytest.approx(100 / total.target_decodes)
