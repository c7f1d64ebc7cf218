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
from openai.types.chat import ChatCompletionAssistantMessageParam, ChatCompletionUserMessageParam
from openai.types.chat import completion_create_params as chat_create_params
from openai.types.responses import (
    EasyInputMessageParam,
    FunctionToolParam,
    ResponseFunctionToolCallParam,
    response_create_params,
)
from openai.types.responses.response_input_item_param import FunctionCallOutput

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


#: Shapes inside a body, from OpenAI's own types: where one sits, the body that holds a
#: minimal one there, and its type. Every key the type has is read at a neutral value, or
#: refused naming it (a key the package adds fails here until it has a neutral value).
_TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}
_CALL = {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}
NESTED: dict[str, tuple[str, dict[str, Any], Any]] = {
    "responses tool": ("tools.0", {"tools": [_TOOL]}, FunctionToolParam),
    "function_call item": ("input.0", {"input": [_CALL]}, ResponseFunctionToolCallParam),
    "function_call_output item": ("input.1", {"input": [_CALL, {
        "type": "function_call_output", "call_id": "c", "output": "x"}]}, FunctionCallOutput),
    "input message": ("input.0", {"input": [{"role": "user", "content": "hi"}]},
                      EasyInputMessageParam),
    "chat user message": ("messages.0", {"messages": [{"role": "user", "content": "hi"}]},
                          ChatCompletionUserMessageParam),
    "chat assistant message": ("messages.1", {"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}]},
        ChatCompletionAssistantMessageParam),
}
#: A neutral value of each key of those shapes (what asks for nothing beyond the minimum).
NESTED_NEUTRAL: dict[str, Any] = {
    "allowed_callers": ["direct"], "arguments": "{}", "audio": None, "call_id": "c",
    "caller": {"type": "direct"}, "content": "hi", "defer_loading": False,
    "description": "d", "function_call": None, "id": "x1", "name": "f", "namespace": "ns",
    "output": "x", "output_schema": None, "parameters": {"type": "object"},
    "phase": "final_answer", "refusal": None, "role": "user", "status": "completed",
    "strict": True, "tool_calls": None, "type": "function",
}
#: Keys whose neutral value depends on the shape.
NESTED_NEUTRAL_BY_SHAPE: dict[tuple[str, str], Any] = {
    ("function_call item", "type"): "function_call",
    ("function_call_output item", "type"): "function_call_output",
    ("input message", "type"): "message", ("chat assistant message", "role"): "assistant",
    ("chat user message", "name"): "ada", ("chat assistant message", "name"): "ada",
}
NESTED_CASES = [(shape, key) for shape, (_, _, kind) in NESTED.items()
                for key in sorted(kind.__annotations__)]


def _nested_body(shape: str, key: str, value: Any) -> dict[str, Any]:
    where, body, _ = NESTED[shape]
    field, index = where.split(".")
    items = [dict(item) for item in body[field]]
    items[int(index)][key] = value
    return {**body, field: items}


@pytest.mark.parametrize(("shape", "key"), NESTED_CASES)
def test_a_nested_key_is_read_or_refused_by_name(shape: str, key: str) -> None:
    assert key in NESTED_NEUTRAL, f"{shape}.{key}: a new key of OpenAI's; give it a value here"
    value = NESTED_NEUTRAL_BY_SHAPE.get((shape, key), NESTED_NEUTRAL[key])
    where, _, _ = NESTED[shape]
    endpoint = "chat" if where.startswith("messages") else "responses"
    error = _answer_body(endpoint, _nested_body(shape, key, value))
    if error is not None:
        assert error.param == f"{where}.{key}" and "should be a valid" not in str(error), (
            f"{shape}.{key}={value!r}: {error}")


def _answer_body(name: str, extra: dict[str, Any]) -> RequestError | None:
    _, body, parse, _ = ENDPOINTS[name]
    try:
        parse({**body, **extra})
    except RequestError as exc:
        return exc
    return None


def test_a_message_name_reaches_the_worker_unless_it_could_hide_markup() -> None:
    """OpenAI's names (letters, digits, ``_``, ``-``) go to the worker, whose template renders
    them or refuses the request naming the field; anything else is refused here."""
    assert _answer_body("chat", _nested_body("chat user message", "name", "ada_2")) is None
    error = _answer_body("chat", _nested_body("chat user message", "name", "<|im_end|>"))
    assert error is not None and error.param == "messages.0.name"
