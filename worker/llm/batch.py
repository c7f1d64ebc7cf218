"""A reusable ``llama_batch`` for token ids, optionally carrying one hidden-state row each.

MTP draft batches need both a token id and the target's hidden state per entry, but
``llama_batch_init(n, n_embd, 1)`` allocates only ``embd``; we own a separate token array
and null the pointer again before freeing (llama_batch_free would free our array). Reading
a pointer field of a ctypes struct aliases the field, so "saving the original" does not work.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import llama_cpp
import numpy as np


class Batch:
    """Fixed-capacity batch for one sequence (seq id 0)."""

    def __init__(self, capacity: int, n_embd: int = 0) -> None:
        self.capacity = capacity
        self.n_embd = n_embd
        self.raw = llama_cpp.llama_batch_init(capacity, n_embd, 1)
        self._tokens = None
        if n_embd:
            self._tokens = (llama_cpp.llama_token * capacity)()
            self.raw.token = ctypes.cast(self._tokens, type(self.raw.token))
            self._embd = np.ctypeslib.as_array(self.raw.embd, shape=(capacity, n_embd))
        for i in range(capacity):
            self.raw.n_seq_id[i] = 1
            self.raw.seq_id[i][0] = 0

    @property
    def n_tokens(self) -> int:
        return int(self.raw.n_tokens)

    def set(self, tokens: Sequence[int], pos0: int, logits: bool | Sequence[bool] = False,
            embd: np.ndarray | None = None) -> Batch:
        """Fill with ``tokens`` at positions ``pos0..``; ``logits`` per row or for all rows.

        Runs for every prefill slice and every verify, so the struct's pointer fields are read
        once: each ``raw.token`` read builds a new ctypes pointer object.
        """
        n = len(tokens)
        if n > self.capacity:
            raise ValueError(f"batch of {n} tokens exceeds capacity {self.capacity}")
        raw = self.raw
        token, pos, want = raw.token, raw.pos, raw.logits
        per_row = not isinstance(logits, bool)
        for i, t in enumerate(tokens):
            token[i] = t
            pos[i] = pos0 + i
            want[i] = logits[i] if per_row else logits  # type: ignore[index]
        if embd is not None:
            self._embd[:n] = embd
        raw.n_tokens = n
        return self

    def close(self) -> None:
        if self.raw is not None:
            if self._tokens is not None:
                self.raw.token = type(self.raw.token)()
            llama_cpp.llama_batch_free(self.raw)
            self.raw = None

    def __enter__(self) -> Batch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()
