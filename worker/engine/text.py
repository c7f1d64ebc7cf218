"""Turning committed tokens into streamed text, and finding stop strings in it.

A token can end in the middle of a UTF-8 character, and a stop string can arrive split over
several tokens, so text is decoded incrementally and any tail that could still become a stop
string is held back until it either completes one (and is cut) or cannot anymore.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from worker.llm import Model


class TextStream:
    """Incremental detokenizer with stop-string detection for one generation."""

    def __init__(self, model: Model, stop: Sequence[str]) -> None:
        self._model = model
        self._stop = [s for s in stop if s]
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""
        self._emitted = 0
        self.stopped = False

    def push(self, token: int) -> None:
        """Append one token's text; sets :attr:`stopped` (and cuts the text) on a stop string."""
        before = len(self.text)
        self.text += self._decoder.decode(self._model.token_bytes(token))
        hits = [i for s in self._stop
                if (i := self.text.find(s, max(0, before - len(s) + 1))) >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def take(self, final: bool) -> str:
        """Text not handed out yet; unless ``final``, minus a tail that may start a stop string."""
        if final:
            self.text += self._decoder.decode(b"", final=True) if not self.stopped else ""
            end = len(self.text)
        else:
            end = len(self.text) - self._held()
        delta = self.text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return delta

    def _held(self) -> int:
        """Length of the longest text tail that is a proper prefix of some stop string."""
        return max((j for s in self._stop for j in range(min(len(s) - 1, len(self.text)), 0, -1)
                    if self.text.endswith(s[:j])), default=0)
