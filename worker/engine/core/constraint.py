"""What the engine asks of a slot's constraint, and the answer of a slot without one.

A leaf below the samplers, the verify step, the MTP drafter and the slot (numpy and the
draft type only), so each of them can hold a constraint without importing the grammar
engine; :mod:`worker.engine.constraint.matcher` implements it with llguidance.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from worker.engine.core.draft import Draft


class SlotConstraint(Protocol):
    """What the engine asks of a slot's constraint (see the module docstring)."""

    def guide(self, draft: Draft, room: int) -> tuple[Draft, int]:
        """``draft`` cut to what the grammar allows, with the forced run (up to ``room``
        tokens) in front when the proposer did not propose it; and the forced run's length."""
        ...

    def masked(self, path: Sequence[int], logits: np.ndarray) -> np.ndarray:
        """``logits`` of the position after ``path`` (drafts past the committed tokens) with
        every id the grammar forbids there at -inf (the view itself when unconstrained)."""
        ...

    def choose(self, path: Sequence[int], logits: np.ndarray, token: int) -> int:
        """Greedy's token after ``path``: ``token`` (the raw argmax) when allowed, else the
        argmax among the allowed ids; then :meth:`settle`'d."""
        ...

    def settle(self, path: Sequence[int], token: int) -> int:
        """The token a row keeps after ``path`` when the sampler picked ``token`` (an allowed
        one): itself, unless the output could no longer close within ``max_tokens`` after
        it; then the first token of the close from here (docs/structured.md, "Closing
        within max_tokens": the one place the constraint changes more than the mask)."""
        ...

    def commit(self, n_accepted: int, committed: Sequence[int]) -> bool:
        """The verify accepted ``n_accepted`` drafts and the slot kept ``committed``: follow
        it there. True when the grammar allows nothing more (the generation ends)."""
        ...


class Unconstrained:
    """No constraint: every answer is "as proposed", "as the target says"."""

    def guide(self, draft: Draft, room: int) -> tuple[Draft, int]:
        return draft, 0

    def masked(self, path: Sequence[int], logits: np.ndarray) -> np.ndarray:
        return logits

    def choose(self, path: Sequence[int], logits: np.ndarray, token: int) -> int:
        return token

    def settle(self, path: Sequence[int], token: int) -> int:
        return token

    def commit(self, n_accepted: int, committed: Sequence[int]) -> bool:
        return False


UNCONSTRAINED = Unconstrained()
