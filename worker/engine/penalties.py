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

from collections.abc import Mapping, Sequence

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


class Penalties:
    """A request's bias and penalties over its slot's history (the engine's own list, which
    only grows as tokens are committed), each output row's :class:`Adjustment` made for the
    device (:class:`~worker.llm.device_sampling.Adjusts`).

    The committed history is folded in once, token by token, into arrays of the ids changed
    so far (in the order they were first changed) and each one's bias, penalty, generated
    count and what comes off; a row copies them and folds in only the drafts before it."""

    def __init__(self, params: SamplingParams, history: list[int], n_prompt: int) -> None:
        self.params = params
        self.history = history
        self.n_prompt = n_prompt
        self._repeats = params.repetition_penalty != 1.0
        self._counts = bool(params.presence_penalty or params.frequency_penalty)
        self._slot: dict[int, int] = {}
        size = max(16, len(params.logit_bias))
        self._ids = np.zeros(size, np.int32)
        self._bias = np.zeros(size, _F32)
        self._penalty = np.ones(size, _F32)
        self._count = np.zeros(size, np.int64)
        self._minus = np.zeros(size, _F32)
        self._n = 0
        self._folded = 0
        for token, bias in params.logit_bias.items():
            self._bias[self._add(token)] = bias

    def adjustments(self, positions: Sequence[int],
                    batch: Mapping[int, int]) -> list[Adjustment]:
        """Each row's adjustment: the row choosing the token at position p has seen the
        committed tokens before p, then ``batch``'s (the decode's drafts) up to p."""
        history = self.history
        while self._folded < len(history):  # committed since the last decode
            self._fold(history[self._folded], self._folded)
            self._folded += 1
        return [self._row(p, batch) for p in positions]

    def _row(self, position: int, batch: Mapping[int, int]) -> Adjustment:
        """The committed history's arrays, copied, with the drafts before ``position``
        folded into the copy. A row that has not seen the whole committed history (a prompt's
        rows where all are outputs; the engine asks for its last) is made from scratch."""
        if position < len(self.history):
            return adjustment(self.params, self.history[:position], self.n_prompt)
        n = self._n
        drafts = [(q, batch[q]) for q in range(len(self.history), position)]
        k = len(drafts)
        ids = np.concatenate([self._ids[:n], np.zeros(k, np.int32)])
        bias = np.concatenate([self._bias[:n], np.zeros(k, _F32)])
        penalty = np.concatenate([self._penalty[:n], np.ones(k, _F32)])
        minus = np.concatenate([self._minus[:n], np.zeros(k, _F32)])
        added: dict[int, int] = {}
        counts: dict[int, int] = {}
        m = n
        for q, token in drafts:
            generated = q >= self.n_prompt and self._counts
            if not (self._repeats or generated):
                continue
            slot = self._slot.get(token, added.get(token))
            if slot is None:  # a new id: no bias (every biased id has a slot from the start)
                slot = added[token] = m
                ids[m] = token
                m += 1
            if self._repeats:
                penalty[slot] = self.params.repetition_penalty
            if generated:
                counts[slot] = counts.get(slot, int(self._count[slot]) if slot < n else 0) + 1
                minus[slot] = self._taken_off(counts[slot])
        return Adjustment(ids[:m], bias[:m], penalty[:m], minus[:m])

    def _taken_off(self, count: int) -> float:
        """What the presence and frequency penalties take off an id generated ``count``
        times (summed in float64, as :func:`adjustment` sums it)."""
        return self.params.presence_penalty + self.params.frequency_penalty * count

    def _fold(self, token: int, position: int) -> None:
        """The token at ``position`` seen: its repetition penalty, and its count where it was
        generated."""
        generated = position >= self.n_prompt and self._counts
        if not (self._repeats or generated):
            return
        slot = self._add(token)
        if self._repeats:
            self._penalty[slot] = self.params.repetition_penalty
        if generated:
            self._count[slot] += 1
            self._minus[slot] = self._taken_off(int(self._count[slot]))

    def _add(self, token: int) -> int:
        """``token``'s slot in the arrays (a new one, changed by nothing yet, where it had
        none)."""
        slot = self._slot.get(token)
        if slot is not None:
            return slot
        if self._n == len(self._ids):
            grow = len(self._ids)
            self._ids = np.concatenate([self._ids, np.zeros(grow, np.int32)])
            self._bias = np.concatenate([self._bias, np.zeros(grow, _F32)])
            self._penalty = np.concatenate([self._penalty, np.ones(grow, _F32)])
            self._count = np.concatenate([self._count, np.zeros(grow, np.int64)])
            self._minus = np.concatenate([self._minus, np.zeros(grow, _F32)])
        slot = self._slot[token] = self._n
        self._ids[slot] = token
        self._n += 1
        return slot
