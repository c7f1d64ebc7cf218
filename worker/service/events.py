"""Streaming a generation's tokens as small token events (the worker side of the stream).

The event writer itself is part of the wire (``shared/event_stream.py``); this groups the
engine's committed tokens so a fast engine does not pay one Redis round trip per token.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from shared.event_stream import EventWriter
from shared.protocol import TokenLogprob


class TokenChunker:
    """Groups the engine's committed tokens into small token events.

    A chunk is sent once it holds ``chunk`` tokens or has waited ``flush_seconds``, so a fast
    engine does not pay one Redis round trip per token and a slow one still streams live. The
    first delivery goes out at once: the time to the first token is what a client waits on
    (with a cached prefix it is one short decode, which a 50 ms wait would triple).
    Text deltas are never split: a chunk carries whole ``on_tokens`` deliveries. With
    ``logprobs`` on, each delivery's logprobs (one per token) travel in the same chunk; so does
    each token's origin (``TokenEvent.origin``) when every delivery says it.

    ``deferred``: a due chunk (but the first) waits for :meth:`flush_due`, which the serving
    loop calls while the device decodes the next step (``SpeculativeEngine.step``'s
    ``during``), so its Redis round trip is not host time the device waits on.
    """

    def __init__(self, writer: EventWriter, chunk: int = 8, flush_seconds: float = 0.05,
                 logprobs: bool = False, deferred: bool = False) -> None:
        self._writer = writer
        self._deferred = deferred
        self._due = False
        self._logprobs: list[TokenLogprob] | None = [] if logprobs else None
        self._chunk = chunk
        self._flush_seconds = flush_seconds
        self._tokens: list[int] = []
        self._text: list[str] = []
        self._origin: list[str] = []
        self._index = 0
        self._since = time.monotonic()

    def add(self, tokens: list[int], text: str, logprobs: Sequence[TokenLogprob] = (),
            origin: str = "") -> None:
        """One delivery of committed tokens (and their logprobs, when asked for; ``origin``:
        a ``TOKEN_ORIGINS`` letter per token, or empty when the engine did not say)."""
        if origin and len(origin) != len(tokens):
            raise ValueError(f"origin has {len(origin)} letters for {len(tokens)} tokens")
        if not self._tokens:
            self._since = time.monotonic()
        self._tokens.extend(tokens)
        self._text.append(text)
        self._origin.append(origin)
        if self._logprobs is not None:
            if len(logprobs) != len(tokens):
                raise ValueError(f"{len(logprobs)} logprobs for {len(tokens)} tokens")
            self._logprobs.extend(logprobs)
        if self._index == 0:
            self.flush()
        elif (len(self._tokens) >= self._chunk
              or time.monotonic() - self._since >= self._flush_seconds):
            if self._deferred:
                self._due = True
            else:
                self.flush()

    def flush_due(self) -> None:
        """Send a chunk :meth:`add` found due and deferred (nothing otherwise)."""
        if self._due:
            self.flush()

    def flush(self) -> None:
        """Send whatever is buffered (called at the end of a generation too)."""
        self._due = False
        if not self._tokens:
            return
        origin = "".join(self._origin)
        self._writer.emit("token", tokens=self._tokens, text="".join(self._text),
                          index=self._index, logprobs=self._logprobs,
                          origin=origin if len(origin) == len(self._tokens) else None)
        self._index += len(self._tokens)
        self._tokens = []
        self._text = []
        self._origin = []
        if self._logprobs is not None:
            self._logprobs = []
