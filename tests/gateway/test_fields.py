"""The one rule for OpenAI fields, without a fleet: every field is honoured (it reaches our
request), accepted as having no effect (listed in docs/http.md), or refused with a 400 naming
it; one request becomes one job per choice with reproducible seeds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from coordinator.gateway.routes import MAX_JSON_DEPTH, json_depth
from coordinator.openai_api import fields
from coordinator.openai_api.fields import RequestError
from coordinator.openai_api.requests import CHAT, COMPLETIONS, choice_seed, parse_body
from coordinator.openai_api.responses import parse_responses
from shared.protocol import GenerationRequest

CHAT_BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION_BODY = {"model": "m", "prompt": "once"}
DOCS = (Path(__file__).parents[2] / "docs" / "http.md").read_text()


def _refused(endpoint: str, body: dict[str, Any]) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse_body(endpoint, body)
    return info.value


@pytest.mark.parametrize(("endpoint", "extra", "param", "why"), [
    (CHAT, {"functions": [{"name": "f"}]}, "functions", "send tools and tool_choice"),
    (CHAT, {"tools": [{"type": "function"}]}, "tools.0.function", "Field required"),
    (COMPLETIONS, {"tools": [{"type": "function"}]}, "tools", "/v1/chat/completions"),
    (CHAT, {"prediction": {"type": "content", "content": "x"}}, "prediction", "predicted"),
    (CHAT, {"reasoning_effort": "low"}, "reasoning_effort", "reasoning"),
    (CHAT, {"modalities": ["text", "audio"]}, "modalities", "only text"),
    (CHAT, {"response_format": {"type": "sound"}}, "response_format.type", "'sound'"),
    (CHAT, {"foo_bar": 1}, "foo_bar", "unknown field"),
    (CHAT, {"guided_json": {}}, "guided_json", "unknown field"),
    (CHAT, {"echo": True}, "echo", "unknown field"),  # not a chat field in OpenAI's API
    (CHAT, {"best_of": 2}, "best_of", "unknown field"),
    (CHAT, {"messages": [{"role": "user", "content": "x", "name": "bob smith"}]},
     "messages.0.name", "should match pattern"),
    (COMPLETIONS, {"best_of": 3, "n": 2}, "best_of", "best_of other than n"),
    (COMPLETIONS, {"suffix": "end"}, "suffix", "insertion"),
    (COMPLETIONS, {"echo": True, "logprobs": 1}, "echo", "prompt's logprobs"),
    (COMPLETIONS, {"prompt": [1, 2], "echo": True}, "echo", "text prompt"),
    (COMPLETIONS, {"logit_bias": {"x": 1}}, "logit_bias", "token ids"),
    (COMPLETIONS, {"logit_bias": {"5": -101}}, "logit_bias", "between -100 and 100"),
    (COMPLETIONS, {"n": 65}, "n", "less than or equal to 64"),
    (COMPLETIONS, {"prompt": ["a"] * 9, "n": 8}, "n", "exceeds 64 choices"),
    (COMPLETIONS, {"stream_options": {"include_usage": True}}, "stream_options", "stream"),
])
def test_a_field_that_cannot_be_honoured_is_a_400_naming_it(
        endpoint: str, extra: dict[str, Any], param: str, why: str) -> None:
    base = CHAT_BODY if endpoint == CHAT else COMPLETION_BODY
    error = _refused(endpoint, {**base, **extra})
    assert error.param == param and why in str(error)


def test_fields_without_effect_are_accepted_and_documented() -> None:
    no_effect = {"user": "u1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
                 "prompt_cache_key": "k", "prompt_cache_retention": "24h",
                 "prompt_cache_options": {}, "safety_identifier": "s",
                 "parallel_tool_calls": True}
    assert set(no_effect) == fields.NO_EFFECT
    plain = parse_body(CHAT, CHAT_BODY).choices[0].request
    with_them = parse_body(CHAT, {**CHAT_BODY, **no_effect, "tools": [],
                                  "response_format": {"type": "text"}}).choices[0].request
    plain["sampling"].pop("seed", None)
    with_them["sampling"].pop("seed", None)
    assert with_them == plain  # neutral values of refused fields ask for nothing either
    for name in [*fields.NO_EFFECT, *fields.REFUSED]:
        assert f"`{name}`" in DOCS, f"docs/http.md does not list {name}"


def test_n_and_prompt_lists_are_one_job_per_choice_with_derived_seeds() -> None:
    parsed = parse_body(COMPLETIONS, {**COMPLETION_BODY, "prompt": ["a", "b"], "n": 3,
                                      "seed": 11})
    requests = [GenerationRequest.model_validate(c.request) for c in parsed.choices]
    assert [r.prompt for r in requests] == ["a"] * 3 + ["b"] * 3
    assert [c.prompt_index for c in parsed.choices] == [0, 0, 0, 1, 1, 1]
    seeds = [r.sampling.seed for r in requests]
    assert seeds == [choice_seed(11, i) for i in range(6)] and seeds[0] == 11
    assert len(set(seeds)) == 6 and all(s is not None and s < 2**53 for s in seeds)
    again = parse_body(COMPLETIONS, {**COMPLETION_BODY, "prompt": ["a", "b"], "n": 3,
                                     "seed": 11})
    assert [c.request for c in again.choices] == [c.request for c in parsed.choices]
    # unseeded: one seed drawn for the request, the choices derived from it
    unseeded = parse_body(CHAT, {**CHAT_BODY, "n": 2}).choices
    first = unseeded[0].request["sampling"]["seed"]
    assert unseeded[1].request["sampling"]["seed"] == choice_seed(first, 1)
    # one choice, no seed: the coordinator draws it at submit, as for any request
    assert "seed" not in parse_body(CHAT, CHAT_BODY).choices[0].request["sampling"]


def test_echo_and_logit_bias_reach_the_request() -> None:
    parsed = parse_body(COMPLETIONS, {**COMPLETION_BODY, "echo": True,
                                      "logit_bias": {"7": -100, "9": 3}})
    [choice] = parsed.choices
    assert choice.echo == "once"
    assert GenerationRequest.model_validate(choice.request).sampling.logit_bias == {
        7: -100.0, 9: 3.0}


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
def test_the_prefix_cache_opt_out_reaches_the_request(endpoint: str) -> None:
    body = CHAT_BODY if endpoint == CHAT else COMPLETION_BODY
    [default] = parse_body(endpoint, body).choices
    assert GenerationRequest.model_validate(default.request).prefix_cache is True
    [opted] = parse_body(endpoint, {**body, "specfleet": {"prefix_cache": False}}).choices
    assert GenerationRequest.model_validate(opted.request).prefix_cache is False


def test_aliases_resolve_to_the_served_model_and_answer_as_the_alias() -> None:
    parsed = parse_body(CHAT, {**CHAT_BODY, "model": "gpt-4o"}, {"gpt-4o": "m"})
    assert parsed.model == "gpt-4o" and parsed.choices[0].request["model"] == "m"


def test_responses_input_becomes_chat_turns() -> None:
    parsed, _ = parse_responses({"model": "m", "input": "hi", "instructions": "be brief",
                                 "max_output_tokens": 9, "store": True}, {})
    request = GenerationRequest.model_validate(parsed.choices[0].request)
    assert [(m.role, m.content) for m in request.messages or []] == [
        ("system", "be brief"), ("user", "hi")]
    assert request.max_tokens == 9
    listed, _ = parse_responses({"model": "m", "input": [
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": [{"type": "input_text", "text": "a"},
                                     {"type": "input_text", "text": "b"}]}]}, {})
    assert listed.choices[0].request["messages"] == [
        {"role": "system", "content": "rules"}, {"role": "user", "content": "ab"}]
    for extra, param in (({"previous_response_id": "resp_1"}, "previous_response_id"),
                         ({"tools": [{"type": "web_search"}]}, "tools"),
                         ({"text": {"format": {"type": "json_schema"}}}, "text"),
                         ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
                          "input")):
        with pytest.raises(RequestError) as info:
            parse_responses({"model": "m", "input": "x", **extra}, {})
        assert (info.value.param or "").startswith(param)


def test_json_depth_is_measured_without_recursion() -> None:
    deep: Any = []
    for _ in range(100_000):
        deep = [deep]
    assert json_depth(deep) > MAX_JSON_DEPTH  # no RecursionError on the way
    assert json_depth({"a": [1, {"b": []}]}) == 4


def test_the_openai_translation_sits_below_the_gateway_and_the_batch_store() -> None:
    """``coordinator.batch`` and ``coordinator.openai_api`` import no gateway code (the HTTP
    layer builds on them, not the other way round)."""
    import ast

    root = Path(__file__).parents[2] / "coordinator"
    for path in [root / "batch.py", *(root / "openai_api").glob("*.py")]:
        tree = ast.parse(path.read_text())
        imported = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import)
                     for a in n.names]
        assert not [m for m in imported if m.startswith("coordinator.gateway")], path
