"""What ``logit_bias`` and the penalties change in a row's logits: decided once, from scratch for
the host (:func:`adjustment`) and kept as a request's history grows for the device
(:class:`Penalties`), the two giving the same value for every id.

The host applies an adjustment to a row it has read (``sampling.penalised_logits``); the device
applies it inside the row's draw or top two (``worker/llm/device_sampling.py``), op for op in
float32. A device row's adjustment is made at every decode for every output row, each for the
tokens it has seen (the committed history, then the verify's drafts before it): from scratch
that is two ``np.unique`` over the history a row (2.4 ms at 8,192 tokens on a 2-core Xeon,
per verify row), so :class:`Penalties` folds each committed token in once and copies its arrays
per row, changing only the drafts' ids.
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Mapping, MutableMapping, Sequence

import numpy as np

from shared.protocol import SamplingParams
from worker.llm.device_sampling import Adjustment

_F32 = np.float32


def adjustment(params: SamplingParams, history: Sequence[int], n_prompt: int) -> Adjustment:
    """What ``logit_bias`` and the penalties change in the logits of a row that has seen
    ``history`` (its first ``n_prompt`` tokens the prompt): the bias of each biased id, the
    repetition penalty of every id of ``history``, and the presence and frequency penalties of
    each id of its generated part, ids ascending."""
    none = np.zeros(0, np.int64)
    bias_ids = np.fromiter(params.logit_bias.keys(), np.int64, len(params.logit_bias))
    seen = (np.unique(np.asarray(history, dtype=np.int64))
            if params.repetition_penalty != 1.0 and len(history) else none)
    generated = history[n_prompt:]
    gen_ids, counts = (np.unique(np.asarray(generated, dtype=np.int64), return_counts=True)
                       if (params.presence_penalty or params.frequency_penalty)
                       and len(generated) else (none, none))
    ids = np.union1d(np.union1d(bias_ids, seen), gen_ids)
    bias = np.zeros(len(ids), _F32)
    bias[np.searchsorted(ids, bias_ids)] = np.fromiter(params.logit_bias.values(), _F32,
                                                       len(bias_ids))
    penalty = np.ones(len(ids), _F32)
    penalty[np.searchsorted(ids, seen)] = params.repetition_penalty
    minus = np.zeros(len(ids), _F32)
    minus[np.searchsorted(ids, gen_ids)] = (params.presence_penalty
                                            + params.frequency_penalty * counts).astype(_F32)
    return Adjustment(ids.astype(np.int32), bias, penalty, minus)


class _Changes:
    """The ids changed so far, in the order they were first changed, and each one's bias,
    repetition penalty, generated count and what comes off (the first :attr:`n` entries of
    each array); :attr:`slot` finds an id's entry."""

    def __init__(self, slot: MutableMapping[int, int], arrays: tuple[np.ndarray, ...],
                 n: int) -> None:
        self.slot = slot
        self.ids, self.bias, self.penalty, self.count, self.minus = arrays
        self.n = n

    @classmethod
    def empty(cls, size: int) -> _Changes:
        return cls({}, (np.zeros(size, np.int32), np.zeros(size, _F32), np.ones(size, _F32),
                        np.zeros(size, np.int64), np.zeros(size, _F32)), 0)

    def fork(self) -> _Changes:
        """A copy to fold a row's drafts into, this one left as it is: the arrays copied (a
        memcpy), the ids looked up here and the new ones kept apart (not a copy of a dict of
        every id seen)."""
        return _Changes(ChainMap({}, self.slot), tuple(a.copy() for a in self._arrays()),
                        self.n)

    def entry(self, token: int) -> int:
        """``token``'s entry (a new one, changed by nothing yet, where it had none)."""
        at = self.slot.get(token)
        if at is not None:
            return at
        if self.n == len(self.ids):  # twice the room, the new half changing nothing
            more = _Changes.empty(len(self.ids))._arrays()
            self.ids, self.bias, self.penalty, self.count, self.minus = (
                np.concatenate(pair) for pair in zip(self._arrays(), more, strict=True))
        at = self.slot[token] = self.n
        self.ids[at] = token
        self.n += 1
        return at

    def adjustment(self) -> Adjustment:
        n = self.n
        return Adjustment(self.ids[:n].copy(), self.bias[:n].copy(), self.penalty[:n].copy(),
                          self.minus[:n].copy())

    def _arrays(self) -> tuple[np.ndarray, ...]:
        return self.ids, self.bias, self.penalty, self.count, self.minus


class Penalties:
    """A request's bias and penalties over its slot's history (the engine's own list, which
    only grows as tokens are committed), each output row's :class:`Adjustment` made for the
    device (:class:`~worker.llm.device_sampling.Adjusts`).

    The committed history is folded in once, token by token (:meth:`_fold`); a row forks
    those changes and folds in only the drafts before it, the same way."""

    def __init__(self, params: SamplingParams, history: list[int], n_prompt: int) -> None:
        self.params = params
        self.history = history
        self.n_prompt = n_prompt
        self._repeats = params.repetition_penalty != 1.0
        self._counts = bool(params.presence_penalty or params.frequency_penalty)
        self._committed = _Changes.empty(max(16, len(params.logit_bias)))
        for token, bias in params.logit_bias.items():
            self._committed.bias[self._committed.entry(token)] = bias
        self._folded = 0

    def adjustments(self, positions: Sequence[int],
                    batch: Mapping[int, int]) -> list[Adjustment]:
        """Each row's adjustment: the row choosing the token at position p has seen the
        committed tokens before p, then ``batch``'s (the decode's drafts) up to p."""
        history = self.history
        while self._folded < len(history):  # committed since the last decode
            self._fold(self._committed, history[self._folded], self._folded)
            self._folded += 1
        return [self._row(p, batch) for p in positions]

    def _row(self, position: int, batch: Mapping[int, int]) -> Adjustment:
        """The committed history's changes with the drafts before ``position`` folded into a
        fork of them. A row that has not seen the whole committed history (a prompt's rows
        where all are outputs; the engine asks for its last) is made from scratch."""
        if position < len(self.history):
            return adjustment(self.params, self.history[:position], self.n_prompt)
        if position == len(self.history):
            return self._committed.adjustment()
        row = self._committed.fork()
        for q in range(len(self.history), position):
            self._fold(row, batch[q], q)
        return row.adjustment()

    def _fold(self, changes: _Changes, token: int, position: int) -> None:
        """The token at ``position`` seen: its repetition penalty, and where it was generated
        its count and what the presence and frequency penalties take off (summed in float64,
        as :func:`adjustment` sums it)."""
        generated = position >= self.n_prompt and self._counts
        if not (self._repeats or generated):
            return
        at = changes.entry(token)
        if self._repeats:
            changes.penalty[at] = self.params.repetition_penalty
        if generated:
            changes.count[at] += 1
            changes.minus[at] = (self.params.presence_penalty
                                 + self.params.frequency_penalty * int(changes.count[at]))
