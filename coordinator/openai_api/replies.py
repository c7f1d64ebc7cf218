"""Finished and streaming jobs written back in OpenAI's completions and chat shapes.

A response has one choice per job of its request (``Parsed.choices``), ``usage`` counting
each prompt once and every choice's tokens, ``usage.prompt_tokens_details.cached_tokens``
from the worker's prefix cache, and our ``specfleet`` extension: the job, its worker, the
seed it sampled with and its telemetry (``choices`` too when there are several).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from coordinator.client import JobResult
from coordinator.openai_api.requests import CHAT, NATIVE, Parsed
from shared.protocol import FinalEvent, FinishReason, TokenLogprob
from shared.version import package_version

#: OpenAI's ``system_fingerprint``: which backend configuration answered (ours: the version).
SYSTEM_FINGERPRINT = f"specfleet-{package_version()}"


def finish_reason(final: FinalEvent) -> str | None:
    """OpenAI's finish reason: an end-of-generation token or a stop string is ``stop``,
    the budget or the context is ``length``; a cancelled job stopped early: ``stop``, with our
    own reason in the ``specfleet`` field."""
    if final.finish_reason in (FinishReason.LENGTH, FinishReason.CONTEXT):
        return "length"
    return "stop" if final.finish_reason is not None else None


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
    prompt, cached, completion = token_counts(parsed, finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def extension(final: FinalEvent) -> dict[str, Any]:
    """The ``specfleet`` fields of one job: the job, its worker, the seed it sampled with (the
    same request with this ``seed`` gives the same tokens) and what speculation bought."""
    return {"job_id": final.job_id, "worker": final.worker, "attempts": final.attempt,
            "finish_reason": str(final.finish_reason) if final.finish_reason else None,
            "seed": final.seed,
            "telemetry": final.telemetry.model_dump(mode="json") if final.telemetry else None}


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


def usage_chunk(parsed: Parsed, completion: str, created: int,
                finals: Sequence[FinalEvent]) -> dict[str, Any]:
    """The trailing chunk of ``stream_options.include_usage``: no choices, the usage."""
    return {**_chunk_base(parsed.endpoint, completion, parsed.model, created), "choices": [],
            "usage": usage(parsed, finals), "specfleet": extensions(finals)}


def _chunk_base(endpoint: str, completion: str, model: str, created: int) -> dict[str, Any]:
    return {"id": completion, "created": created, "model": model,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "object": "chat.completion.chunk" if endpoint == CHAT else "text_completion"}
