"""Rollback for pure-attention models: dropping the rejected positions from the KV cache.

Attention state is just the cells of each position, so removing positions ``pos0+k+1..``
leaves the context exactly as if only ``[last, d1..dk]`` had been decoded.
"""

from __future__ import annotations

from collections.abc import Sequence

from worker.engine.rollback.base import RollbackError
from worker.llm import Context


def trim_tail(target: Context, p0: int) -> None:
    """Remove positions ``p0..`` of the target's sequence; a refusal is an error, because the
    next decode would otherwise run on a state that still holds the rejected tokens."""
    if not target.seq_rm(p0):
        raise RollbackError(
            f"llama.cpp refused to remove positions {p0}.. (memory_seq_rm returned False): "
            "the target state was not rolled back"
        )


class KvTrimRollback:
    """No snapshots, no checkpoints: ``seq_rm`` of the rejected tail."""

    n_rs_seq = 0

    def prepare(self, target: Context, n_draft: int) -> None:
        """Nothing to save: attention cells of kept positions are never touched."""

    def rewind(self, target: Context, batch: Sequence[int], pos0: int, n_accepted: int) -> None:
        trim_tail(target, pos0 + n_accepted + 1)

    def telemetry(self) -> dict[str, object]:
        return {"rollback_depth": None}

    def close(self) -> None:
        """Nothing allocated."""
