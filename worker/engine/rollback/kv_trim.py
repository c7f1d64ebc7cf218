"""Rollback for pure-attention models: dropping the rejected positions from the KV cache.

Attention state is just the cells of each position, so removing positions ``pos0+k+1..`` of a
sequence leaves it exactly as if only ``[last, d1..dk]`` had been decoded; the other
sequences' cells are not touched.
"""

from __future__ import annotations

from collections.abc import Sequence

from worker.engine.rollback.base import RollbackError, RollbackStats
from worker.llm import Context


def trim_tail(target: Context, p0: int, seq: int = 0) -> None:
    """Remove positions ``p0..`` of sequence ``seq``; a refusal is an error, because the next
    decode would otherwise run on a state that still holds the rejected tokens."""
    if not target.seq_rm(p0, seq=seq):
        raise RollbackError(
            f"llama.cpp refused to remove positions {p0}.. of sequence {seq} "
            "(memory_seq_rm returned False): the target state was not rolled back"
        )


class KvTrimRollback:
    """No snapshots, no checkpoints: ``seq_rm`` of the rejected tail."""

    n_rs_seq = 0

    def prepare(self, target: Context, seq: int, n_draft: int) -> None:
        """Nothing to save: attention cells of kept positions are never touched."""

    def rewind(self, target: Context, seq: int, batch: Sequence[int], pos0: int,
               n_accepted: int) -> None:
        trim_tail(target, pos0 + n_accepted + 1, seq)

    def settle(self, target: Context) -> None:
        """Every rewind was a trim, done already."""

    def release(self, seq: int) -> None:
        """No per-sequence state."""

    def telemetry(self, seq: int) -> RollbackStats:
        return RollbackStats()

    def close(self) -> None:
        """Nothing allocated."""
