"""Every optional field of OpenAI's own request types, read from the installed ``openai``
package: sent as ``null`` it is the default (OpenAI types them all nullable), and sent at its
neutral value it is honoured or accepted as neutral; a field we cannot serve is refused by
name, never with a type error for a value OpenAI's schema allows. A field the package adds
fails here until it is given a neutral value below and a rule in ``fields.py``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params
from openai.types.responses import response_create_params

from coordinator.openai_api.fields import RequestError
from coordinator.openai_api.requests import CHAT, COMPLETIONS, parse_body
from coordinator.openai_api.responses import parse_responses

#: Each endpoint: the fields its body needs, a minimal body, its parser, and OpenAI's type.
ENDPOINTS: dict[str, tuple[frozenset[str], dict[str, Any], Callable[[dict[str, Any]], Any],
                           Any]] = {
    "chat": (frozenset({"model", "messages"}),
             {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
             lambda body: parse_body(CHAT, body), chat_create_params.CompletionCreateParamsBase),
    "completions": (frozenset({"model", "prompt"}), {"model": "m", "prompt": "hi"},
                    lambda body: parse_body(COMPLETIONS, body),
                    completion_create_params.CompletionCreateParamsBase),
    "responses": (frozenset({"model", "input"}), {"model": "m", "input": "hi"},
                  lambda body: parse_responses(body, {}),
                  response_create_params.ResponseCreateParamsBase),
}
#: A value of each optional field that asks for nothing OpenAI's default answer does not
#: give (its default, or what changes nothing).
NEUTRAL: dict[str, Any] = {
    "audio": None, "background": False, "best_of": 1, "context_management": None,
    "conversation": None, "echo": False, "frequency_penalty": 0.0, "function_call": "none",
    "functions": [], "include": [], "instructions": "be brief", "logit_bias": {},
    "logprobs": False, "max_completion_tokens": 8, "max_output_tokens": 8,
    "max_tokens": 8, "max_tool_calls": None, "metadata": {"k": "v"}, "modalities": ["text"],
    "moderation": None, "n": 1, "parallel_tool_calls": True, "prediction": None,
    "presence_penalty": 0.0, "previous_response_id": None, "prompt": None,
    "prompt_cache_key": "k", "prompt_cache_options": {}, "prompt_cache_retention": "24h",
    "reasoning": None, "reasoning_effort": None, "response_format": {"type": "text"},
    "safety_identifier": "s", "seed": 7, "service_tier": "auto", "stop": [], "store": False,
    "stream": False, "stream_options": None, "suffix": None, "temperature": 1.0,
    "text": {"format": {"type": "text"}}, "tool_choice": "none", "tools": [],
    "top_logprobs": None, "top_p": 1.0, "truncation": "disabled", "user": "u",
    "verbosity": None, "web_search_options": None,
}
#: What the completions endpoint calls ``logprobs`` is a count (0: the chosen token's only).
NEUTRAL_BY_ENDPOINT: dict[tuple[str, str], Any] = {("completions", "logprobs"): None}


def _optional(name: str) -> list[str]:
    required, _, _, params = ENDPOINTS[name]
    return sorted((set(params.__optional_keys__) | {"stream"}) - required)


CASES = [(name, field) for name in ENDPOINTS for field in _optional(name)]


def _answer(name: str, field: str, value: Any) -> RequestError | None:
    _, body, parse, _ = ENDPOINTS[name]
    try:
        parse({**body, field: value})
    except RequestError as exc:
        return exc
    return None


@pytest.mark.parametrize(("endpoint", "field"), CASES)
def test_null_is_the_default(endpoint: str, field: str) -> None:
    error = _answer(endpoint, field, None)
    assert error is None, f"{endpoint}.{field}: null refused: {error}"


@pytest.mark.parametrize(("endpoint", "field"), CASES)
def test_a_neutral_value_is_honoured_or_refused_by_name(endpoint: str, field: str) -> None:
    assert field in NEUTRAL, f"{field}: a new field of OpenAI's; give it a neutral value here"
    value = NEUTRAL_BY_ENDPOINT.get((endpoint, field), NEUTRAL[field])
    error = _answer(endpoint, field, value)
    if error is not None:
        assert error.param == field and "should be a valid" not in str(error), (
            f"{endpoint}.{field}={value!r}: {error}")
