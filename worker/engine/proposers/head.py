"""The engine's draft head: drafter state that lives beside the target for the engine's whole
life and must follow it (a draft context kept in step with the target's positions), behind
the hooks the engine and the prefix cache call, so neither ever names the drafter.

Today the one head is the model's MTP/NextN head (:class:`~.mtp.MtpDrafter`); an engine
without one has :data:`NO_HEAD`, which answers every hook with "nothing to do". The hooks are
the moments the head must hear of:

- :meth:`DraftHead.on_place`: a request was placed in a sequence, keeping ``keep`` of its
  positions (prefix reuse) or none: the head forgets the sequence or resumes at ``keep``;
- :meth:`DraftHead.on_prefill`: the target decoded a prompt slice; the head feeds it and
  returns the hidden state a prefix checkpoint there must keep to resume from it;
- :meth:`DraftHead.draft`: every slot that asked for the head this step, drafted together
  (one decode per chain position for all of them).

A slot's drafter takes part through :class:`Staged`: the engine asks every slot's
:meth:`Staged.stage` first (a draft without the head, and whether the head should draft too),
runs the head once for all the slots that asked, and lets each :meth:`Staged.choose`. A
drafter that never uses the head is wrapped in :class:`Solo`, so the engine's loop has one
path for every drafter (vLLM's proposers have the same shape: propose for the batch).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from shared.protocol import SpecMethod
from worker.engine.core.constraint import UNCONSTRAINED, SlotConstraint
from worker.engine.core.draft import Draft

if TYPE_CHECKING:
    from worker.engine.core.sampler import Sampler
    from worker.engine.proposers.base import Proposer


@dataclass(frozen=True)
class DraftRequest:
    """One slot's share of a head's batched draft: ``history`` ends with the next verify's
    token; ``sampler`` is the slot's (greedy: the head's argmax; sampled: a draw from the
    head's distribution under the request's sampling, kept for rejection sampling);
    ``constraint`` masks the head's logits after the tokens drafted so far, so its drafts
    follow the grammar and its sampled distributions are the masked ones."""

    seq: int
    history: Sequence[int]
    width: int
    p_min: float
    sampler: Sampler
    constraint: SlotConstraint = UNCONSTRAINED


class Staged(Protocol):
    """A slot's drafter as the engine's step drives it (see the module docstring)."""

    def stage(self, history: Sequence[int], width: int, p_min: float) -> tuple[Draft, bool]:
        """A draft made without the head, and whether the head should draft this step too."""
        ...

    def request(self, history: Sequence[int], width: int, p_min: float) -> DraftRequest:
        """This slot's share of the head's batched draft (asked only after ``stage`` said
        the head should draft)."""
        ...

    def choose(self, staged: Draft, head: Draft) -> Draft:
        """The draft to verify, of the staged one and the head's."""
        ...


class Solo:
    """A drafter that never uses the head, staged: its draft is its proposer's."""

    def __init__(self, proposer: Proposer) -> None:
        self._proposer = proposer

    def stage(self, history: Sequence[int], width: int, p_min: float) -> tuple[Draft, bool]:
        return self._proposer.propose(history, width, p_min), False

    def request(self, history: Sequence[int], width: int, p_min: float) -> DraftRequest:
        raise AssertionError("a drafter without the head was asked for a head request")

    def choose(self, staged: Draft, head: Draft) -> Draft:
        return staged


class DraftHead(Protocol):
    """Engine-wide drafter state that follows the target (see the module docstring)."""

    def follows(self, method: SpecMethod) -> bool:
        """Whether a request of ``method`` drafts with this head (its sequences must then be
        kept in step: prefix reuse only where the head can resume)."""
        ...

    def proposer(self, seq: int, sampler: Sampler,
                 constraint: SlotConstraint) -> Proposer | None:
        """The head's drafter for slot ``seq`` (None: there is no head)."""
        ...

    def on_place(self, seq: int, follows: bool, keep: int, hidden: np.ndarray | None) -> None:
        """A request was placed in ``seq`` keeping its first ``keep`` positions (0: none);
        ``hidden`` is the target's hidden state at ``keep - 1`` from a prefix checkpoint (None:
        ``keep`` is the end of the sequence's last generation, or nothing is kept)."""
        ...

    def on_prefill(self, seq: int, tokens: Sequence[int], pos0: int,
                   row0: int) -> np.ndarray | None:
        """The target decoded prompt ``tokens`` of ``seq`` from position ``pos0`` (their
        rows from ``row0``); returns what a prefix checkpoint at their end must keep."""
        ...

    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        """Every request's draft, drafted together."""
        ...

    def close(self) -> None:
        ...


class NoHead:
    """The head of an engine without one: nothing follows the target."""

    def follows(self, method: SpecMethod) -> bool:
        return False

    def proposer(self, seq: int, sampler: Sampler,
                 constraint: SlotConstraint) -> Proposer | None:
        return None

    def on_place(self, seq: int, follows: bool, keep: int, hidden: np.ndarray | None) -> None:
        """Nothing to keep in step."""

    def on_prefill(self, seq: int, tokens: Sequence[int], pos0: int,
                   row0: int) -> np.ndarray | None:
        return None

    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        if requests:
            raise AssertionError("an engine without a draft head was asked to draft with one")
        return []

    def close(self) -> None:
        """Nothing allocated."""


#: The head of every engine that has none.
NO_HEAD = NoHead()
