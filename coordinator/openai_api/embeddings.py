"""OpenAI's embeddings request (``/v1/embeddings``) read into our ``EmbeddingRequest``, and the
answer built from its job's final event.

``input`` as OpenAI takes it: a string, a list of strings, a list of token ids (one input) or
a list of lists of token ids; at most :data:`~shared.protocol.MAX_EMBEDDING_INPUTS` inputs,
none empty (OpenAI refuses an empty string too). Every input is checked by the wire's own
rule (``EmbeddingInput``), a bad one named by its place (``input.3``; ``input`` when it is
the only one). ``encoding_format`` is ``float`` (a JSON list) or ``base64`` (the vector's
little-endian float32 bytes, as OpenAI's); both carry the worker's float32 values exactly.
``dimensions`` is refused by name: a vector has the model's own width, and cutting it (what
OpenAI's text-embedding-3 models allow) only keeps meaning for models trained for it.
``user`` and the other fields without effect are accepted as everywhere
(:mod:`coordinator.openai_api.fields`).
"""

from __future__ import annotations

import base64
import sys
from array import array
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ConfigDict, TypeAdapter, ValidationError, field_validator

from coordinator.openai_api.fields import RequestError, Strict, from_validation, read_body
from coordinator.openai_api.requests import served_model
from shared.protocol import (
    MAX_EMBEDDING_INPUTS,
    EmbeddingInput,
    EmbeddingRequest,
    FinalEvent,
    describe_validation_error,
)

_INPUT: TypeAdapter[str | list[int]] = TypeAdapter(EmbeddingInput,
                                                   config=ConfigDict(strict=True))
_SHAPE = ("a string, a list of strings, a list of token ids or a list of lists of token ids "
          "(not empty)")


class EmbeddingsBody(Strict):
    """The request's fields; ``input`` is read by :func:`inputs`."""

    model: str
    input: Any
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None

    @field_validator("dimensions")
    @classmethod
    def _no_shortening(cls, v: int | None) -> int | None:
        if v is not None:
            raise ValueError("shortening embeddings is not supported: every vector has the "
                             "model's own dimension (leave dimensions out)")
        return v


@dataclass(frozen=True)
class Embeddings:
    """An embeddings request read: our request, and how to answer it (``model``: the name
    the client sent, an alias answered as the alias)."""

    request: EmbeddingRequest
    model: str
    encoding_format: str


def parse(body: Mapping[str, Any], aliases: Mapping[str, str] | None = None) -> Embeddings:
    """Our request for an OpenAI embeddings ``body`` (``RequestError`` naming the bad field)."""
    parsed = read_body(EmbeddingsBody, body)
    served = served_model(parsed.model, aliases)
    try:
        request = EmbeddingRequest(model=served, input=inputs(parsed.input))
    except ValidationError as exc:  # what the checks above let through, named by the wire
        raise from_validation(exc) from None
    return Embeddings(request, parsed.model, parsed.encoding_format)


def inputs(given: Any) -> list[str | list[int]]:
    """``input`` as a list of inputs, each checked by the wire's rule."""
    one = isinstance(given, str) or (isinstance(given, list) and bool(given)
                                     and all(_token_id(x) for x in given))
    if one:
        items, several = [given], False
    elif isinstance(given, list) and given and (all(isinstance(x, str) for x in given)
                                                or all(isinstance(x, list) for x in given)):
        items, several = list(given), True
    else:
        raise RequestError(f"input: {_SHAPE}", param="input")
    if len(items) > MAX_EMBEDDING_INPUTS:
        raise RequestError(f"input: at most {MAX_EMBEDDING_INPUTS} inputs, not {len(items)}",
                           param="input")
    out = []
    for i, item in enumerate(items):
        try:
            out.append(_INPUT.validate_python(item))
        except ValidationError as exc:
            where: tuple[str | int, ...] = ("input", i) if several else ("input",)
            # the union's arms (its tags lead each loc) are the wire's, not the client's:
            # only the errors of the arm this item's type took, at the item's place
            errors: list[dict[str, Any]] = [{**e, "loc": (*where, *e["loc"][1:])}
                                             for e in exc.errors(include_url=False)
                                             if str(e["loc"][0]).startswith("list")
                                             == isinstance(item, list)]
            param = ".".join(str(p) for p in errors[0]["loc"])
            raise RequestError(describe_validation_error(errors), param=param) from None
    return out


def _token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def reply(model: str, encoding_format: str, final: FinalEvent) -> dict[str, Any]:
    """OpenAI's answer (to the gateway's request, or a batch line's): one ``embedding``
    object per input, in order, and the tokens read; ``model`` as the client named it."""
    base64_out = encoding_format == "base64"
    data = [{"object": "embedding", "index": i,
             "embedding": vector if base64_out else floats(vector)}
            for i, vector in enumerate(final.embeddings or [])]
    tokens = final.telemetry.prompt_tokens if final.telemetry is not None else 0
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def floats(vector: str) -> list[float]:
    """A wire vector (little-endian float32, base64) as floats."""
    values = array("f", base64.b64decode(vector))
    if sys.byteorder != "little":
        values.byteswap()
    return values.tolist()
