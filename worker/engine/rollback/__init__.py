"""Restoring the target context after a verify decode rejected a draft's tail.

:func:`make_rollback` picks the policy from the model and the depth D asked for: plain KV
trimming for pure attention, one snapshot per draft position when D is unset or D >= N, and
compact rollback (D snapshots plus a checkpoint and replay) when D < N.
"""

from __future__ import annotations

from shared.protocol import CheckpointMode
from worker.engine.rollback.base import Rollback, RollbackError
from worker.engine.rollback.compact import CompactRollback
from worker.engine.rollback.kv_trim import KvTrimRollback
from worker.engine.rollback.snapshots import SnapshotRollback
from worker.llm import Model

__all__ = ["Rollback", "RollbackError", "make_rollback"]


def make_rollback(model: Model, draft_max: int, rollback_depth: int | None,
                  checkpoint_mode: CheckpointMode, fail_device_checkpoint: bool,
                  slots: int = 1) -> Rollback:
    """The rollback policy for a target context of ``slots`` sequences sized for drafts of up
    to ``draft_max``."""
    if not model.is_recurrent:
        return KvTrimRollback()
    if rollback_depth is None or rollback_depth >= draft_max:
        return SnapshotRollback(draft_max)
    return CompactRollback(rollback_depth, draft_max, checkpoint_mode, fail_device_checkpoint,
                           slots)
