"""What a request's sampler answers the engine and the MTP drafter (the implementations, greedy
and random, are :mod:`worker.engine.sampling`'s)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from worker.engine.core.constraint import SlotConstraint
from worker.engine.core.distribution import Distribution
from worker.engine.core.draft import Draft
from worker.llm import Context


class Sampler(Protocol):
    """One request's token choice: drafting (the MTP head) and verification share it, so
    both use the same distribution. ``seed`` is the one in use (drawn when none was given)."""

    seed: int
    #: Whether the distribution depends on the history (penalties): callers pass the drafts
    #: so far along with it only then.
    penalised: bool

    def draft(self, logits: np.ndarray, position: int, history: Sequence[int],
              p_min: float) -> tuple[int, Distribution | None] | None:
        """The drafter's token for ``position`` from its ``logits`` after ``history``, and
        the distribution it was drawn from (None: a point mass); None when its probability
        is under ``p_min``."""
        ...

    def verify(self, ctx: Context, row0: int, pos0: int, history: Sequence[int],
               draft: Draft, mask: SlotConstraint) -> tuple[int, int]:
        """Check ``draft`` against the target's rows ``row0..`` (``history`` ends with the
        token at ``pos0`` that opened them), each row masked by ``mask`` after the drafts
        before it: drafts accepted, and the next token."""
        ...
