"""The drafter of plain decoding: it never proposes, so every verify is a one-row decode."""

from __future__ import annotations

from collections.abc import Sequence

from worker.engine.core.draft import Draft, VerifyOutcome

_EMPTY = Draft([])


class NoDraft:
    """Speculation off: the same loop, with drafts that are always empty."""

    def start(self, prompt: Sequence[int]) -> None:
        """No state."""

    def propose(self, history: Sequence[int], width: int, p_min: float) -> Draft:
        return _EMPTY

    def observe(self, outcome: VerifyOutcome) -> None:
        """No state."""
