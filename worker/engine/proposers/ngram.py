"""Prompt-lookup drafting: continue the text the way it continued the last time its tail
appeared (in the prompt or in what was generated so far). Works for any model.

An index from n-gram to the end of its most recent earlier occurrence is extended as the
history grows, so a lookup costs a few dict probes instead of a scan of the history.
"""

from __future__ import annotations

from collections.abc import Sequence

from worker.engine.core.draft import Draft, VerifyOutcome


class NgramProposer:
    """Longest match first, from ``n_max`` down to ``n_min`` tokens."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self._sizes = range(n_max, n_min - 1, -1)
        self._index: dict[tuple[int, ...], int] = {}
        self._indexed = 0

    def start(self, prompt: Sequence[int]) -> None:
        self._index.clear()
        self._indexed = 0

    def propose(self, history: Sequence[int], width: int, p_min: float) -> Draft:
        """``p_min`` does not apply: a lookup has no confidence to compare."""
        # Index occurrences ending before the last token, so a continuation always exists
        # and the history's own tail never matches itself.
        for end in range(self._indexed, len(history) - 1):
            for n in self._sizes:
                if end + 1 >= n:
                    self._index[tuple(history[end + 1 - n : end + 1])] = end
        self._indexed = max(self._indexed, len(history) - 1)
        for n in self._sizes:
            match = self._index.get(tuple(history[-n:])) if n <= len(history) else None
            if match is not None:
                return Draft(list(history[match + 1 : match + 1 + width]))
        return Draft([])

    def observe(self, outcome: VerifyOutcome) -> None:
        """Stateless beyond the history it indexes."""
