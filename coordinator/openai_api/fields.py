"""The one rule for every field of an OpenAI request: honoured, accepted without effect, or
refused with a 400 that names it.

OpenAI clients send fields that carry no behaviour in OpenAI's own answer (who the end user
is, tags for its dashboard, storage and routing hints): those are accepted and listed in
docs/http.md (``NO_EFFECT``). Fields that would change the answer and that we cannot honour
are refused by name with the reason (``REFUSED``), except at their neutral value (``tools:
[]`` changes nothing). Anything else unknown is refused as unknown: a typo, or a field of
another server (``guided_json``), never silently does nothing.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from shared.protocol import describe_validation_error

#: Accepted and ignored: OpenAI's answer does not depend on them either.
NO_EFFECT = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key",
                       "safety_identifier", "parallel_tool_calls"})

_TOOLS = "tools are served on /v1/chat/completions"
_FUNCTIONS = "the deprecated functions API is not supported: send tools and tool_choice"
#: Fields that would change the answer, and why they cannot be honoured (where the endpoint
#: does not read them: ``screen``'s ``honoured``).
REFUSED: dict[str, str] = {
    "tools": _TOOLS, "tool_choice": _TOOLS, "functions": _FUNCTIONS,
    "function_call": _FUNCTIONS,
    "response_format": "the Responses API takes text.format, not response_format",
    "text": "text.format is the Responses API's: send response_format",
    "prediction": "predicted outputs are not supported",
    "reasoning_effort": "reasoning settings are not supported",
    "reasoning": "reasoning settings are not supported",
    "modalities": "only text output is supported",
    "audio": "audio output is not supported",
    "web_search_options": "web search is not supported",
    "verbosity": "verbosity is not supported",
    "previous_response_id": "responses are not stored, so none can be continued",
    "background": "background responses are not supported",
    "include": "no extra output items can be included",
    "truncation": "only truncation 'disabled' is supported (a prompt too long is a 400)",
    "max_tool_calls": _TOOLS,
    "prompt": "stored prompt templates are not supported",
}
#: The values of refused fields that ask for nothing (what the default answer already is).
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "tools": ([],), "tool_choice": ("none",), "functions": ([],),
    "response_format": ({"type": "text"},), "text": ({"format": {"type": "text"}}, {}),
    "modalities": (["text"],), "truncation": ("disabled",), "include": ([],),
}


class Strict(BaseModel):
    """Types are strict (``true`` is not a number, ``"10"`` is not an int), as on our own
    wire, and an unknown field is refused by name."""

    model_config = ConfigDict(extra="forbid", strict=True)


class RequestError(ValueError):
    """A request that cannot be served as sent; ``param`` names the field, ``code`` is
    OpenAI's error code where it has one (``context_length_exceeded``)."""

    def __init__(self, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def screen(body: Mapping[str, Any], honoured: Collection[str]) -> dict[str, Any]:
    """``body`` without the fields that have no effect; ``RequestError`` for a refused field
    that asks for something. ``honoured`` are the fields this endpoint reads (a field both
    refused here and honoured there, such as ``text`` on the Responses API, is read)."""
    kept: dict[str, Any] = {}
    for name, value in body.items():
        if name in NO_EFFECT and name not in honoured:
            continue
        if name in REFUSED and name not in honoured:
            if value is None or any(value == n for n in NEUTRAL.get(name, ())):
                continue
            raise RequestError(f"{name}: {REFUSED[name]}", param=name)
        kept[name] = value
    return kept


def from_validation(exc: ValidationError) -> RequestError:
    """A ``RequestError`` naming the first bad field, with every problem in the message; an
    unknown field says so in words instead of pydantic's "extra inputs"."""
    errors: list[dict[str, Any]] = []
    for err in exc.errors(include_url=False):
        if err["type"] == "extra_forbidden":
            errors.append({**err, "msg": "unknown field (docs/http.md lists the fields "
                                         "honoured)"})
        else:
            errors.append(dict(err))
    first = ".".join(str(p) for p in errors[0]["loc"]) if errors else None
    return RequestError(describe_validation_error(errors, subject="body") or "invalid request",
                        param=first or None)
