"""A deterministic drafter that knows the answer and lies on schedule.

The oracle holds the plain-greedy continuation of the prompt. Each draft is that continuation
with one token corrupted at a chosen index ``k``, so the target accepts exactly ``k`` drafts
(``k = width`` means no corruption: a full accept). The ``k`` for successive drafts cycles
through shuffled rounds of ``0..width``, so every accepted-prefix length occurs and the
rejected depth of every verify is known in advance: tests derive the expected number of
replays from :attr:`OracleProposer.plan` instead of trusting the engine's counters.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from worker.engine.core.draft import Draft, VerifyOutcome


@dataclass(frozen=True)
class Planned:
    """One draft as the oracle made it: its length and how many drafts the target should take."""

    width: int
    accept: int

    @property
    def rejected(self) -> int:
        """Depth of the tail the target must roll back after verifying this draft."""
        return self.width - self.accept


class OracleProposer:
    """Proposes the known continuation, corrupted at a scheduled index."""

    def __init__(self, reference: Sequence[int], n_vocab: int, seed: int = 0) -> None:
        self.reference = list(reference)
        self.n_vocab = n_vocab
        self.seed = seed
        self.plan: list[Planned] = []
        self.observed: list[int] = []
        self._prompt_len = 0
        self._pending: list[int] = []
        self._rng = random.Random(seed)

    def start(self, prompt: Sequence[int]) -> None:
        self._prompt_len = len(prompt)
        self.plan.clear()
        self.observed.clear()
        self._pending.clear()
        self._rng = random.Random(self.seed)

    def propose(self, history: Sequence[int], width: int, p_min: float) -> Draft:
        done = len(history) - self._prompt_len
        truth = self.reference[done: done + width]
        accept = self._next_accept(width)
        draft = [
            (token + 1) % self.n_vocab if i == accept else token
            for i, token in enumerate(truth)
        ]
        self.plan.append(Planned(len(draft), min(accept, len(draft))))
        return Draft(draft)

    def observe(self, outcome: VerifyOutcome) -> None:
        self.observed.append(outcome.n_accepted)

    def _next_accept(self, width: int) -> int:
        """The next accepted-prefix length: shuffled rounds of 0..width, refilled as needed."""
        if not self._pending or max(self._pending) > width:
            self._pending = list(range(width + 1))
            self._rng.shuffle(self._pending)
        return self._pending.pop()
