"""Streaming a generation's tokens as small token events (the worker side of the stream).

The event writer itself is part of the wire (``shared/event_stream.py``); this groups the
engine's committed tokens so a fast engine does not pay one Redis round trip per token.
"""

from __future__ import annotations

import time

from shared.event_stream import EventWriter


class TokenChunker:
    """Groups the engine's committed tokens into small token events.

    A chunk is sent once it holds ``chunk`` tokens or has waited ``flush_seconds``, so a fast
    engine does not pay one Redis round trip per token and a slow one still streams live.
    Text deltas are never split: a chunk carries whole ``on_tokens`` deliveries.
    """

    def __init__(self, writer: EventWriter, chunk: int = 8, flush_seconds: float = 0.05) -> None:
        self._writer = writer
        self._chunk = chunk
        self._flush_seconds = flush_seconds
        self._tokens: list[int] = []
        self._text: list[str] = []
        self._index = 0
        self._since = time.monotonic()

    def add(self, tokens: list[int], text: str) -> None:
        """The engine's ``on_tokens`` callback."""
        if not self._tokens:
            self._since = time.monotonic()
        self._tokens.extend(tokens)
        self._text.append(text)
        if (len(self._tokens) >= self._chunk
                or time.monotonic() - self._since >= self._flush_seconds):
            self.flush()

    def flush(self) -> None:
        """Send whatever is buffered (called at the end of a generation too)."""
        if not self._tokens:
            return
        self._writer.emit("token", tokens=self._tokens, text="".join(self._text),
                          index=self._index)
        self._index += len(self._tokens)
        self._tokens = []
        self._text = []
