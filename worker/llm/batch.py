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
    """Fixed-capacity batch; every row names its sequence, so one decode can carry the
    verify rows and prompt chunks of several sequences (slots) at once."""

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
        self.raw.n_tokens = 0

    @property
    def n_tokens(self) -> int:
        return int(self.raw.n_tokens)

    def set(self, tokens: Sequence[int], pos0: int, logits: bool | Sequence[bool] = False,
            embd: np.ndarray | None = None, seq: int = 0) -> Batch:
        """Fill with ``tokens`` of sequence ``seq`` at positions ``pos0..`` (see :meth:`add`)."""
        self.raw.n_tokens = 0
        self.add(tokens, pos0, logits, embd, seq)
        return self

    def clear(self) -> Batch:
        """Empty the batch; rows are then appended with :meth:`add`."""
        self.raw.n_tokens = 0
        return self

    def add(self, tokens: Sequence[int], pos0: int, logits: bool | Sequence[bool] = False,
            embd: np.ndarray | None = None, seq: int = 0) -> int:
        """Append ``tokens`` of sequence ``seq`` at positions ``pos0..``; ``logits`` per row or
        for all rows. Returns the batch index of the first appended row (the index output rows
        are read back by).

        Runs for every prefill slice and every verify, so the struct's pointer fields are read
        once: each ``raw.token`` read builds a new ctypes pointer object.
        """
        raw = self.raw
        start = int(raw.n_tokens)
        n = len(tokens)
        if start + n > self.capacity:
            raise ValueError(f"batch of {start + n} tokens exceeds capacity {self.capacity}")
        token, pos, want, seq_id = raw.token, raw.pos, raw.logits, raw.seq_id
        per_row = not isinstance(logits, bool)
        for i, t in enumerate(tokens):
            row = start + i
            token[row] = t
            pos[row] = pos0 + i
            want[row] = logits[i] if per_row else logits  # type: ignore[index]
            seq_id[row][0] = seq
        if embd is not None:
            self._embd[start:start + n] = embd
        raw.n_tokens = start + n
        return start

    def pad_even(self) -> list[tuple[int, int]]:
        """Give every sequence in the batch an even number of rows (at least 2): a sequence
        with an odd count gets one more row, token 0 at the position after its last, with
        logits when any of its rows has them. Appended after every caller row, so no caller
        row's index (and output row) moves. Returns the ``(seq, pos)`` of each added row, for
        the caller to trim from the memory after the decode and :meth:`drop` from the batch.

        Why: the CPU kernels llama.cpp picks depend on how many rows a matrix product has
        (one row: ``vec_dot``; two or more: llamafile's tinyBLAS), and each sequence's
        attention is one product per sequence; with every sequence at an even count >= 2 no
        product ever has one row, and llama.cpp's equal split of a batch into per-sequence
        ubatches never leaves one either (docs/engine.md, "Deterministic mode")."""
        raw = self.raw
        count: dict[int, int] = {}
        last: dict[int, int] = {}
        logits: dict[int, bool] = {}
        for row in range(int(raw.n_tokens)):
            seq = int(raw.seq_id[row][0])
            count[seq] = count.get(seq, 0) + 1
            last[seq] = max(last.get(seq, -1), int(raw.pos[row]))
            logits[seq] = logits.get(seq, False) or bool(raw.logits[row])
        pads = [(seq, last[seq] + 1) for seq, n in count.items() if n % 2]
        for seq, pos in pads:
            self.add([0], pos, logits[seq], seq=seq)
        return pads

    def drop(self, n: int) -> None:
        """Remove the last ``n`` rows (the ones :meth:`pad_even` added)."""
        self.raw.n_tokens = int(self.raw.n_tokens) - n

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
