"""A distribution over token ids: the value the samplers, the MTP head's drafts and
rejection sampling exchange (docs/sampling.md).

A leaf (numpy only), so the drafter interface (``proposers/base.py``: a draft carries the
distributions its tokens were drawn from) and the samplers (``sampling.py``: they verify
drafts) both import it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

#: Above this many ids, inverse-CDF picks go block by block instead of one vocabulary-long
#: cumulative sum (262k entries: ~1 ms for the sum, ~0.1 ms by blocks).
_PICK_BLOCK = 512


@dataclass(frozen=True)
class Distribution:
    """A distribution over token ids: ``ids`` ascending, ``weights`` non-negative and
    unnormalised (a zero weight is never drawn). A distribution over the whole vocabulary
    (temperature alone) holds every id, and is indexed directly."""

    ids: np.ndarray
    weights: np.ndarray

    @classmethod
    def point(cls, token: int) -> Distribution:
        """A lookup drafter's proposal: all mass on ``token``."""
        return cls(np.array([token], dtype=np.int64), np.ones(1))

    @cached_property
    def total(self) -> float:
        return float(self.weights.sum(dtype=np.float64))

    @cached_property
    def dense(self) -> bool:
        """Every id from 0 up: sorted unique ids ending at ``len - 1`` can be nothing else."""
        return int(self.ids[-1]) == len(self.ids) - 1

    def _locate(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Where each of ``tokens`` sits in ``ids``, and whether it is there at all."""
        if self.dense:
            hit = tokens < len(self.ids)
            return np.where(hit, tokens, 0), hit
        at = np.minimum(np.searchsorted(self.ids, tokens), len(self.ids) - 1)
        return at, self.ids[at] == tokens

    def prob(self, token: int) -> float:
        """Probability of ``token`` (0 outside the support)."""
        at, hit = self._locate(np.array([token]))
        return float(self.weights[at[0]]) / self.total if hit[0] else 0.0

    def mass_below(self, token: int) -> float:
        """Probability of the ids smaller than ``token``: where ``token``'s interval starts."""
        end = token if self.dense else int(np.searchsorted(self.ids, token))
        return float(self.weights[:end].sum(dtype=np.float64)) / self.total

    def pick(self, u: float) -> int:
        """Inverse CDF in id order: the token whose interval holds ``u``."""
        target = u * self.total
        w, offset = self.weights, 0
        if len(w) > 4 * _PICK_BLOCK:
            blocks = np.add.reduceat(w, np.arange(0, len(w), _PICK_BLOCK), dtype=np.float64)
            cum = np.cumsum(blocks)
            b = min(int(np.searchsorted(cum, target, side="right")), len(blocks) - 1)
            offset = b * _PICK_BLOCK
            target -= float(cum[b - 1]) if b else 0.0
            w = w[offset:offset + _PICK_BLOCK]
        cum = np.cumsum(w, dtype=np.float64)
        at = offset + int(np.searchsorted(cum, target, side="right"))
        at = min(at, offset + len(w) - 1)
        while self.weights[at] == 0 and at > 0:  # rounding at the very top: the last drawable
            at -= 1
        return int(self.ids[at])

    def residual(self, q: Distribution) -> Distribution:
        """``max(0, p - q)`` over this distribution's support (unnormalised). ``p == q``
        leaves nothing; then a rejection had probability 0 and ``p`` itself is returned."""
        rest = self.weights / self.total
        at, hit = self._locate(q.ids)
        np.subtract.at(rest, at[hit], q.weights[hit] / q.total)
        np.maximum(rest, 0.0, out=rest)
        if not rest.any():
            return self
        return Distribution(self.ids, rest)
