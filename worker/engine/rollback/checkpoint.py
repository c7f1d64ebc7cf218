"""Recurrent-state checkpoints for compact rollback: on the device first, sticky host fallback.

A checkpoint is llama.cpp's ``PARTIAL_ONLY`` sequence state: the recurrent rows only, not the
attention KV (which is trimmed by position instead). Two storages exist:

- **device** (``PARTIAL_ONLY | ON_DEVICE``): llama.cpp copies the tensors into a buffer owned
  by the context, on the device holding them; our byte buffer receives only a small header.
  No state crosses host memory, which is why it is preferred (host checkpoints cost a large
  share of throughput: docs/benchmarks.md, docs/rollback.md "Cost").
- **host** (``PARTIAL_ONLY``): the whole payload is copied into one reusable host buffer.

A device save can fail (llama.cpp reports it as a zero or short write, or the call raises).
The store then retries *that* checkpoint on the host and keeps host storage for the rest of
its life: a device that failed once is not trusted again mid-run, and flapping between modes
would make throughput unpredictable. Every checkpoint remembers where it was stored, so it is
restored with the matching flags.

Every slot (sequence) owns one store: llama.cpp keeps one ON_DEVICE checkpoint per sequence
and they coexist, and the fallback is sticky per store, so one slot's failed device save
moves only that slot to the host.

Over a device group a slot's device checkpoint lives on every device that holds recurrent
layers (llama.cpp copies each layer's rows into a buffer on that layer's device), and one
save or restore call covers them all: a failed save moves the slot's share on each of those
devices to the host together. The store names them (:attr:`CheckpointStore.devices`, set by
the start-up reservation), so the fallback's log event and telemetry say which devices of
the group fell back, not only that the worker did.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import llama_cpp

from shared.logs import get_logger
from shared.protocol import CheckpointMode
from worker.engine.rollback.base import RollbackError
from worker.engine.rollback.kv_trim import trim_tail
from worker.llm import Batch, Context

log = get_logger("rollback")

_FLAGS = {
    CheckpointMode.DEVICE: llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
    | llama_cpp.LLAMA_STATE_SEQ_FLAGS_ON_DEVICE,
    CheckpointMode.HOST: llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY,
}

#: What fault injection hands llama.cpp instead of a real buffer: too small for even the
#: header, so the real save call fails the way a broken device save does (returns 0).
_NO_ROOM = (ctypes.c_uint8 * 0)()


class _SaveFailed(Exception):
    """A device save did not produce a usable checkpoint; the message is the reason and
    ``kind`` its class (``fault_injection``, ``short_write``, ``zero_size``, ``error``), few
    enough to label a metric with."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class Checkpoint:
    """Where the last checkpoint lives and how many bytes of our buffer it occupies."""

    mode: CheckpointMode
    size: int


class CheckpointStore:
    """Saves and restores the recurrent state of one sequence ``seq`` of the target.

    ``fail_device`` is the fault-injection switch (``EngineConfig.fail_device_checkpoint``,
    ``SPECFLEET_FAIL_DEVICE_CHECKPOINT=1``): while set, every device save fails for real.
    It is a plain attribute so a drill can flip it on a running engine.
    """

    def __init__(self, mode: CheckpointMode = CheckpointMode.DEVICE,
                 fail_device: bool = False, seq: int = 0) -> None:
        self.seq = seq
        self.mode = CheckpointMode(mode)
        self.fail_device = fail_device
        self.saves = 0
        self.fallbacks = 0
        #: ``kind`` of the latest fallback (a store falls back at most once: it is sticky).
        self.fallback_reason: str | None = None
        #: The devices holding this slot's device checkpoint, in the model's order (the
        #: reservation sets them from the fit; empty: not known, no fit placed them), and
        #: those whose share the fallback moved to the host (None: no fallback).
        self.devices: tuple[str, ...] = ()
        self.fallback_devices: list[str] | None = None
        #: Device payload bytes the start-up reservation pinned.
        self._device_reserved = 0
        self._buffers: dict[CheckpointMode, ctypes.Array] = {}
        self._last: Checkpoint | None = None

    # -- start-up ----------------------------------------------------------------------------
    def reserve(self, ctx: Context) -> int:
        """Allocate the checkpoint storage now, so runtime cannot eat the fitted headroom.

        Device mode makes a real save: llama.cpp allocates its context-owned checkpoint buffer
        on the first save and reuses it afterwards. Host mode allocates the host buffer at the
        measured size. A failed device reservation selects host storage (sticky). Returns the
        bytes reserved in ``self.mode``'s storage (device: the tensor payload llama.cpp holds;
        host: our buffer). An empty sequence has no recurrent rows to save, so one probe token
        is decoded first and removed afterwards.
        """
        probe = ctx.pos_max(self.seq) < 0
        if probe:
            with Batch(1) as batch:
                ctx.decode(batch.set([0], 0, seq=self.seq))
        try:
            host_size = ctx.state_size(_FLAGS[CheckpointMode.HOST], self.seq)
            if self.mode is CheckpointMode.DEVICE:
                try:
                    self._save_in(ctx, CheckpointMode.DEVICE)
                    device_header = ctx.state_size(_FLAGS[CheckpointMode.DEVICE], self.seq)
                    self._device_reserved = host_size - device_header
                    return self._device_reserved
                except _SaveFailed as failure:
                    self._fall_back(failure, phase="reserve")
            self._buffer(CheckpointMode.HOST, host_size)
            return host_size
        finally:
            self._last = None
            if probe:
                trim_tail(ctx, 0, self.seq)

    # -- per verify --------------------------------------------------------------------------
    def save(self, ctx: Context) -> Checkpoint:
        """Checkpoint the sequence's recurrent state; device first, host on failure."""
        if self.mode is CheckpointMode.DEVICE:
            try:
                size = self._save_in(ctx, CheckpointMode.DEVICE)
            except _SaveFailed as failure:
                self._fall_back(failure, phase="save")
            else:
                return self._record(CheckpointMode.DEVICE, size)
        try:
            size = self._save_in(ctx, CheckpointMode.HOST)
        except _SaveFailed as failure:
            raise RollbackError(f"host checkpoint save failed: {failure}") from None
        return self._record(CheckpointMode.HOST, size)

    def restore(self, ctx: Context) -> None:
        """Put the last checkpoint back, with the flags it was saved with."""
        ckpt = self._last
        if ckpt is None:
            raise RollbackError("no checkpoint to restore: the verify was not prepared for it")
        read = ctx.state_restore(self._buffers[ckpt.mode], ckpt.size, _FLAGS[ckpt.mode],
                                 self.seq)
        if read != ckpt.size:
            raise RollbackError(
                f"{ckpt.mode.value} checkpoint restore read {read} of {ckpt.size} bytes"
            )

    def reserved_bytes(self) -> int:
        """Checkpoint storage held now in the mode in force: the device payload reserved at
        start-up, or the host buffer's size (0 before anything was reserved or saved)."""
        if self.mode is CheckpointMode.DEVICE:
            return self._device_reserved
        buf = self._buffers.get(CheckpointMode.HOST)
        return len(buf) if buf is not None else 0

    def discard(self) -> None:
        """Forget the last checkpoint (the verify it guarded needed no restore)."""
        self._last = None

    # -- internals ---------------------------------------------------------------------------
    def _save_in(self, ctx: Context, mode: CheckpointMode) -> int:
        flags = _FLAGS[mode]
        injected = mode is CheckpointMode.DEVICE and self.fail_device
        try:
            need = ctx.state_size(flags, self.seq)
            if need > 0:
                buf = _NO_ROOM if injected else self._buffer(mode, need)
                written = ctx.state_save(buf, flags, self.seq)
        except Exception as exc:  # a save that raises is a failed save, not a crash
            raise _SaveFailed(f"{type(exc).__name__}: {exc}", "error") from exc
        if need <= 0:
            raise _SaveFailed("size query returned 0 bytes", "zero_size")
        if written != need:
            cause = " (fault injection)" if injected else ""
            raise _SaveFailed(f"short write: {written} of {need} bytes{cause}",
                              "fault_injection" if injected else "short_write")
        return written

    def _buffer(self, mode: CheckpointMode, size: int) -> ctypes.Array:
        """The reusable buffer for ``mode``, grown (never shrunk) to ``size`` bytes."""
        buf = self._buffers.get(mode)
        if buf is None or len(buf) < size:
            buf = self._buffers[mode] = (ctypes.c_uint8 * size)()
        return buf

    def _record(self, mode: CheckpointMode, size: int) -> Checkpoint:
        self.saves += 1
        self._last = Checkpoint(mode, size)
        return self._last

    def _fall_back(self, failure: _SaveFailed, phase: str) -> None:
        self.mode = CheckpointMode.HOST
        self.fallbacks += 1
        self.fallback_reason = failure.kind
        self.fallback_devices = list(self.devices)
        log.warning("checkpoint.fallback", reason=str(failure), kind=failure.kind, phase=phase,
                    to="host", seq=self.seq, devices=self.fallback_devices)
