"""Rollback for recurrent/hybrid models with one snapshot per draft position (D = N).

The target context is created with ``n_rs_seq = N``: llama.cpp then keeps N recurrent-state
snapshots of the last decode for every sequence, and ``seq_rm`` of a sequence's tail up to N
deep restores its state in place (the removal both trims the attention KV and rewinds the
recurrent layers). Deeper removals, or a context that was granted fewer snapshots, are
refused by llama.cpp with a ``False`` that :func:`trim_tail` turns into a
:class:`RollbackError`.
"""

from __future__ import annotations

from worker.engine.rollback.base import RollbackError, RollbackStats
from worker.engine.rollback.kv_trim import KvTrimRollback
from worker.llm import Context


class SnapshotRollback(KvTrimRollback):
    """Direct rollback through ``depth`` snapshots; drafts must not be deeper than that."""

    def __init__(self, depth: int) -> None:
        self.n_rs_seq = depth

    def prepare(self, target: Context, seq: int, n_draft: int) -> None:
        """Refuse a draft whose rejection could not be rolled back, before it is decoded."""
        if n_draft > self.n_rs_seq:
            raise RollbackError(
                f"a draft of {n_draft} tokens exceeds the {self.n_rs_seq} rollback snapshots "
                "the target context was created with"
            )

    def telemetry(self, seq: int) -> RollbackStats:
        return RollbackStats(rollback_depth=self.n_rs_seq)
