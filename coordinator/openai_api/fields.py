"""The one rule for every field of an OpenAI request: honoured, accepted without effect, or
refused with a 400 that names it.

OpenAI clients send fields that carry no behaviour in OpenAI's own answer (who the end user
is, tags for its dashboard, storage and routing hints): those are accepted and listed in
docs/http.md (``NO_EFFECT``), typed as OpenAI types them (:class:`NoEffect`: a wrong type is a
400 naming the field, as OpenAI answers it, so a client that works here works there). Fields
that would change the answer and that we cannot honour are refused by name with the reason
(``REFUSED``), except at their neutral value (``tools: []`` changes nothing). Anything else
unknown is refused as unknown: a typo, or a field of another server (``guided_json``), never
silently does nothing.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Annotated, Any, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationError, model_validator

from shared.protocol import describe_validation_error

_TOOLS = "tools are served on /v1/chat/completions and /v1/responses"
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
    "max_tool_calls": "max_tool_calls limits built-in tools (web search, file search, ...), "
                      "which are not served",
    "prompt": "stored prompt templates are not supported",
    "moderation": "moderation of the output is not supported",
    "conversation": "conversations are not stored: send the turns so far in input",
    "context_management": "responses are not stored, so there is no context to manage",
    "top_logprobs": "logprobs are served on /v1/chat/completions and /v1/completions",
}
#: The values of refused fields that ask for nothing (what the default answer already is).
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "tools": ([],), "tool_choice": ("none",), "functions": ([],),
    "response_format": ({"type": "text"},), "text": ({"format": {"type": "text"}}, {}),
    "modalities": (["text"],), "truncation": ("disabled",), "include": ([],),
}


class Strict(BaseModel):
    """Types are strict (``true`` is not a number, ``"10"`` is not an int), as on our own
    wire, and an unknown field is refused by name. ``null`` is the field's default, as
    OpenAI's schema types every optional field nullable (``"n": null`` is ``n`` 1, not "Input
    should be a valid integer"); a required field sent as ``null`` is still missing."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        known = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
        return {k: v for k, v in data.items() if v is not None or k not in known}


#: OpenAI's limits on ``metadata``: pairs, and characters per key and per value.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512


def _metadata(pairs: dict[str, str]) -> dict[str, str]:
    """OpenAI's rule for ``metadata``, checked here so the 400 names the field (and the key)
    rather than a position inside it."""
    if len(pairs) > MAX_METADATA_PAIRS:
        raise ValueError(f"at most {MAX_METADATA_PAIRS} pairs, not {len(pairs)}")
    for key, value in pairs.items():
        if len(key) > MAX_METADATA_KEY:
            raise ValueError(f"key {key[:MAX_METADATA_KEY]!r}...: keys are at most "
                             f"{MAX_METADATA_KEY} characters")
        if len(value) > MAX_METADATA_VALUE:
            raise ValueError(f"key {key!r}: values are at most {MAX_METADATA_VALUE} characters")
    return pairs


#: OpenAI's ``metadata``: string pairs within its limits.
Metadata = Annotated[dict[str, str], AfterValidator(_metadata)]


class NoEffect(Strict):
    """The fields accepted without effect, with OpenAI's types (null is each one's default):
    checked, then dropped. ``NO_EFFECT`` is read from here, so a field added here is accepted
    on every endpoint, typed, at once."""

    user: str | None = None
    metadata: Metadata | None = None
    store: bool | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_key: str | None = None
    #: How long OpenAI keeps a prompt's cache (prefix reuse here is the worker's own).
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = None
    parallel_tool_calls: bool | None = None


#: Accepted and ignored: OpenAI's answer does not depend on them either.
NO_EFFECT = frozenset(NoEffect.model_fields)


class RequestError(ValueError):
    """A request that cannot be served as sent; ``param`` names the field, ``code`` is
    OpenAI's error code where it has one (``context_length_exceeded``)."""

    def __init__(self, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def screen(body: Mapping[str, Any], honoured: Collection[str]) -> dict[str, Any]:
    """``body`` without the fields that have no effect (once their types are checked);
    ``RequestError`` for one of the wrong type, or for a refused field that asks for
    something. ``honoured`` are the fields this endpoint reads (a field both refused here and
    honoured there, such as ``text`` on the Responses API, is read)."""
    unread = {name: value for name, value in body.items()
              if name in NO_EFFECT and name not in honoured}
    try:
        NoEffect.model_validate(unread)
    except ValidationError as exc:
        raise from_validation(exc) from None
    kept: dict[str, Any] = {}
    for name, value in body.items():
        if name in unread:
            continue
        if name in REFUSED and name not in honoured:
            if value is None or any(value == n for n in NEUTRAL.get(name, ())):
                continue
            raise RequestError(f"{name}: {REFUSED[name]}", param=name)
        kept[name] = value
    return kept


def from_validation(exc: ValidationError, arms: Collection[str] = ()) -> RequestError:
    """A ``RequestError`` naming the first bad field, with every problem in the message; an
    unknown field says so in words instead of pydantic's "extra inputs". ``arms`` are the
    tags of a tagged union of list items (the Responses API's input items), which pydantic
    puts in ``loc`` after the item's index though the body has no such key: left out."""
    errors: list[dict[str, Any]] = []
    for err in exc.errors(include_url=False):
        loc = err["loc"]
        located = {**err, "loc": tuple(p for i, p in enumerate(loc) if not (
            p in arms and i and isinstance(loc[i - 1], int)))}
        if err["type"] == "extra_forbidden":
            located["msg"] = "unknown field (docs/http.md lists the fields honoured)"
        errors.append(located)
    first = ".".join(str(p) for p in errors[0]["loc"]) if errors else None
    return RequestError(describe_validation_error(errors, subject="body") or "invalid request",
                        param=first or None)


Body = TypeVar("Body", bound=BaseModel)


def read_body(kind: type[Body], body: Mapping[str, Any], arms: Collection[str] = ()) -> Body:
    """``body`` as ``kind``: its fields screened (:func:`screen`), a ``RequestError`` naming
    the first bad one (:func:`from_validation`)."""
    try:
        return kind.model_validate(screen(body, kind.model_fields))
    except ValidationError as exc:
        raise from_validation(exc, arms=arms) from None
