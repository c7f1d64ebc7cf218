"""OpenAI's Responses API (``POST /v1/responses``), what current SDKs and agent frameworks
call first: read into one chat job, answered as a ``response`` object or its typed stream.

``input`` is a string (one user turn) or a list of messages; ``instructions`` is a system turn
put first; ``max_output_tokens`` the budget; sampling and ``specfleet`` as on chat. A
response is not stored (``store`` has no effect, ``previous_response_id`` is refused): the
conversation so far travels in ``input``. ``text.format`` constrains the output as chat's
``response_format`` does (``structured``); tools are refused by name (chat serves them).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError

from coordinator.openai_api.fields import RequestError, from_validation, screen
from coordinator.openai_api.replies import extension, obfuscation
from coordinator.openai_api.requests import (
    DEFAULT_CHAT_MAX_TOKENS,
    Choice,
    Parsed,
    Sampled,
    _Strict,
    check_model_name,
    our_messages,
    resolve,
)
from coordinator.openai_api.structured import TextFormat
from shared.protocol import MAX_TOKENS_CAP, FinalEvent, FinishReason, JobStatus

RESPONSES = "/v1/responses"


class InputText(_Strict):
    type: Literal["input_text", "output_text"]
    text: str
    #: What an earlier response's ``output_text`` part carries back (no effect on input).
    annotations: list[Any] | None = None


class InputMessage(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]
    #: An earlier response's output item sent back as input carries its id and status.
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class TextConfig(_Strict):
    format: TextFormat | None = None


class ResponsesStreamOptions(_Strict):
    """The Responses API's ``stream_options``: random padding on every text delta."""

    include_obfuscation: bool = False


class ResponsesRequest(Sampled):
    input: str | list[InputMessage]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_CAP)
    text: TextConfig | None = None
    stream_options: ResponsesStreamOptions | None = None

    def text_format(self) -> TextFormat:
        return (self.text.format if self.text is not None and self.text.format is not None
                else TextFormat(type="text"))

    def turns(self) -> list[tuple[str, str]]:
        turns = [("system", self.instructions)] if self.instructions else []
        if isinstance(self.input, str):
            return [*turns, ("user", self.input)]
        return [*turns, *((m.role, m.text()) for m in self.input)]


def parse_responses(body: dict[str, Any], aliases: dict[str, str]) -> tuple[Parsed,
                                                                            ResponsesRequest]:
    """The chat job of a Responses API body, and the body read (echoed in the response)."""
    try:
        request = ResponsesRequest.model_validate(screen(body, ResponsesRequest.model_fields))
    except ValidationError as exc:
        raise from_validation(exc) from None
    if not request.turns():
        raise RequestError("input: must hold at least one message", param="input")
    served = resolve(request.model, aliases) or request.model
    check_model_name(request.model, served)
    job = {**request.base_request(served, request.max_output_tokens or DEFAULT_CHAT_MAX_TOKENS,
                                  request.text_format().response_format(),
                                  format_param="text.format"),
           "messages": our_messages(request.turns())}
    if request.stream_options is not None and not request.stream:
        raise RequestError("stream_options needs stream: true", param="stream_options")
    obfuscate = request.stream_options is not None and request.stream_options.include_obfuscation
    return Parsed(RESPONSES, request.model, [Choice(job)], request.stream,
                  obfuscate=obfuscate), request


def response_id(job_id: str) -> str:
    return f"resp_{job_id}"


def _item_id(job_id: str) -> str:
    return f"msg_{job_id}"


def _status(final: FinalEvent | None) -> str:
    if final is None:
        return "in_progress"
    if final.status is JobStatus.FAILED:
        return "failed"
    return "incomplete" if final.finish_reason in (FinishReason.LENGTH,
                                                   FinishReason.CONTEXT) else "completed"


def message_item(job_id: str, text: str, final: FinalEvent | None) -> dict[str, Any]:
    """The assistant message output item (``content`` empty until text exists)."""
    content = [output_text(text)] if final is not None or text else []
    return {"type": "message", "id": _item_id(job_id), "role": "assistant",
            "status": "in_progress" if final is None else "completed"
            if _status(final) == "completed" else "incomplete", "content": content}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def response_object(job_id: str, parsed: Parsed, request: ResponsesRequest, created: int,
                    final: FinalEvent | None) -> dict[str, Any]:
    """The ``response`` object: in progress (``final`` None), or as the job ended."""
    status = _status(final)
    body: dict[str, Any] = {
        "id": response_id(job_id), "object": "response", "created_at": created,
        "status": status, "error": None, "model": parsed.model,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
        else None,
        "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
        "output": [], "parallel_tool_calls": False, "previous_response_id": None,
        "temperature": parsed.choices[0].request["sampling"]["temperature"],
        "top_p": request.top_p if request.top_p is not None else 1.0,
        "tool_choice": "none", "tools": [],
        "text": {"format": request.text_format().model_dump(by_alias=True, exclude_none=True)},
        "truncation": "disabled", "metadata": {}, "store": False, "usage": None}
    if final is None:
        return body
    if final.status is JobStatus.FAILED:
        body["error"] = {"code": "server_error", "message": final.error or "the job failed"}
    else:
        body["output"] = [message_item(job_id, final.text, final)]
    prompt = final.telemetry.prompt_tokens if final.telemetry else 0
    cached = final.telemetry.cached_tokens if final.telemetry else 0
    body["usage"] = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
                     "output_tokens": len(final.tokens),
                     "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": prompt + len(final.tokens)}
    body["specfleet"] = extension(final)
    return body


class EventSequence:
    """The typed events of one streamed response, numbered (``sequence_number``) in order:
    created, in progress, the message item and its text part added, text deltas, the text,
    part and item done, then completed, incomplete or failed."""

    def __init__(self, job_id: str, parsed: Parsed, request: ResponsesRequest,
                 created: int) -> None:
        self.job_id, self.parsed, self.request, self.created = job_id, parsed, request, created
        self.number = 0
        self.text = ""

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.number, **fields}
        self.number += 1
        return event

    def _where(self) -> dict[str, Any]:
        return {"item_id": _item_id(self.job_id), "output_index": 0, "content_index": 0}

    def opening(self) -> list[dict[str, Any]]:
        response = response_object(self.job_id, self.parsed, self.request, self.created, None)
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response),
                self._event("response.output_item.added", output_index=0,
                            item=message_item(self.job_id, "", None)),
                self._event("response.content_part.added", **self._where(),
                            part=output_text(""))]

    def delta(self, text: str) -> dict[str, Any]:
        self.text += text
        padding = {"obfuscation": obfuscation()} if self.parsed.obfuscate else {}
        return self._event("response.output_text.delta", **self._where(), delta=text,
                           logprobs=[], **padding)

    def closing(self, final: FinalEvent) -> list[dict[str, Any]]:
        response = response_object(self.job_id, self.parsed, self.request, self.created, final)
        status = response["status"]
        if status == "failed":
            return [self._event("response.failed", response=response)]
        return [self._event("response.output_text.done", **self._where(), text=self.text,
                            logprobs=[]),
                self._event("response.content_part.done", **self._where(),
                            part=output_text(self.text)),
                self._event("response.output_item.done", output_index=0,
                            item=message_item(self.job_id, self.text, final)),
                self._event(f"response.{status}", response=response)]
