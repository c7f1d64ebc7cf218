"""OpenAI request and response shapes, and their translation to and from our protocol.

Requests are read leniently where OpenAI clients send fields we have no use for (``user``,
neutral penalties) and strictly where a value would change the answer and we cannot honour
it (``n`` > 1, ``echo``, ``logprobs``): those are 400s naming the field, never silently
ignored. Our own speculative settings and per-request telemetry travel under one extension
field, ``specfleet``, in both directions.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from coordinator.client import JobResult
from shared.protocol import (
    MAX_TOKENS_CAP,
    FinalEvent,
    FinishReason,
    Priority,
    SpecMethod,
    SpecSettings,
)

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
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None)
    seed: int | None = Field(default=None, ge=0, le=2**31 - 1)
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: Any = None
    specfleet: Extension = Field(default_factory=Extension)

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n = 1 is supported")
        return v

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: Any) -> Any:
        if v not in (None, False):
            raise ValueError("logprobs are not supported")
        return v

    @field_validator("top_p")
    @classmethod
    def _no_top_p(cls, v: float | None) -> float | None:
        if v not in (None, 1, 1.0):
            raise ValueError("top_p is not supported (leave it at 1)")
        return v

    def budget(self) -> int:
        return self.max_tokens or DEFAULT_MAX_TOKENS

    def common_request(self) -> dict[str, Any]:
        """Our request fields that do not depend on the prompt's form."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        temperature = self.temperature or 0.0
        spec = self.specfleet.speculative
        if spec is None:
            # Speculation is greedy-only: a sampled request without explicit settings decodes
            # plainly rather than being refused (OpenAI clients send temperature routinely).
            spec = SpecSettings(method=SpecMethod.NONE) if temperature > 0 else SpecSettings()
        return {"model": self.model, "max_tokens": self.budget(), "temperature": temperature,
                "seed": self.seed or 0, "stop": stop, "priority": str(self.specfleet.priority),
                "speculative": spec.model_dump(mode="json")}


#: OpenAI's default ``max_tokens`` for completions.
DEFAULT_MAX_TOKENS = 16


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

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
    """The ``specfleet`` response field: the job, its worker and what speculation bought."""
    return {"job_id": final.job_id, "worker": final.worker, "attempts": final.attempt,
            "finish_reason": str(final.finish_reason) if final.finish_reason else None,
            "telemetry": final.telemetry.model_dump(mode="json") if final.telemetry else None}


def completion_id(endpoint: str, job_id: str) -> str:
    return f"{'chatcmpl' if endpoint == CHAT else 'cmpl'}-{job_id}"


def response_body(endpoint: str, model: str, final: FinalEvent) -> dict[str, Any]:
    """The non-streamed response to a finished job, in the shape of ``endpoint``."""
    if endpoint == NATIVE:
        return JobResult.from_final(final).to_json()
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason(final),
                              "logprobs": None}
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
          usage_only: FinalEvent | None = None) -> dict[str, Any]:
    """One streamed chunk: a text delta, the opening role (chat), the closing finish reason,
    or the trailing usage chunk (``stream_options.include_usage``)."""
    base: dict[str, Any] = {"id": completion_id(endpoint, job_id),
            "object": "chat.completion.chunk" if endpoint == CHAT else "text_completion",
            "created": created, "model": model}
    if usage_only is not None:
        return {**base, "choices": [], "usage": usage(usage_only),
                "specfleet": extension(usage_only)}
    reason = finish_reason(final) if final is not None else None
    choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
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
