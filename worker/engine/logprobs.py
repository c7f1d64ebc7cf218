"""Log probabilities of the committed tokens, for requests that ask for them.

They are the model's raw distribution (log-softmax of the logits, before penalties,
temperature and cuts: OpenAI's and vLLM's default), read from the verify's output rows
while they are still there. A request that did not ask gets :class:`NoLogprobs`, so the
verify loop has no ``if logprobs`` in it.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from shared.protocol import TokenLogprob, TopLogprob
from worker.llm import Context, Model


class LogprobReporter(Protocol):
    def report(self, ctx: Context, row0: int, tokens: list[int]) -> list[TokenLogprob]:
        """Token ``tokens[i]`` was chosen at output row ``row0 + i`` of the last decode."""
        ...


class NoLogprobs:
    def report(self, ctx: Context, row0: int, tokens: list[int]) -> list[TokenLogprob]:
        return []


class TopLogprobs:
    """Each token's log probability and its ``k`` most likely alternatives."""

    def __init__(self, model: Model, k: int) -> None:
        self.model = model
        self.k = k

    def report(self, ctx: Context, row0: int, tokens: list[int]) -> list[TokenLogprob]:
        rows = ctx.logits_rows(row0, len(tokens)).astype(np.float64)
        top = rows.max(axis=1, keepdims=True)
        logp = rows - (top + np.log(np.exp(rows - top).sum(axis=1, keepdims=True)))
        out = []
        for token, row in zip(tokens, logp, strict=True):
            text, raw = self._piece(token)
            out.append(TokenLogprob(token=token, text=text, bytes=raw, logprob=float(row[token]),
                                    top_logprobs=self._alternatives(row)))
        return out

    def _alternatives(self, row: np.ndarray) -> list[TopLogprob]:
        if self.k == 0:
            return []
        # Every id tied with the k-th value competes, and ties go to the lower id: which of
        # them argpartition keeps depends on the rest of the row's last bits, so a stream and
        # a whole reply of the same tokens listed different alternatives (gateway tests,
        # two tokens tied 18.4 nats down on the tiny chat model).
        kth = np.partition(row, len(row) - self.k)[len(row) - self.k]
        tied = np.flatnonzero(row >= kth)
        best = tied[np.lexsort((tied, -row[tied]))][:self.k]
        return [TopLogprob(token=int(t), text=text, bytes=raw, logprob=float(row[t]))
                for t in best for text, raw in [self._piece(int(t))]]

    def _piece(self, token: int) -> tuple[str, list[int]]:
        """``token``'s text (decoded with replacement) and its raw bytes."""
        raw = self.model.token_bytes(token)
        return raw.decode("utf-8", errors="replace"), list(raw)


def make_logprobs(model: Model, k: int | None) -> LogprobReporter:
    """``k`` None: the request wants no logprobs; else each token's and ``k`` alternatives."""
    return NoLogprobs() if k is None else TopLogprobs(model, k)
