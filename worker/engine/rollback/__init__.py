"""Restoring the target context after a verify decode rejected a draft's tail.

:func:`make_rollback` builds the policy the engine's plan chose
(:func:`worker.engine.plan.plan_engine`): plain KV trimming for pure attention, one snapshot
per draft position when D is unset or D >= N, and compact rollback (D snapshots plus a
checkpoint and replay) when D < N.
"""

from __future__ import annotations

from worker.engine.plan import EnginePlan, RollbackKind
from worker.engine.rollback.base import Rollback, RollbackError, RollbackStats
from worker.engine.rollback.compact import CompactRollback
from worker.engine.rollback.kv_trim import KvTrimRollback
from worker.engine.rollback.snapshots import SnapshotRollback

__all__ = ["Rollback", "RollbackError", "RollbackStats", "make_rollback"]


def make_rollback(plan: EnginePlan, fail_device_checkpoint: bool = False) -> Rollback:
    """The rollback policy of ``plan``'s target context (``plan.slots`` sequences, drafts of up
    to ``plan.draft_max``); ``fail_device_checkpoint`` is the fault-injection switch."""
    if plan.rollback is RollbackKind.KV_TRIM:
        return KvTrimRollback()
    if plan.checkpoint is None:  # snapshots only: D = N
        return SnapshotRollback(plan.n_rs_seq)
    return CompactRollback(plan.n_rs_seq, plan.draft_max, plan.checkpoint,
                           fail_device_checkpoint, plan.slots)
