"""Finished and streaming jobs written back in OpenAI's completions and chat shapes.

A response has one choice per job of its request (``Parsed.choices``), ``usage`` counting
each prompt once and every choice's tokens, ``usage.prompt_tokens_details.cached_tokens``
from the worker's prefix cache, and our ``specfleet`` extension: the job, its worker, the
seed it sampled with and its telemetry (``choices`` too when there are several). A choice
read as tool calls (``Choice.tool_calls``) answers ``message.tool_calls`` and
``finish_reason: "tool_calls"``, streamed as OpenAI streams them (:class:`ChoiceStream`).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any

from coordinator.openai_api.requests import CHAT, NATIVE, Choice, Parsed
from coordinator.openai_api.tool_calls import CallReader, Pieces
from shared.protocol import FinalEvent, FinishReason, TokenLogprob
from shared.results import JobResult
from shared.version import package_version

#: OpenAI's ``system_fingerprint``: which backend configuration answered (ours: the version).
SYSTEM_FINGERPRINT = f"specfleet-{package_version()}"


def finish_reason(final: FinalEvent, called: bool = False) -> str | None:
    """OpenAI's finish reason: an end-of-generation token or a stop string is ``stop``
    (``tool_calls`` when the choice made calls), the budget or the context is ``length``; a
    cancelled job stopped early: ``stop``, with our own reason in the ``specfleet`` field."""
    if final.finish_reason in (FinishReason.LENGTH, FinishReason.CONTEXT):
        return "length"
    if final.finish_reason is None:
        return None
    return "tool_calls" if called else "stop"


def token_counts(parsed: Parsed, finals: Sequence[FinalEvent]) -> tuple[int, int, int]:
    """(prompt tokens, of which served from the prefix cache, completion tokens): each prompt
    counted once however many choices sample it."""
    prompt: dict[int, tuple[int, int]] = {}
    for choice, final in zip(parsed.choices, finals, strict=True):
        t = final.telemetry
        prompt.setdefault(choice.prompt_index, (t.prompt_tokens, t.cached_tokens) if t
                          else (0, 0))
    return (sum(p for p, _ in prompt.values()), sum(c for _, c in prompt.values()),
            sum(len(f.tokens) for f in finals))


def usage(parsed: Parsed, finals: Sequence[FinalEvent]) -> dict[str, Any]:
    """Chat and completions ``usage``."""
    prompt, cached, completion = token_counts(parsed, finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def response_usage(parsed: Parsed, finals: Sequence[FinalEvent]) -> dict[str, Any]:
    """The Responses API's ``usage``: the same counts (:func:`token_counts`) under its names."""
    prompt, cached, completion = token_counts(parsed, finals)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


def extension(final: FinalEvent) -> dict[str, Any]:
    """The ``specfleet`` fields of one job: the job, its worker, the seed it sampled with (the
    same request with this ``seed`` gives the same tokens) and what speculation bought; and
    ``note``, when the worker said why a finished output is not what was asked (a
    ``max_tokens`` under the shortest document the constraint allows)."""
    fields = {"job_id": final.job_id, "worker": final.worker, "attempts": final.attempt,
              "finish_reason": str(final.finish_reason) if final.finish_reason else None,
              "seed": final.seed,
              "telemetry": final.telemetry.model_dump(mode="json") if final.telemetry else None}
    if final.error:
        fields["note"] = final.error
    return fields


def extensions(finals: Sequence[FinalEvent]) -> dict[str, Any]:
    """The response's ``specfleet`` field: the first job's, and every job's under
    ``choices`` when there are several."""
    first = extension(finals[0])
    return {**first, "choices": [extension(f) for f in finals]} if len(finals) > 1 else first


def completion_id(endpoint: str, job_id: str) -> str:
    return f"{'chatcmpl' if endpoint == CHAT else 'cmpl'}-{job_id}"


# -- logprobs in OpenAI's two shapes ---------------------------------------------------------
def chat_logprobs(logprobs: list[TokenLogprob] | None) -> dict[str, Any] | None:
    """Chat's ``choices[].logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``
    (``token`` is the piece's text; ``bytes`` its UTF-8 bytes, which may be part of a
    character)."""
    if logprobs is None:
        return None
    return {"content": [
        {"token": lp.text, "logprob": lp.logprob, "bytes": lp.bytes,
         "top_logprobs": [{"token": alt.text, "logprob": alt.logprob, "bytes": alt.bytes}
                          for alt in lp.top_logprobs]}
        for lp in logprobs], "refusal": None}


def completion_logprobs(logprobs: list[TokenLogprob] | None,
                        offset: int = 0) -> dict[str, Any] | None:
    """The legacy completions ``choices[].logprobs``: parallel lists of tokens, their
    logprobs, a ``{text: logprob}`` of the chosen token and its alternatives per token (so
    up to ``logprobs`` + 1 entries, as OpenAI's), and each token's character offset in the
    generated text (from ``offset``: the characters before them)."""
    if logprobs is None:
        return None
    offsets = []
    for lp in logprobs:
        offsets.append(offset)
        offset += len(lp.text)
    return {"tokens": [lp.text for lp in logprobs],
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{**{alt.text: alt.logprob for alt in lp.top_logprobs},
                              lp.text: lp.logprob} for lp in logprobs],
            "text_offset": offsets}


def choice_logprobs(endpoint: str, logprobs: list[TokenLogprob] | None,
                    offset: int = 0) -> dict[str, Any] | None:
    if endpoint == CHAT:
        return chat_logprobs(logprobs)
    return completion_logprobs(logprobs, offset)


def response_body(parsed: Parsed, finals: Sequence[FinalEvent]) -> dict[str, Any]:
    """The non-streamed response to a request whose jobs have all finished."""
    endpoint = parsed.endpoint
    if endpoint == NATIVE:
        return JobResult.from_final(finals[0]).to_json()
    choices = []
    for index, (choice, final) in enumerate(zip(parsed.choices, finals, strict=True)):
        body: dict[str, Any] = {"index": index, "finish_reason": finish_reason(final),
                                "logprobs": choice_logprobs(endpoint, final.logprobs,
                                                            len(choice.echo))}
        if endpoint == CHAT:
            body["message"] = {"role": "assistant", "content": final.text, "refusal": None}
            if choice.tool_calls:
                reader = read_calls(final)
                if reader.called:
                    body["message"].update(content=reader.content or None, tool_calls=[
                        call.openai() for call in reader.calls])
                    body["finish_reason"] = finish_reason(final, called=True)
        else:
            body["text"] = choice.echo + final.text
        choices.append(body)
    return {"id": completion_id(endpoint, finals[0].job_id),
            "object": "chat.completion" if endpoint == CHAT else "text_completion",
            "created": int(finals[0].ts), "model": parsed.model, "choices": choices,
            "system_fingerprint": SYSTEM_FINGERPRINT, "usage": usage(parsed, finals),
            "specfleet": extensions(finals)}


def chunk(endpoint: str, completion: str, model: str, created: int, index: int = 0, *,
          text: str | None = None, role: bool = False, final: FinalEvent | None = None,
          logprobs: list[TokenLogprob] | None = None, offset: int = 0) -> dict[str, Any]:
    """One streamed chunk of choice ``index``: a text delta (with its tokens' logprobs, when
    asked for; ``offset`` is the characters streamed before them), the opening role (chat),
    or the closing finish reason (with that job's ``specfleet`` fields)."""
    reason = finish_reason(final) if final is not None else None
    choice: dict[str, Any] = {"index": index, "finish_reason": reason,
                              "logprobs": choice_logprobs(endpoint, logprobs, offset)}
    if endpoint == CHAT:
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    body = {**_chunk_base(endpoint, completion, model, created), "choices": [choice]}
    if final is not None:
        body["specfleet"] = extension(final)
    return body


def read_calls(final: FinalEvent) -> CallReader:
    """A tool-calling job's whole text read (as its stream reads it, delta by delta)."""
    reader = CallReader(final.job_id)
    reader.feed(final.text)
    reader.finish()
    return reader


class ChoiceStream:
    """The chunks of one streamed choice: its opening, one chunk per piece of text (None
    when a piece adds nothing to send yet) and its closing chunk.

    A choice read as tool calls hands its text to a :class:`CallReader` and sends what it
    reads: ``delta.content`` for a message, ``delta.tool_calls`` for calls (index, id, type
    and name first, then argument fragments). Resuming such a stream after character
    ``shown`` reads the job from its first character (:attr:`read_from`), since the reader
    needs the calls already sent, and sends only the pieces after it."""

    def __init__(self, parsed: Parsed, index: int, completion: str, created: int,
                 job_id: str, shown: int = 0) -> None:
        self.endpoint, self.model, self.index = parsed.endpoint, parsed.model, index
        self.include_usage, self.obfuscate = parsed.include_usage, parsed.obfuscate
        self.completion, self.created, self.shown = completion, created, shown
        choice = parsed.choices[index] if index < len(parsed.choices) else Choice({})
        self.echo = choice.echo
        self.reader = CallReader(job_id) if choice.tool_calls else None
        self.read_from = 0 if self.reader is not None else shown

    def _chunk(self, **fields: Any) -> dict[str, Any]:
        """A chunk as OpenAI streams it: ``usage`` null on every chunk but the last when the
        request asked for usage, random ``obfuscation`` padding when it asked for that."""
        body = chunk(self.endpoint, self.completion, self.model, self.created, self.index,
                     **fields)
        if self.include_usage:
            body["usage"] = None
        if self.obfuscate:
            body["obfuscation"] = obfuscation()
        return body

    def opening(self) -> dict[str, Any] | None:
        """The chat role chunk, or completions' echo (none when resuming). A choice read as
        tool calls opens with no content (``""`` made the AI SDK open an empty text part
        before the calls)."""
        if self.shown:
            return None
        if self.endpoint == CHAT:
            return self._chunk(role=True, text=None if self.reader is not None else "")
        return self._chunk(text=self.echo) if self.echo else None

    def text(self, text: str, logprobs: list[TokenLogprob] | None, offset: int,
             shown: int) -> dict[str, Any] | None:
        """The chunk of a piece of text (``shown``: characters of the text up to its end)."""
        if self.reader is None:
            return self._chunk(text=text, logprobs=logprobs, offset=offset)
        pieces = self.reader.feed(text)
        if shown <= self.shown or not (pieces.content or pieces.calls or logprobs):
            return None
        return self._pieces(pieces, logprobs=logprobs, offset=offset)

    def closing(self, final: FinalEvent) -> dict[str, Any]:
        """The chunk with the finish reason (and what a tool-calling choice held back)."""
        if self.reader is None:
            return self._chunk(final=final)
        return self._pieces(self.reader.finish(), final=final)

    def _pieces(self, pieces: Pieces, **fields: Any) -> dict[str, Any]:
        assert self.reader is not None
        body = self._chunk(text=pieces.content or None, **fields)
        choice = body["choices"][0]
        if pieces.calls:
            choice["delta"]["tool_calls"] = [delta.openai() for delta in pieces.calls]
        final = fields.get("final")
        if final is not None:
            choice["finish_reason"] = finish_reason(final, self.reader.called)
        return body


def usage_chunk(parsed: Parsed, completion: str, created: int,
                finals: Sequence[FinalEvent]) -> dict[str, Any]:
    """The trailing chunk of ``stream_options.include_usage``: no choices, the usage."""
    body = {**_chunk_base(parsed.endpoint, completion, parsed.model, created), "choices": [],
            "usage": usage(parsed, finals), "specfleet": extensions(finals)}
    if parsed.obfuscate:
        body["obfuscation"] = obfuscation()
    return body


#: Most characters of one chunk's ``obfuscation`` padding.
OBFUSCATION_CHARS = 32


def obfuscation() -> str:
    """Random padding of random length (``stream_options.include_obfuscation``)."""
    return secrets.token_urlsafe(OBFUSCATION_CHARS)[:1 + secrets.randbelow(OBFUSCATION_CHARS)]


def _chunk_base(endpoint: str, completion: str, model: str, created: int) -> dict[str, Any]:
    return {"id": completion, "created": created, "model": model,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "object": "chat.completion.chunk" if endpoint == CHAT else "text_completion"}
