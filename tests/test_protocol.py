"""The wire protocol rejects bad input at the edge with messages that name the field."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from shared.keys import Keys
from shared.protocol import (
    MAX_TOKENS_CAP,
    FinalEvent,
    GenerationRequest,
    JobStatus,
    Priority,
    SpecMethod,
    SpecSettings,
    Telemetry,
    TokenEvent,
    TokenLogprob,
    TopLogprob,
    describe_validation_error,
    parse_event,
)


def _error_locs(exc: ValidationError) -> list[str]:
    return [".".join(str(p) for p in e["loc"]) for e in exc.errors()]


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": MAX_TOKENS_CAP + 1}, "max_tokens"),
        ({"prompt": "hi", "sampling": {"temperature": -0.5}}, "sampling.temperature"),
        ({"prompt": "hi", "sampling": {"temperature": 2.5}}, "sampling.temperature"),
        ({"prompt": "hi", "sampling": {"top_p": 0.0}}, "sampling.top_p"),
        ({"prompt": "hi", "sampling": {"top_k": -1}}, "sampling.top_k"),
        ({"prompt": "hi", "sampling": {"min_p": 1.5}}, "sampling.min_p"),
        ({"prompt": "hi", "sampling": {"repetition_penalty": 0.0}},
         "sampling.repetition_penalty"),
        ({"prompt": "hi", "sampling": {"presence_penalty": 2.5}}, "sampling.presence_penalty"),
        ({"prompt": "hi", "sampling": {"frequency_penalty": -3.0}},
         "sampling.frequency_penalty"),
        ({"prompt": "hi", "sampling": {"seed": -1}}, "sampling.seed"),
        ({"prompt": "hi", "sampling": {"seed": 2**63}}, "sampling.seed"),
        ({"prompt": "hi", "sampling": {"top_n": 3}}, "sampling.top_n"),
        ({"prompt": "hi", "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"prompt": "hi", "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"prompt": "hi", "speculative": {"draft_max": 0}}, "speculative.draft_max"),
        ({"prompt": "hi", "speculative": {"p_min": 1.5}}, "speculative.p_min"),
        ({"prompt": "hi", "speculative": {"method": "medusa"}}, "speculative.method"),
        ({"prompt_tokens": [1, -2, 3]}, "prompt_tokens.1"),
        ({"prompt": "hi", "stop": [""]}, "stop.0"),
        ({"prompt": "hi", "model": "bad name!"}, "model"),
        ({"prompt": "hi", "colour": "red"}, "colour"),
    ],
)
def test_bad_field_is_named(payload: dict, field: str) -> None:
    with pytest.raises(ValidationError) as info:
        GenerationRequest.model_validate(payload)
    assert field in _error_locs(info.value)


@pytest.mark.parametrize(
    ("payload", "fragment"),
    [
        ({}, "exactly one of 'prompt'"),
        ({"prompt": "a", "prompt_tokens": [1]}, "exactly one of 'prompt'"),
        ({"prompt": "a", "temperature": 0.7},
         "'temperature' belongs in 'sampling' (send sampling.temperature)"),
        ({"prompt": "a", "seed": 1, "top_p": 0.9},
         "'seed', 'top_p' belong in 'sampling' (send sampling.seed, sampling.top_p)"),
        ({"prompt": "a", "top_logprobs": 3}, "'top_logprobs' (3) needs 'logprobs': true"),
        ({"prompt": "a", "speculative": {"draft_max": 3, "rollback_depth": 4}}, "rollback_depth"),
        ({"prompt": "a", "speculative": {"draft_max": 3, "draft_min": 4}}, "draft_min"),
    ],
)
def test_cross_field_rules_explain_themselves(payload: dict, fragment: str) -> None:
    with pytest.raises(ValidationError) as info:
        GenerationRequest.model_validate(payload)
    assert fragment in str(info.value)


def test_sampling_combines_with_every_speculative_method() -> None:
    for method in SpecMethod:
        req = GenerationRequest.model_validate(
            {"prompt": "a", "sampling": {"temperature": 0.7, "top_p": 0.9},
             "speculative": {"method": str(method)}})
        assert req.sampling.temperature == 0.7 and req.speculative.method is method
    assert GenerationRequest(prompt="a").sampling.greedy  # the default stays greedy


def test_logprobs_are_off_unless_asked_for() -> None:
    assert GenerationRequest(prompt="a").logprobs_k is None
    assert GenerationRequest(prompt="a", logprobs=True).logprobs_k == 0
    assert GenerationRequest(prompt="a", logprobs=True, top_logprobs=20).logprobs_k == 20


def test_a_request_without_a_seed_is_given_one_that_travels() -> None:
    """``with_seed`` (what submit does before queueing): a drawn seed, marked as set, so the
    queued dict (``exclude_unset``) carries it; a request's own seed is kept."""
    sampled = GenerationRequest.model_validate(
        {"prompt": "a", "sampling": {"temperature": 0.5}})
    seeded = sampled.with_seed()
    seed = seeded.sampling.seed
    assert isinstance(seed, int) and 0 <= seed < 2**53
    queued = seeded.model_dump(mode="json", exclude_unset=True)
    assert queued["sampling"] == {"temperature": 0.5, "seed": seed}
    assert GenerationRequest.model_validate(queued) == seeded
    assert {GenerationRequest(prompt="a").with_seed().sampling.seed for _ in range(8)} != {seed}
    own = GenerationRequest.model_validate({"prompt": "a", "sampling": {"seed": 7}})
    assert own.with_seed().sampling.seed == 7


def test_logprobs_travel_on_token_and_final_events() -> None:
    alt = TopLogprob(token=3, text="c", bytes=[99], logprob=-1.5)
    lp = TokenLogprob(token=5, text="é", bytes=[195, 169], logprob=-0.25, top_logprobs=[alt])
    tok = TokenEvent(job_id="j", attempt=1, seq=0, tokens=[5], text="é", index=0,
                     logprobs=[lp])
    fin = FinalEvent(job_id="j", attempt=1, seq=1, status=JobStatus.FINISHED, tokens=[5],
                     seed=123, logprobs=[lp])
    assert parse_event(tok.model_dump_json()) == tok
    back = parse_event(fin.model_dump_json())
    assert isinstance(back, FinalEvent) and back.seed == 123 and back.logprobs == [lp]
    plain = parse_event(TokenEvent(job_id="j", attempt=1, seq=0, tokens=[5], text="x",
                                   index=0).model_dump_json())
    assert isinstance(plain, TokenEvent) and plain.logprobs is None


def test_request_round_trips_through_json() -> None:
    req = GenerationRequest(prompt_tokens=[1, 2, 3], max_tokens=5, priority=Priority.HIGH,
                            speculative=SpecSettings(method="ngram", draft_max=6, adaptive=True))
    assert GenerationRequest.model_validate_json(req.model_dump_json()) == req


def test_events_are_discriminated_by_type() -> None:
    tok = TokenEvent(job_id="j", attempt=1, seq=0, tokens=[5, 6], text="ab", index=0)
    fin = FinalEvent(job_id="j", attempt=2, seq=9, status=JobStatus.FINISHED, tokens=[5, 6],
                     telemetry=Telemetry(drafted=4, accepted=3))
    assert parse_event(tok.model_dump_json()) == tok
    back = parse_event(fin.model_dump_json())
    assert isinstance(back, FinalEvent) and back.telemetry.accepted == 3
    with pytest.raises(ValidationError):
        parse_event(json.dumps({"type": "nope", "job_id": "j", "attempt": 1, "seq": 0}))


def test_keys_are_namespaced_per_prefix() -> None:
    a, b = Keys("a"), Keys("b")
    assert a.events("j") != b.events("j")
    assert a.queues("m") == ["a:m:high", "a:m"]


def test_validation_errors_read_as_one_line_naming_each_field() -> None:
    with pytest.raises(ValidationError) as bad_fields:
        GenerationRequest.model_validate({"prompt": "a", "max_tokens": 0,
                                          "sampling": {"seed": -1}})
    line = describe_validation_error(bad_fields.value)
    assert "\n" not in line
    assert line.startswith("max_tokens: ") and "; sampling.seed: " in line
    with pytest.raises(ValidationError) as rule:
        GenerationRequest.model_validate({"prompt": "a", "temperature": 0.5})
    assert describe_validation_error(rule.value) == (
        "request: 'temperature' belongs in 'sampling' (send sampling.temperature)")


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({"prompt": "hi", "max_tokens": True}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": "10"}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 10.0}, "max_tokens"),
        ({"prompt_tokens": ["1", 2.0]}, "prompt_tokens.0"),
        ({"prompt_tokens": [1, 2.0]}, "prompt_tokens.1"),
        ({"prompt": "hi", "sampling": {"seed": False}}, "sampling.seed"),
        ({"prompt": "hi", "sampling": {"seed": 3.0}}, "sampling.seed"),
        ({"prompt": "hi", "sampling": {"temperature": True}}, "sampling.temperature"),
        ({"prompt": "hi", "sampling": {"top_k": "40"}}, "sampling.top_k"),
        ({"prompt": "hi", "logprobs": 1}, "logprobs"),
        ({"prompt": "hi", "logprobs": True, "top_logprobs": 2.0}, "top_logprobs"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": "hi", "speculative": {"draft_max": "4"}}, "speculative.draft_max"),
        ({"prompt": "hi", "speculative": {"adaptive": 1}}, "speculative.adaptive"),
        ({"prompt": "hi", "priority": 1}, "priority"),
        ({"prompt": "hi", "priority": True}, "priority"),
    ],
)
def test_wire_types_are_not_coerced(payload: dict, field: str) -> None:
    """Strict on the wire: from a dict (what rq hands the worker) and from JSON alike."""
    for validate in (GenerationRequest.model_validate,
                     lambda p: GenerationRequest.model_validate_json(json.dumps(p))):
        with pytest.raises(ValidationError) as info:
            validate(payload)
        assert field in _error_locs(info.value)


def test_enum_values_and_whole_floats_still_parse() -> None:
    payload = {"prompt_tokens": [1, 2], "priority": "high", "sampling": {"temperature": 1},
               "speculative": {"method": "none", "p_min": 0}}
    for req in (GenerationRequest.model_validate(payload),
                GenerationRequest.model_validate_json(json.dumps(payload))):
        assert req.priority is Priority.HIGH and req.speculative.method is SpecMethod.NONE
        assert req.sampling.temperature == 1.0 and isinstance(req.sampling.temperature, float)


def test_events_and_fit_reports_are_strict_too() -> None:
    with pytest.raises(ValidationError):
        parse_event(json.dumps({"type": "token", "job_id": "j", "attempt": "1", "seq": 0,
                                "tokens": [1], "text": "a", "index": 0}))
    with pytest.raises(ValidationError):
        parse_event(json.dumps({"type": "final", "job_id": "j", "attempt": 1, "seq": 0,
                                "status": "finished", "tokens": [True]}))
    final = parse_event(json.dumps({"type": "final", "job_id": "j", "attempt": 1, "seq": 0,
                                    "status": "finished", "finish_reason": "length"}))
    assert isinstance(final, FinalEvent) and final.status is JobStatus.FINISHED


def test_messages_never_carry_pydantics_prefix() -> None:
    bad = [{"prompt": "a", "temperature": 0.5}, {"prompt": "a", "priority": "bogus"},
           {"prompt": "a", "top_logprobs": 2},
           {"prompt": "a", "speculative": {"draft_max": 3, "draft_min": 4}}, {"prompt": []}]
    for payload in bad:
        with pytest.raises(ValidationError) as info:
            GenerationRequest.model_validate(payload)
        line = describe_validation_error(info.value)
        assert "Value error" not in line and "\n" not in line
    with pytest.raises(ValidationError) as info:
        GenerationRequest.model_validate({"prompt": "a", "priority": "bogus"})
    assert describe_validation_error(info.value) == "priority: Input should be 'normal' or 'high'"
