"""``/tokenize`` and ``/detokenize`` as llama-server and vLLM shape them, read into our
``TokenizerRequest``, and their answers.

One route each takes both servers' requests; the fields tell them apart:

- llama-server: ``{"content", "add_special" (default false), "with_pieces"}`` and
  ``{"tokens"}``;
- vLLM: ``{"model", "prompt", "add_special_tokens" (default true)}`` or ``{"model",
  "messages", "tools", "add_generation_prompt"}`` (the chat rendered as a chat completion's
  prompt is, by the worker's template), ``"return_token_strs"``, and ``{"model",
  "tokens"}``.

``model`` is required (a gateway serves many models; llama-server, serving one, ignores
it). Each answer carries both servers' fields, so either's client reads its own:
``{"tokens", "count", "max_model_len", "token_strs"}`` (``tokens`` as ``{"id", "piece"}``
objects with ``with_pieces``, a piece being its text, or its bytes where they are not UTF-8,
as llama-server writes it) and ``{"content", "prompt"}``. Special-token text in ``content``
or ``prompt`` is text, as in a completion's prompt here (``specfleet.parse_special`` is a
completion's); detokenized control tokens are written as their text, as both servers write
them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import Field, ValidationError

from coordinator.openai_api.fields import RequestError, Strict, from_validation, read_body
from coordinator.openai_api.requests import Message, served_model
from shared.protocol import (
    MAX_PROMPT_TOKENS,
    MAX_TOOLS,
    FinalEvent,
    TokenizerRequest,
    ToolDefinition,
)


class TokenizeBody(Strict):
    model: str
    #: llama-server's text.
    content: str | None = None
    #: vLLM's text, or its chat.
    prompt: str | None = None
    messages: list[Message] | None = Field(default=None, min_length=1)
    tools: list[ToolDefinition] | None = Field(default=None, max_length=MAX_TOOLS)
    add_generation_prompt: bool | None = None
    #: llama-server's name and vLLM's for one switch: the special tokens (BOS) a prompt gets.
    add_special: bool | None = None
    add_special_tokens: bool | None = None
    with_pieces: bool = False
    return_token_strs: bool = False


class DetokenizeBody(Strict):
    model: str
    tokens: list[Annotated[int, Field(ge=0)]] = Field(max_length=MAX_PROMPT_TOKENS)




@dataclass(frozen=True)
class Tokenize:
    """A tokenize request read: our request, and the shape of its answer."""

    request: TokenizerRequest
    with_pieces: bool
    token_strs: bool


def parse_tokenize(body: Mapping[str, Any],
                   aliases: Mapping[str, str] | None = None) -> Tokenize:
    """Our request for a tokenize ``body`` (``RequestError`` naming the bad field)."""
    parsed = read_body(TokenizeBody, body)
    served = served_model(parsed.model, aliases)
    given = [name for name in ("content", "prompt", "messages")
             if getattr(parsed, name) is not None]
    if len(given) != 1:
        raise RequestError("exactly one of content (llama-server's), prompt or messages "
                           "(vLLM's) is tokenized", param=given[1] if given else "prompt")
    if parsed.add_special is not None and parsed.add_special_tokens is not None:
        raise RequestError("add_special (llama-server's name) and add_special_tokens (vLLM's) "
                           "are one switch: send one", param="add_special_tokens")
    special = parsed.add_special if parsed.add_special is not None else parsed.add_special_tokens
    chat = parsed.messages is not None
    if chat and special:
        raise RequestError("a chat's special tokens are its template's (as a chat completion "
                           "renders it)", param="add_special_tokens"
                           if parsed.add_special_tokens else "add_special")
    if parsed.add_generation_prompt is False:
        raise RequestError("a chat is rendered as a chat completion's prompt is: with the "
                           "generation prompt", param="add_generation_prompt")
    if parsed.add_generation_prompt is not None and not chat:
        raise RequestError("add_generation_prompt is a chat's (messages)",
                           param="add_generation_prompt")
    if parsed.tools is not None and not chat:
        raise RequestError("tools are a chat's (messages)", param="tools")
    text = parsed.content if parsed.content is not None else parsed.prompt
    # llama-server adds no special tokens unless asked; vLLM adds them to a prompt
    default = parsed.content is None
    fields: dict[str, Any] = {
        "model": served, "pieces": parsed.with_pieces or parsed.return_token_strs}
    if chat:
        fields["messages"] = [m.ours() for m in parsed.messages or []]
        if parsed.tools:
            fields["tools"] = [t.model_dump(mode="json", exclude_none=True)
                               for t in parsed.tools]
    else:
        fields.update(text=text, add_special=default if special is None else special)
    try:
        request = TokenizerRequest.model_validate(fields)
    except ValidationError as exc:
        raise from_validation(exc) from None
    return Tokenize(request, parsed.with_pieces, parsed.return_token_strs)


def parse_detokenize(body: Mapping[str, Any],
                     aliases: Mapping[str, str] | None = None) -> TokenizerRequest:
    """Our request for a detokenize ``body`` (``RequestError`` naming the bad field)."""
    parsed = read_body(DetokenizeBody, body)
    served = served_model(parsed.model, aliases)
    return TokenizerRequest(model=served, tokens=parsed.tokens)


def tokenize_reply(parsed: Tokenize, final: FinalEvent,
                   max_model_len: int | None) -> dict[str, Any]:
    """Both servers' answer to a tokenize: the ids (with their pieces when asked), their
    count and the model's largest context."""
    pieces = [bytes(p) for p in final.pieces or []]
    tokens: list[Any] = list(final.tokens)
    if parsed.with_pieces:
        tokens = [{"id": t, "piece": _piece(p)} for t, p in zip(final.tokens, pieces,
                                                                 strict=True)]
    return {"tokens": tokens, "count": len(final.tokens), "max_model_len": max_model_len,
            "token_strs": ([p.decode("utf-8", errors="replace") for p in pieces]
                           if parsed.token_strs else None)}


def detokenize_reply(final: FinalEvent) -> dict[str, Any]:
    """Both servers' answer to a detokenize: the text under llama-server's name and vLLM's."""
    return {"content": final.text, "prompt": final.text}


def _piece(raw: bytes) -> str | list[int]:
    """A token's piece as llama-server writes it: its text, or its bytes where they are no
    UTF-8 of their own (part of a character)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)
