"""OpenAI request and response shapes, and their translation to and from our protocol.

Requests are read leniently where OpenAI clients send fields we have no use for (``user``)
and strictly where a value would change the answer and we cannot honour it (``n`` > 1,
``echo``): those are 400s naming the field, never silently ignored. Sampling follows OpenAI
and vLLM: ``temperature`` (default 1: a request that wants greedy says 0), ``top_p``,
``seed``, ``presence_penalty``, ``frequency_penalty`` and vLLM's ``top_k``, ``min_p``,
``repetition_penalty``, each checked against ``SamplingParams``' own ranges; ``logprobs`` come
back in OpenAI's shapes. Our own speculative settings and per-request telemetry (and the
seed a job ran with) travel under one extension field, ``specfleet``, in both directions.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from coordinator.client import JobResult
from shared.protocol import (
    MAX_TOKENS_CAP,
    MAX_TOP_LOGPROBS,
    FinalEvent,
    FinishReason,
    Priority,
    SamplingParams,
    SpecSettings,
    TokenLogprob,
)

#: OpenAI's and vLLM's default temperature: a request without one samples.
DEFAULT_TEMPERATURE = 1.0
#: Most alternatives the legacy completions ``logprobs`` may ask for (OpenAI's limit).
MAX_COMPLETION_LOGPROBS = 5


def _bounds(name: str) -> dict[str, Any]:
    """``SamplingParams.<name>``'s range (``ge``, ``le``, ...)."""
    return {attr: getattr(rule, attr) for rule in SamplingParams.model_fields[name].metadata
            for attr in ("gt", "ge", "lt", "le") if hasattr(rule, attr)}


def _knob(name: str) -> Any:
    """An optional request field with ``SamplingParams.<name>``'s own range: one definition
    of what each knob accepts, and a 400 that names OpenAI's field."""
    return Field(default=None, **_bounds(name))


#: Endpoints a request (or a batch line) can name.
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
#: Our own request shape in a batch line (the old ``specfleet batch`` files).
NATIVE = "/v1/specfleet/generate"
ENDPOINTS = (COMPLETIONS, CHAT, NATIVE)


class Extension(BaseModel):
    """The ``specfleet`` request field: what OpenAI has no name for."""

    model_config = ConfigDict(extra="forbid")

    speculative: SpecSettings | None = None
    priority: Priority = Priority.NORMAL
    parse_special: bool = False


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class _Common(BaseModel):
    """Fields shared by completions and chat completions; types are strict (``true`` is not a
    number, ``"10"`` is not an int), as on our own wire."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_CAP)
    temperature: float | None = _knob("temperature")
    top_p: float | None = _knob("top_p")
    #: vLLM's: -1 (its "all tokens") and 0 both switch the cut off.
    top_k: int | None = Field(default=None, ge=-1, le=_bounds("top_k")["le"])
    min_p: float | None = _knob("min_p")
    repetition_penalty: float | None = _knob("repetition_penalty")
    presence_penalty: float | None = _knob("presence_penalty")
    frequency_penalty: float | None = _knob("frequency_penalty")
    seed: int | None = _knob("seed")
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    specfleet: Extension = Field(default_factory=Extension)

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n = 1 is supported")
        return v

    def budget(self) -> int:
        return self.max_tokens or DEFAULT_MAX_TOKENS

    def top_logprobs_asked(self) -> int | None:
        """None: no logprobs; k: each token's logprob and its k most likely alternatives."""
        raise NotImplementedError

    def sampling(self) -> dict[str, Any]:
        """Our ``sampling`` fields: OpenAI's defaults where the request gave none
        (``temperature`` 1), the neutral value of every other knob."""
        given = {name: getattr(self, name) for name in SamplingParams.model_fields
                 if name != "temperature" and getattr(self, name) is not None}
        if given.get("top_k") == -1:
            given["top_k"] = 0
        temperature = DEFAULT_TEMPERATURE if self.temperature is None else self.temperature
        return {"temperature": float(temperature), **given}

    def common_request(self) -> dict[str, Any]:
        """Our request fields that do not depend on the prompt's form."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        body: dict[str, Any] = {
            "model": self.model, "max_tokens": self.budget(), "sampling": self.sampling(),
            "stop": stop, "priority": str(self.specfleet.priority)}
        k = self.top_logprobs_asked()
        if k is not None:
            body.update(logprobs=True, top_logprobs=k)
        if self.specfleet.speculative is not None:
            # Only what the request set: an unset field means "the worker's capacity".
            body["speculative"] = self.specfleet.speculative.model_dump(mode="json",
                                                                        exclude_unset=True)
        return body


#: OpenAI's default ``max_tokens`` for completions.
DEFAULT_MAX_TOKENS = 16


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    #: The legacy shape: the number of alternatives per token (0: the chosen token's only).
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)

    def top_logprobs_asked(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        if _listed(v) and len(v) != 1:
            raise ValueError("only one prompt per request is supported")
        return v

    @field_validator("echo", "best_of", "suffix")
    @classmethod
    def _unsupported(cls, v: Any, info: ValidationInfo) -> Any:
        neutral = {"echo": False, "best_of": 1, "suffix": ""}[info.field_name or ""]
        if v is not None and (v != neutral or type(v) is not type(neutral)):
            raise ValueError(f"{info.field_name} is not supported")
        return v

    def to_request(self) -> dict[str, Any]:
        prompt = self.prompt[0] if _listed(self.prompt) else self.prompt
        body = self.common_request()
        if isinstance(prompt, str):
            body.update(prompt=prompt, parse_special=self.specfleet.parse_special)
        else:
            body["prompt_tokens"] = prompt
        return body


def _listed(prompt: object) -> bool:
    """A prompt given as a list of prompts (OpenAI allows several; we take one)."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], str | list)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_CAP)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def budget(self) -> int:
        return self.max_completion_tokens or self.max_tokens or DEFAULT_CHAT_MAX_TOKENS

    def to_request(self) -> dict[str, Any]:
        # "developer" is OpenAI's newer name for the system turn.
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in self.messages]
        return {**self.common_request(), "messages": messages}


#: A chat request without a budget: ours (OpenAI's is "until the context ends").
DEFAULT_CHAT_MAX_TOKENS = 256


def parse_body(endpoint: str, body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """Our request dict for an OpenAI body sent to ``endpoint``, and whether it streams.

    Raises ``pydantic.ValidationError`` naming the bad field."""
    if endpoint == NATIVE:
        return body, False
    model = CompletionRequest if endpoint == COMPLETIONS else ChatRequest
    parsed = model.model_validate(body)
    return parsed.to_request(), parsed.stream


# -- responses ------------------------------------------------------------------------------
def finish_reason(final: FinalEvent) -> str | None:
    """OpenAI's finish reason: an end-of-generation token or a stop string is ``stop``,
    the budget or the context is ``length``; a cancelled job stopped early: ``stop``, with our
    own reason in the ``specfleet`` field."""
    if final.finish_reason in (FinishReason.LENGTH, FinishReason.CONTEXT):
        return "length"
    return "stop" if final.finish_reason is not None else None


def usage(final: FinalEvent) -> dict[str, int]:
    prompt = final.telemetry.prompt_tokens if final.telemetry else 0
    return {"prompt_tokens": prompt, "completion_tokens": len(final.tokens),
            "total_tokens": prompt + len(final.tokens)}


def extension(final: FinalEvent) -> dict[str, Any]:
    """The ``specfleet`` response field: the job, its worker, the seed it sampled with (the
    same request with this ``seed`` gives the same tokens) and what speculation bought."""
    return {"job_id": final.job_id, "worker": final.worker, "attempts": final.attempt,
            "finish_reason": str(final.finish_reason) if final.finish_reason else None,
            "seed": final.seed,
            "telemetry": final.telemetry.model_dump(mode="json") if final.telemetry else None}


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


def response_body(endpoint: str, model: str, final: FinalEvent) -> dict[str, Any]:
    """The non-streamed response to a finished job, in the shape of ``endpoint``."""
    if endpoint == NATIVE:
        return JobResult.from_final(final).to_json()
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason(final),
                              "logprobs": choice_logprobs(endpoint, final.logprobs)}
    if endpoint == CHAT:
        choice["message"] = {"role": "assistant", "content": final.text}
    else:
        choice["text"] = final.text
    return {"id": completion_id(endpoint, final.job_id),
            "object": "chat.completion" if endpoint == CHAT else "text_completion",
            "created": int(final.ts), "model": model, "choices": [choice],
            "usage": usage(final), "specfleet": extension(final)}


def chunk(endpoint: str, job_id: str, model: str, created: int, *, text: str | None = None,
          role: bool = False, final: FinalEvent | None = None,
          usage_only: FinalEvent | None = None, logprobs: list[TokenLogprob] | None = None,
          offset: int = 0) -> dict[str, Any]:
    """One streamed chunk: a text delta (with its tokens' logprobs, when asked for; ``offset``
    is the characters streamed before them), the opening role (chat), the closing finish
    reason, or the trailing usage chunk (``stream_options.include_usage``)."""
    base: dict[str, Any] = {"id": completion_id(endpoint, job_id),
            "object": "chat.completion.chunk" if endpoint == CHAT else "text_completion",
            "created": created, "model": model}
    if usage_only is not None:
        return {**base, "choices": [], "usage": usage(usage_only),
                "specfleet": extension(usage_only)}
    reason = finish_reason(final) if final is not None else None
    choice: dict[str, Any] = {"index": 0, "finish_reason": reason,
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
    body = {**base, "choices": [choice]}
    if final is not None:
        body["specfleet"] = extension(final)
    return body
