"""Compact rollback: D direct snapshots plus one checkpoint, for drafts up to N > D tokens.

Standard recurrent rollback keeps one state snapshot per draft position, so the recurrent
memory grows with the draft maximum N (``1 live + N snapshots``). Here the target context is
created with ``n_rs_seq = D`` and a draft longer than D is guarded by one ``PARTIAL_ONLY``
checkpoint saved right before its verify decode (``1 live + D snapshots + 1 checkpoint``):

- a rejected suffix of depth <= D is rolled back directly through the snapshots;
- a deeper one restores the checkpoint (the state before the verify), trims the KV and
  replays the already-known tokens ``[last, accepted drafts]`` in one decode without logits.
  Nothing is re-drafted or re-sampled: the verify's bonus token and its output rows stay the
  ones the loop already read.
"""

from __future__ import annotations

from collections.abc import Sequence

from shared.logs import get_logger
from shared.protocol import CheckpointMode
from worker.engine.rollback.base import RollbackError
from worker.engine.rollback.checkpoint import CheckpointStore
from worker.engine.rollback.kv_trim import trim_tail
from worker.llm import Batch, Context, LlamaError

log = get_logger("rollback")


class CompactRollback:
    """Bounded-depth recurrent rollback with checkpoint restore and replay (seed 003)."""

    def __init__(self, depth: int, draft_max: int, mode: CheckpointMode,
                 fail_device: bool) -> None:
        if not 1 <= depth <= draft_max:
            raise ValueError(
                f"rollback_depth ({depth}) must satisfy 1 <= rollback_depth <= draft_max "
                f"({draft_max})"
            )
        self.n_rs_seq = depth
        self.store = CheckpointStore(mode, fail_device)
        self.replay_events = 0
        self.replay_tokens = 0
        self._replay = Batch(draft_max + 1)

    def reserve(self, target: Context) -> int:
        """Allocate checkpoint storage up front (the fitter calls this at worker start)."""
        return self.store.reserve(target)

    def prepare(self, target: Context, n_draft: int) -> None:
        """Checkpoint the state before a verify only when its draft is longer than D: any
        rejection of a shorter one is shallow enough for the snapshots. Otherwise the old
        checkpoint is forgotten, so it can never be restored into a later verify."""
        if n_draft > self.n_rs_seq:
            self.store.save(target)
        else:
            self.store.discard()

    def rewind(self, target: Context, batch: Sequence[int], pos0: int, n_accepted: int) -> None:
        """Drop ``batch[n_accepted + 1:]``. The caller must have read every output row it
        needs first: a replay is a decode and replaces the context's outputs."""
        depth = len(batch) - 1 - n_accepted
        if depth <= self.n_rs_seq:
            trim_tail(target, pos0 + n_accepted + 1)
            return
        self.store.restore(target)
        trim_tail(target, pos0)
        kept = batch[: n_accepted + 1]
        try:
            target.decode(self._replay.set(kept, pos0))
        except LlamaError as exc:
            raise RollbackError(f"replay of {len(kept)} tokens failed: {exc}") from exc
        self.replay_events += 1
        self.replay_tokens += len(kept)
        log.info("rollback.replay", depth=depth, tokens=len(kept), pos=pos0)

    def telemetry(self) -> dict[str, object]:
        return {
            "replay_events": self.replay_events,
            "replay_tokens": self.replay_tokens,
            "checkpoint_mode": self.store.mode.value,
            "checkpoint_saves": self.store.saves,
            "host_fallbacks": self.store.fallbacks,
            "rollback_depth": self.n_rs_seq,
        }

    def close(self) -> None:
        """Free the replay batch (llama.cpp memory) with the engine, not at garbage collection."""
        self._replay.close()
