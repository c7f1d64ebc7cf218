"""A tool-calling choice's text read back into OpenAI's ``tool_calls``, as it grows.

The constraint (``structured.tool_constraint``) makes the model write either a message or
calls in :mod:`shared.tool_calls`' layout; :class:`CallReader` tells which from the first
characters and hands out, piece by piece, message text or call deltas: a call's id and name
as soon as its name is complete, then its argument text as it comes (holding back only what
may be the start of the call's closing ``}``). A whole response is the same reader fed the
whole text, so a streamed choice reassembles to exactly the non-streamed one. Text that does
not follow the layout (which the constraint rules out) is handed out as message text from
where it departs, never dropped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from shared.tool_calls import CALL_ARGUMENTS, CALL_CLOSE, CALL_OPEN, CALL_SEPARATOR, MARKER


@dataclass
class CallDelta:
    """What one piece of text added to call ``index``: its id and name (first), then
    argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def openai(self) -> dict[str, Any]:
        """The ``delta.tool_calls`` entry of a chunk (OpenAI's: id, type and name once)."""
        function: dict[str, Any] = {"arguments": self.arguments}
        body: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            body.update(id=self.id, type="function")
            function = {"name": self.name, **function}
        return {**body, "function": function}


@dataclass
class Call:
    id: str
    name: str
    arguments: str = ""

    def openai(self) -> dict[str, Any]:
        """The call in ``message.tool_calls``."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


class _State(Enum):
    UNDECIDED = "undecided"  # the text so far may still become the marker
    MESSAGE = "message"  # plain text (or text that left the layout)
    HEAD = "head"  # inside a call's opening, before its arguments
    ARGUMENTS = "arguments"
    BETWEEN = "between"  # after a call: the end, or the next call's opening


@dataclass
class Pieces:
    """What one feed handed out: message text and call deltas (either may be empty)."""

    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


def call_id(job_id: str, index: int) -> str:
    """The id of call ``index`` of a job: the same in a stream, its resumption and the
    whole response."""
    return f"call_{job_id}_{index}"


class CallReader:
    """Reads one choice's text (``feed`` each delta, then ``finish``) into message text or
    calls; ``calls`` are the calls announced so far, with their arguments as read."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.calls: list[Call] = []
        self.content = ""
        self._state = _State.UNDECIDED
        self._held = ""  # text read but not yet handed out

    @property
    def called(self) -> bool:
        return bool(self.calls)

    def feed(self, text: str) -> Pieces:
        out = Pieces()
        self._held += text
        while self._step(out):
            pass
        self.content += out.content
        return out

    def finish(self) -> Pieces:
        """Hand out what was held back: the text ended (a message that was a prefix of the
        marker, or a call cut short by the budget). A call cut inside its closing keeps
        exactly its arguments (:meth:`_closing_started`)."""
        out = Pieces()
        if self._state in (_State.UNDECIDED, _State.MESSAGE):
            out.content, self._held = self._held, ""
        elif self._state is _State.ARGUMENTS and self._held:
            if not self._closing_started():
                self._arguments(out, self._held)
            self._held = ""
        self.content += out.content
        return out

    def _closing_started(self) -> bool:
        """Whether the text held back at the end of a call's arguments (the start of
        ``CALL_CLOSE`` by construction) is that closing, cut by the budget, rather than the
        arguments' own last brace. Arguments are compact JSON, so held text with a newline
        is the closing; a lone ``}`` is when the arguments before it are a whole object."""
        if "\n" in self._held:
            return True
        try:
            json.loads(self.calls[-1].arguments)
        except ValueError:
            return False
        return True

    # -- the layout, one step at a time (True: progress was made, try again) ------------
    def _step(self, out: Pieces) -> bool:
        held = self._held
        if not held:
            return False
        if self._state is _State.MESSAGE:
            out.content += held
            self._held = ""
            return False
        if self._state is _State.UNDECIDED:
            if held.startswith(MARKER):
                self._state = _State.HEAD
                return True
            if MARKER.startswith(held):
                return False
            self._state = _State.MESSAGE
            return True
        if self._state is _State.HEAD:
            return self._head(out)
        if self._state is _State.ARGUMENTS:
            end = held.find(CALL_CLOSE)
            if end >= 0:
                self._arguments(out, held[:end])
                self._held = held[end + len(CALL_CLOSE):]
                self._state = _State.BETWEEN
                return True
            keep = _open_suffix(held, CALL_CLOSE)
            self._arguments(out, held[:len(held) - keep])
            self._held = held[len(held) - keep:]
            return False
        self._state = _State.HEAD  # BETWEEN, with more text: the next call's opening
        return True

    def _head(self, out: Pieces) -> bool:
        held = self._held
        opening = CALL_SEPARATOR + CALL_OPEN if self.calls else CALL_OPEN
        if not held.startswith(opening):
            return False if opening.startswith(held) else self._depart()
        name_end = held.find('"', len(opening))
        if name_end < 0:
            return False
        rest = held[name_end:]
        if not rest.startswith(CALL_ARGUMENTS):
            return False if CALL_ARGUMENTS.startswith(rest) else self._depart()
        call = Call(call_id(self.job_id, len(self.calls)), held[len(opening):name_end])
        self.calls.append(call)
        out.calls.append(CallDelta(len(self.calls) - 1, call.id, call.name))
        self._held = rest[len(CALL_ARGUMENTS):]
        self._state = _State.ARGUMENTS
        return True

    def _arguments(self, out: Pieces, text: str) -> None:
        if not text:
            return
        self.calls[-1].arguments += text
        if out.calls and out.calls[-1].index == len(self.calls) - 1:
            out.calls[-1].arguments += text
        else:
            out.calls.append(CallDelta(len(self.calls) - 1, arguments=text))

    def _depart(self) -> bool:
        """Text that left the layout: from here on it is message text."""
        self._state = _State.MESSAGE
        return True


def _open_suffix(text: str, token: str) -> int:
    """Length of the longest end of ``text`` that ``token`` starts with (shorter than it)."""
    for n in range(min(len(token) - 1, len(text)), 0, -1):
        if token.startswith(text[-n:]):
            return n
    return 0
