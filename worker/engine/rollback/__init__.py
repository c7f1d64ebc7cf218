"""Restoring the target context after a verify decode rejected a draft's tail.

Three policies: plain KV trimming for pure attention, one snapshot per draft position when D
is unset or D >= N, and compact rollback (D snapshots plus a checkpoint and replay) when
D < N; the engine's plan chooses and builds one
(:meth:`worker.engine.plan.EnginePlan.rollback_policy`).
"""

from __future__ import annotations

from worker.engine.rollback.base import Rollback, RollbackError, RollbackStats
from worker.engine.rollback.compact import CompactRollback
from worker.engine.rollback.kv_trim import KvTrimRollback
from worker.engine.rollback.snapshots import SnapshotRollback

__all__ = ["CompactRollback", "KvTrimRollback", "Rollback", "RollbackError", "RollbackStats",
           "SnapshotRollback"]
