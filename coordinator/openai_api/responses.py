"""OpenAI's Responses API (``POST /v1/responses``), what current SDKs and agent frameworks
call first: read into one chat job, answered as a ``response`` object or its typed stream.

``input`` is a string (one user turn) or a list of items: messages, the ``function_call``
items of an earlier response and the ``function_call_output`` items that answer them, read
into chat turns (an assistant turn with its ``tool_calls``, a ``tool`` turn) through the
chat request's own ``Message``; ``instructions`` is a system turn put first;
``max_output_tokens`` the budget; sampling and ``specfleet`` as on chat. ``tools`` (function
tools: chat's ``function`` flattened), ``tool_choice`` and ``parallel_tool_calls`` become
chat's :class:`~coordinator.openai_api.structured.Tools`, so the prompt, the grammar of calls
and the reading of calls back (``tool_calls.CallReader``) are the chat path's. A response is
not stored (``store`` has no effect, ``previous_response_id`` is refused): the conversation
so far travels in ``input``. ``text.format`` constrains the output as chat's
``response_format`` does (``structured``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BeforeValidator,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)

from coordinator.openai_api.fields import RequestError, read_body
from coordinator.openai_api.replies import extension, obfuscation, read_calls, response_usage
from coordinator.openai_api.requests import (
    DEFAULT_CHAT_MAX_TOKENS,
    Choice,
    Message,
    Parsed,
    Sampled,
    _Strict,
    reads_tool_calls,
    served_model,
)
from coordinator.openai_api.structured import (
    NamedFunction,
    NamedToolChoice,
    TextFormat,
    ToolMode,
    Tools,
    known_mode,
)
from coordinator.openai_api.tool_calls import Call, CallDelta, CallReader, Pieces
from shared.protocol import (
    MAX_PROMPT_CHARS,
    MAX_TOKENS_CAP,
    MAX_TOOLS,
    TOOL_NAME_PATTERN,
    FinalEvent,
    FinishReason,
    FunctionDefinition,
    JobStatus,
    ToolCall,
    ToolCallFunction,
    ToolDefinition,
)

RESPONSES = "/v1/responses"
ItemStatus = Literal["in_progress", "completed", "incomplete"]


class InputText(_Strict):
    type: Literal["input_text", "output_text"]
    text: str
    #: What an earlier response's ``output_text`` part carries back (no effect on input).
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


def _text(content: str | list[InputText]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


class InputMessage(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]
    #: An earlier response's output item sent back as input carries its id and status.
    id: str | None = None
    status: ItemStatus | None = None

    def turn(self) -> Message:
        return Message(role=self.role, content=_text(self.content))


class FunctionCallItem(_Strict):
    """A call an earlier response made, sent back as input: the assistant turn that made
    it (``call_id`` is the chat call's ``id``)."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: str = Field(pattern=TOOL_NAME_PATTERN)
    arguments: str = Field(max_length=MAX_PROMPT_CHARS)
    id: str | None = None
    status: ItemStatus | None = None

    def call(self) -> ToolCall:
        return ToolCall(id=self.call_id,
                        function=ToolCallFunction(name=self.name, arguments=self.arguments))


class FunctionCallOutputItem(_Strict):
    """What a call returned: a ``tool`` turn answering ``call_id``."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: str | list[InputText]
    id: str | None = None
    status: ItemStatus | None = None

    def turn(self) -> Message:
        return Message(role="tool", content=_text(self.output), tool_call_id=self.call_id)


_ITEMS = ("message", "function_call", "function_call_output")


def _item_type(item: Any) -> str | None:
    """An input item's kind (a message may leave ``type`` out); an item of any other kind
    is refused by name (:func:`_served_item`)."""
    if isinstance(item, dict):
        kind = item.get("type") or "message"
        return kind if isinstance(kind, str) else repr(kind)
    return None


def _served_item(item: Any) -> Any:
    if not isinstance(item, dict):
        raise ValueError("an item is an object (a message, function_call or "
                         "function_call_output)")
    kind = _item_type(item)
    if kind not in _ITEMS:
        raise ValueError(f"{kind!r} items are not served (message, function_call, "
                         "function_call_output)")
    return item


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_type), BeforeValidator(_served_item)]


class FunctionTool(FunctionDefinition, _Strict):
    """A Responses API function tool: chat's ``function``, flattened beside its ``type``.
    A tool of another type (``web_search``, ``file_search``, ``mcp``, ...) is refused by
    name: only functions are served."""

    type: Literal["function"]

    @model_validator(mode="before")
    @classmethod
    def _functions_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type", "function") != "function":
            raise ValueError(f"{data['type']!r} tools are not served (only 'function')")
        return data

    def chat(self) -> ToolDefinition:
        return ToolDefinition(function=FunctionDefinition.model_validate(
            self.model_dump(exclude={"type"}, exclude_none=True)))


class FunctionChoice(_Strict):
    """``tool_choice`` naming the one function to call (chat's, flattened)."""

    type: Literal["function"]
    name: str = Field(pattern=TOOL_NAME_PATTERN)


def _known_choice(value: Any) -> Any:
    """A choice we do not serve (``allowed_tools``, a hosted tool's, ``mcp``) is refused by
    its type; a mode we do not know, as chat's."""
    if isinstance(value, dict) and value.get("type", "function") != "function":
        raise ValueError(f"a tool_choice of type {value['type']!r} is not served (none, "
                         "auto, required or a function)")
    return known_mode(value)


ResponsesToolChoice = Annotated[ToolMode | FunctionChoice, BeforeValidator(_known_choice)]


class TextConfig(_Strict):
    format: TextFormat | None = None


class ResponsesStreamOptions(_Strict):
    """The Responses API's ``stream_options``: random padding on every text delta."""

    include_obfuscation: bool = False


class ResponsesRequest(Sampled):
    input: list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_CAP)
    text: TextConfig | None = None
    stream_options: ResponsesStreamOptions | None = None
    tools: list[FunctionTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ResponsesToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _text_is_one_user_turn(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [{"role": "user", "content": v}]
        if not isinstance(v, list):
            raise ValueError("a string or a list of items")
        return v

    def text_format(self) -> TextFormat:
        return (self.text.format if self.text is not None and self.text.format is not None
                else TextFormat(type="text"))

    def tool_fields(self) -> Tools:
        """The tools as chat's: one reading of what tools become (prompt and grammar)."""
        choice = self.tool_choice
        named = (NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
                 if isinstance(choice, FunctionChoice) else choice)
        return Tools(tools=[t.chat() for t in self.tools] if self.tools is not None else None,
                     tool_choice=named, parallel_tool_calls=self.parallel_tool_calls,
                     parameters_param="tools.{}.parameters")

    def turns(self) -> list[Message]:
        """The chat turns: the instructions, then each item; calls join the assistant turn
        before them (a message item, or the calls before), as one chat turn carries its
        text and its calls."""
        turns = [Message(role="system", content=self.instructions)] if self.instructions else []
        for item in self.input:
            if not isinstance(item, FunctionCallItem):
                turns.append(item.turn())
            elif turns and turns[-1].role == "assistant":
                last = turns[-1]
                turns[-1] = last.model_copy(update={"tool_calls": [*(last.tool_calls or []),
                                                                   item.call()]})
            else:
                turns.append(Message(role="assistant", tool_calls=[item.call()]))
        return turns


def parse_responses(body: dict[str, Any], aliases: dict[str, str]) -> tuple[Parsed,
                                                                            ResponsesRequest]:
    """The chat job of a Responses API body, and the body read (echoed in the response)."""
    request = read_body(ResponsesRequest, body, arms=_ITEMS)
    turns = request.turns()
    if not turns:
        raise RequestError("input: must hold at least one message", param="input")
    served = served_model(request.model, aliases)
    job = {**request.base_request(served, request.max_output_tokens or DEFAULT_CHAT_MAX_TOKENS,
                                  request.text_format().response_format(),
                                  request.tool_fields(), format_param="text.format"),
           "messages": [turn.ours() for turn in turns]}
    if request.stream_options is not None and not request.stream:
        raise RequestError("stream_options needs stream: true", param="stream_options")
    obfuscate = request.stream_options is not None and request.stream_options.include_obfuscation
    return Parsed(RESPONSES, request.model, [Choice(job, tool_calls=reads_tool_calls(job))],
                  request.stream, obfuscate=obfuscate), request


def response_id(job_id: str) -> str:
    return f"resp_{job_id}"


def _message_id(job_id: str) -> str:
    return f"msg_{job_id}"


def _call_item_id(job_id: str, index: int) -> str:
    """The id of call ``index``'s output item (its ``call_id`` is the chat call's id)."""
    return f"fc_{job_id}_{index}"


def _status(final: FinalEvent | None) -> str:
    if final is None:
        return "in_progress"
    if final.status is JobStatus.FAILED:
        return "failed"
    return "incomplete" if final.finish_reason in (FinishReason.LENGTH,
                                                   FinishReason.CONTEXT) else "completed"


def _last_status(final: FinalEvent) -> ItemStatus:
    """The status of a response's last output item (the one the budget may have cut); every
    item before it is ``completed``."""
    return "completed" if _status(final) == "completed" else "incomplete"


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(job_id: str, text: str, status: ItemStatus) -> dict[str, Any]:
    """The assistant message output item (``content`` empty until text exists)."""
    content = [output_text(text)] if status != "in_progress" or text else []
    return {"type": "message", "id": _message_id(job_id), "role": "assistant",
            "status": status, "content": content}


def call_item(job_id: str, index: int, call: Call | CallDelta,
              status: ItemStatus) -> dict[str, Any]:
    """A ``function_call`` output item: call ``index`` of the job, its arguments so far."""
    return {"type": "function_call", "id": _call_item_id(job_id, index), "call_id": call.id,
            "name": call.name, "arguments": call.arguments, "status": status}


def output_items(job_id: str, choice: Choice, final: FinalEvent) -> list[dict[str, Any]]:
    """The output of a finished job: the assistant's message, then its calls. Under the
    grammar of calls a turn is one or the other; a turn with neither is an empty message."""
    if not choice.tool_calls:
        return [message_item(job_id, final.text, _last_status(final))]
    reader = read_calls(final)
    items = [message_item(job_id, reader.content, "completed")] if (
        reader.content or not reader.called) else []
    items += [call_item(job_id, i, call, "completed") for i, call in enumerate(reader.calls)]
    items[-1]["status"] = _last_status(final)
    return items


def _tool_choice(request: ResponsesRequest) -> Any:
    choice = request.tool_choice
    if choice is None:
        return "auto"
    return choice if isinstance(choice, str) else choice.model_dump()


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
        "output": [], "parallel_tool_calls": request.parallel_tool_calls is not False,
        "previous_response_id": None,
        "temperature": parsed.choices[0].request["sampling"]["temperature"],
        "top_p": request.top_p if request.top_p is not None else 1.0,
        "tool_choice": _tool_choice(request),
        "tools": [t.model_dump() for t in request.tools or []],
        "text": {"format": request.text_format().model_dump(by_alias=True, exclude_none=True)},
        "truncation": "disabled", "metadata": {}, "store": False, "usage": None}
    if final is None:
        return body
    if final.status is JobStatus.FAILED:
        body["error"] = {"code": "server_error", "message": final.error or "the job failed"}
    else:
        body["output"] = output_items(job_id, parsed.choices[0], final)
    body["usage"] = response_usage(parsed, [final])
    body["specfleet"] = extension(final)
    return body


@dataclass
class _OpenItem:
    """The output item a stream is writing: its index, and the item as it grows."""

    index: int
    item: dict[str, Any]


class EventSequence:
    """The typed events of one streamed response, numbered (``sequence_number``) in order:
    created and in progress; then each output item: added, its content (a message: its text
    part added, text deltas, the text and part done; a call: argument deltas, the arguments
    done), done; then completed, incomplete or failed.

    A plain response opens its message item at once. A tool-calling one reads its text with
    the chat path's :class:`CallReader` and opens an item when it knows which: the message at
    its first text, a ``function_call`` item when a call's name is complete (its argument
    deltas follow), and, for a turn with neither, an empty message at the end; so the items
    streamed are the items of the whole response (:func:`output_items`)."""

    def __init__(self, job_id: str, parsed: Parsed, request: ResponsesRequest,
                 created: int) -> None:
        self.job_id, self.parsed, self.request, self.created = job_id, parsed, request, created
        self.number = 0
        self.text = ""
        self.reader = CallReader(job_id) if parsed.choices[0].tool_calls else None
        self.opened = 0  # output items added so far
        self.current: _OpenItem | None = None  # the item being written (not yet done)

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.number, **fields}
        self.number += 1
        return event

    def _where(self, item: _OpenItem) -> dict[str, Any]:
        return {"item_id": item.item["id"], "output_index": item.index}

    def opening(self) -> list[dict[str, Any]]:
        response = response_object(self.job_id, self.parsed, self.request, self.created, None)
        events = [self._event("response.created", response=response),
                  self._event("response.in_progress", response=response)]
        return events if self.reader is not None else events + self._open_message()

    def delta(self, text: str) -> list[dict[str, Any]]:
        """The events of a piece of the job's text (none while a reader holds it back)."""
        if self.reader is None:
            return [self._text(text)]
        return self._read(self.reader.feed(text))

    def closing(self, final: FinalEvent) -> list[dict[str, Any]]:
        response = response_object(self.job_id, self.parsed, self.request, self.created, final)
        status = response["status"]
        if status == "failed":
            return [self._event("response.failed", response=response)]
        events = self._read(self.reader.finish()) if self.reader is not None else []
        if not self.opened:
            events += self._open_message()
        return [*events, *self._close(_last_status(final)),
                self._event(f"response.{status}", response=response)]

    def _read(self, pieces: Pieces) -> list[dict[str, Any]]:
        """Calls first: message text after calls is text that left their layout."""
        events: list[dict[str, Any]] = []
        for call in pieces.calls:
            if call.id is not None:
                events += [*self._close("completed"), *self._open_call(call)]
            if call.arguments:
                assert self.current is not None
                self.current.item["arguments"] += call.arguments
                events.append(self._event("response.function_call_arguments.delta",
                                          **self._where(self.current),
                                          delta=call.arguments))
        if pieces.content:
            if self.current is None or self.current.item["type"] != "message":
                events += [*self._close("completed"), *self._open_message()]
            events.append(self._text(pieces.content))
        return events

    def _added(self, item: dict[str, Any]) -> _OpenItem:
        self.current = _OpenItem(self.opened, item)
        self.opened += 1
        return self.current

    def _open_message(self) -> list[dict[str, Any]]:
        opened = self._added(message_item(self.job_id, "", "in_progress"))
        return [self._event("response.output_item.added", output_index=opened.index,
                            item=dict(opened.item)),
                self._event("response.content_part.added", **self._where(opened),
                            content_index=0, part=output_text(""))]

    def _open_call(self, call: CallDelta) -> list[dict[str, Any]]:
        opened = self._added(call_item(self.job_id, call.index, CallDelta(
            call.index, call.id, call.name), "in_progress"))
        return [self._event("response.output_item.added", output_index=opened.index,
                            item=dict(opened.item))]

    def _text(self, text: str) -> dict[str, Any]:
        assert self.current is not None
        self.text += text
        padding = {"obfuscation": obfuscation()} if self.parsed.obfuscate else {}
        return self._event("response.output_text.delta", **self._where(self.current),
                           content_index=0, delta=text, logprobs=[], **padding)

    def _close(self, status: ItemStatus) -> list[dict[str, Any]]:
        """The events that end the item being written (none when there is none)."""
        current, self.current = self.current, None
        if current is None:
            return []
        where = self._where(current)
        if current.item["type"] == "message":
            return [self._event("response.output_text.done", **where, content_index=0,
                                text=self.text, logprobs=[]),
                    self._event("response.content_part.done", **where, content_index=0,
                                part=output_text(self.text)),
                    self._event("response.output_item.done", output_index=current.index,
                                item=message_item(self.job_id, self.text, status))]
        item = {**current.item, "status": status}
        return [self._event("response.function_call_arguments.done", **where,
                            name=item["name"], arguments=item["arguments"]),
                self._event("response.output_item.done", output_index=current.index,
                            item=item)]
