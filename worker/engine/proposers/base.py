"""The drafter interface the verify loop talks to (the drafts and outcomes it exchanges are
the leaf types of :mod:`worker.engine.core.draft`).

A proposer only proposes; it never touches the target context's memory. The verify loop
decides what was accepted and tells the proposer afterwards, so every drafter (MTP head,
n-gram lookup, a test oracle) plugs into the same loop without ``if method == ...`` branches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from worker.engine.core.draft import Draft, VerifyOutcome


class Proposer(Protocol):
    """A drafter. One instance serves one slot's generation at a time; ``start`` resets it."""

    def start(self, prompt: Sequence[int]) -> None:
        """A new generation: the target has just decoded ``prompt``."""
        ...

    def propose(self, history: Sequence[int], width: int, p_min: float) -> Draft:
        """Propose up to ``width`` tokens following ``history`` (prompt + generated so far;
        its last element is the token the next verify decode starts with)."""
        ...

    def observe(self, outcome: VerifyOutcome) -> None:
        """The verify decode finished: update drafter state with the accepted prefix only."""
        ...
