"""Compact rollback: D direct snapshots plus one checkpoint, for drafts up to N > D tokens.

Standard recurrent rollback keeps one state snapshot per draft position, so the recurrent
memory grows with the draft maximum N (``1 live + N snapshots``). Here the target context is
created with ``n_rs_seq = D`` and a draft longer than D is guarded by one ``PARTIAL_ONLY``
checkpoint saved right before its verify decode (``1 live + D snapshots + 1 checkpoint``, per
sequence):

- a rejected suffix of depth <= D is rolled back directly through the snapshots;
- a deeper one restores the checkpoint (the state before the verify), trims the KV and
  replays the already-known tokens ``[last, accepted drafts]`` without logits. Nothing is
  re-drafted or re-sampled: the verify's bonus token and its output rows stay the ones the
  loop already read.

With several slots every sequence has its own checkpoint store (own storage mode, own sticky
fallback) and its own counters. The deep rejections of one step are replayed together, in one
decode, after every slot's direct rollbacks (snapshot rollback applies to the batch decoded
last, which a replay would replace).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shared.logs import get_logger
from shared.protocol import CheckpointMode
from worker.engine.rollback.base import RollbackError, RollbackStats
from worker.engine.rollback.checkpoint import CheckpointStore
from worker.engine.rollback.kv_trim import trim_tail
from worker.llm import Batch, Context, LlamaError

log = get_logger("rollback")


@dataclass(frozen=True)
class _Replay:
    """A deep rejection waiting for :meth:`CompactRollback.settle`."""

    seq: int
    tokens: list[int]
    pos0: int
    depth: int


@dataclass(frozen=True)
class Reservation:
    """What :meth:`CompactRollback.reserve` pinned: every slot's storage, in one mode."""

    mode: CheckpointMode
    bytes_per_slot: int
    #: Why the device reservation fell back to host storage (None: it did not), and the
    #: devices whose checkpoint share moved to the host.
    fallback_reason: str | None
    fallback_devices: list[str] | None


class CompactRollback:
    """Bounded-depth recurrent rollback with checkpoint restore and replay (docs/rollback.md,
    "Why compact rollback")."""

    def __init__(self, depth: int, draft_max: int, mode: CheckpointMode,
                 fail_device: bool, slots: int = 1) -> None:
        if not 1 <= depth <= draft_max:
            raise ValueError(
                f"rollback_depth ({depth}) must satisfy 1 <= rollback_depth <= draft_max "
                f"({draft_max})"
            )
        self.n_rs_seq = depth
        #: One checkpoint store per sequence (slot), indexed by seq id.
        self.stores = [CheckpointStore(mode, fail_device, seq) for seq in range(slots)]
        self.replay_events = [0] * slots
        self.replay_tokens = [0] * slots
        self._pending: list[_Replay] = []
        self._replay = Batch(slots * (draft_max + 1))

    def place(self, devices: Sequence[str]) -> None:
        """Name the devices every slot's device checkpoint lives on (the fit's, before
        :meth:`reserve`), for the fallback's event and telemetry."""
        for store in self.stores:
            store.devices = tuple(devices)

    def reserve(self, target: Context) -> Reservation:
        """Allocate every slot's checkpoint storage up front (the fitter calls this at worker
        start); returns the mode and the bytes reserved per slot.

        A device reservation that fails for one slot selects host storage for every slot: at
        start-up a failure says the device cannot hold checkpoints this run (docs/rollback.md,
        "Checkpoint storage: device first, sticky host fallback"), and
        one mode for all slots keeps the reservation one figure the fit can check. Later save
        failures stay per slot (:class:`CheckpointStore`'s sticky fallback).
        """
        sizes = [store.reserve(target) for store in self.stores]
        if any(store.mode is CheckpointMode.HOST for store in self.stores):
            for i, store in enumerate(self.stores):
                if store.mode is CheckpointMode.DEVICE:
                    store.mode = CheckpointMode.HOST
                    sizes[i] = store.reserve(target)
        if len(set(sizes)) != 1:
            raise RollbackError(f"the slots' checkpoint reservations differ: {sizes} bytes")
        failed = next((st for st in self.stores if st.fallback_reason), None)
        return Reservation(self.stores[0].mode, sizes[0],
                           failed.fallback_reason if failed else None,
                           failed.fallback_devices if failed else None)

    def prepare(self, target: Context, seq: int, n_draft: int) -> None:
        """Checkpoint the state before a verify only when its draft is longer than D: any
        rejection of a shorter one is shallow enough for the snapshots. Otherwise the old
        checkpoint is forgotten, so it can never be restored into a later verify."""
        if n_draft > self.n_rs_seq:
            self.stores[seq].save(target)
        else:
            self.stores[seq].discard()

    def rewind(self, target: Context, seq: int, batch: Sequence[int], pos0: int,
               n_accepted: int) -> None:
        """Drop ``batch[n_accepted + 1:]`` of ``seq``: through the snapshots now, or by restore
        and replay at :meth:`settle` when the rejected tail is deeper than D."""
        depth = len(batch) - 1 - n_accepted
        if depth <= self.n_rs_seq:
            trim_tail(target, pos0 + n_accepted + 1, seq)
            return
        self._pending.append(_Replay(seq, list(batch[: n_accepted + 1]), pos0, depth))

    def settle(self, target: Context) -> None:
        """Restore every deep rejection's checkpoint, trim its KV, and replay them all in one
        decode without logits."""
        if not self._pending:
            return
        pending, self._pending = sorted(self._pending, key=lambda r: r.seq), []
        self._replay.clear()
        for r in pending:  # in sequence order, as a verify (verify.py)
            self.stores[r.seq].restore(target)
            trim_tail(target, r.pos0, r.seq)
            self._replay.add(r.tokens, r.pos0, seq=r.seq)
        try:
            target.decode(self._replay)
        except LlamaError as exc:
            raise RollbackError(f"replay of {self._replay.n_tokens} tokens failed: {exc}") from exc
        for r in pending:
            self.replay_events[r.seq] += 1
            self.replay_tokens[r.seq] += len(r.tokens)
            log.info("rollback.replay", seq=r.seq, depth=r.depth, tokens=len(r.tokens),
                     pos=r.pos0)

    def release(self, seq: int) -> None:
        """A finished slot's checkpoint must never be restored into the next request's."""
        self.stores[seq].discard()

    def telemetry(self, seq: int) -> RollbackStats:
        store = self.stores[seq]
        return RollbackStats(
            replay_events=self.replay_events[seq], replay_tokens=self.replay_tokens[seq],
            checkpoint_saves=store.saves, host_fallbacks=store.fallbacks,
            checkpoint_mode=store.mode, host_fallback_reason=store.fallback_reason,
            host_fallback_devices=store.fallback_devices,
            checkpoint_reservation_bytes=store.reserved_bytes(), rollback_depth=self.n_rs_seq)

    def close(self) -> None:
        """Free the replay batch (llama.cpp memory) with the engine, not at garbage collection."""
        self._replay.close()
