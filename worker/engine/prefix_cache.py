"""Prefix reuse: a finished slot keeps what it computed, and the next request that shares a
prefix with it starts from there instead of its first token (docs/engine.md, "Prefix reuse").

A slot's sequence in the target context is its cache entry: when a generation ends (finished,
cancelled), its tokens, KV and recurrent state stay where they are, and :meth:`PrefixCache.place`
puts the next request in the free slot whose cached tokens share the longest prefix with the
new prompt. No memory is added for the entries themselves (they are the slots' own, which the
fitter already counts); entries are evicted least recently used when a slot is needed.

What can be kept depends on the model's memory (:class:`MemoryKind`):

- **attention** (KV cache only): any prefix, by trimming the KV past it;
- **window** (sliding-window layers with a window-sized cache, Gemma 3): a prefix ``P`` as long
  as the window before ``P`` is still cached (``pos_min <= P - n_swa``), since older SWA cells
  are overwritten as the sequence grows;
- **recurrent** (hybrid and recurrent models): the recurrent state exists only at the sequence's
  end, so only the whole cached sequence can be kept.

Where the live state cannot give the prefix, **prefix checkpoints** can: the parts of the state
that cannot be trimmed (llama.cpp's ``PARTIAL_ONLY`` sequence state: the recurrent rows, or the
SWA cells) saved while a prompt is prefilled (at the end of each prompt and every
:data:`CHECKPOINT_SPACING` tokens of a long one), a bounded number per slot in host buffers
reserved at load. Reuse restores the deepest checkpoint at or below the common prefix, trims
the KV to it and prefills from there (llama-server's ``--ctx-checkpoints``).

An engine's draft head (the MTP head's draft context) must be in step too: a reused prefix
keeps the head's state up to it and needs the target's hidden state of the position before it,
which is live at the end of the cached sequence and stored with every checkpoint, so a request
that drafts with the head reuses only those points (``follows``: the head's
:meth:`~worker.engine.proposers.head.DraftHead.follows`).

:class:`NoPrefixCache` is the policy with reuse off (``--prefix-cache off``): every request is
prefilled from its first token and every sequence is cleared when its generation ends, so the
engine's loop has no ``if enabled`` branches.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Protocol

import llama_cpp
import numpy as np

from shared.logs import get_logger
from worker.llm import Batch, Context, LlamaError, Model

if TYPE_CHECKING:
    from worker.engine.proposers.head import DraftHead

log = get_logger("engine.prefix")

#: A prompt longer than this gets a checkpoint every this many tokens while it is prefilled
#: (besides the one at its end): a prompt that shares only part of a long one with an earlier
#: request (a shared system prompt, different questions) then re-prefills at most this much.
CHECKPOINT_SPACING = 512

_PARTIAL = llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY


class MemoryKind(Enum):
    """What of a sequence's state can be cut back to a shorter prefix (module docstring)."""

    ATTENTION = "attention"
    WINDOW = "window"
    RECURRENT = "recurrent"

    @property
    def checkpoints(self) -> bool:
        """The live state cannot give every prefix: prefix checkpoints are worth keeping."""
        return self is not MemoryKind.ATTENTION

    @classmethod
    def of(cls, model: Model, swa_full: bool) -> MemoryKind:
        if model.is_recurrent:
            return cls.RECURRENT
        if model.n_swa > 0 and not swa_full:
            return cls.WINDOW
        return cls.ATTENTION


def checkpoint_bytes(model: Model, ctx: Context, seq: int = 0) -> int:
    """The largest prefix checkpoint of one sequence of ``ctx``, in bytes (0: the model's
    state can always be trimmed, so it needs none).

    Measured from llama.cpp's state-size API on ``seq`` (empty; probe tokens are decoded and
    removed): a recurrent state has one size; a sliding-window state grows by one cell's bytes
    per cached position up to the window, so two probes give the header and the cell, and the
    bound is a full window. The fitter counts the same figure (``prefix_checkpoints``).
    """
    kind = MemoryKind.of(model, ctx.spec.swa_full)
    if not kind.checkpoints:
        return 0
    sizes = []
    with Batch(2) as batch:
        try:
            for n in (1, 2):
                ctx.decode(batch.set([0] * n, 0, seq=seq))
                sizes.append(ctx.state_size(_PARTIAL, seq))
                ctx.seq_clear(seq)
        finally:
            ctx.seq_rm(-1, -1, seq)
    one, two = sizes
    if kind is MemoryKind.RECURRENT:
        return one
    return one + (two - one) * (model.n_swa - 1)


@dataclass
class PrefixCheckpoint:
    """The untrimmable state of a sequence's first ``pos`` positions, in buffer ``buffer``."""

    pos: int
    buffer: int
    size: int
    #: The target's hidden state at ``pos - 1`` (the draft head resumes from it); None when
    #: the slot was not drafting with the head.
    hidden: np.ndarray | None


@dataclass
class _Entry:
    """What one sequence holds: ``tokens`` decoded in the target (positions 0..), whether the
    draft head is in step with them, and its prefix checkpoints (oldest first)."""

    tokens: list[int] = field(default_factory=list)
    head_synced: bool = False
    checkpoints: list[PrefixCheckpoint] = field(default_factory=list)
    used: int = 0


@dataclass(frozen=True)
class Placement:
    """Where a request runs: sequence ``seq``, its first ``keep`` prompt positions kept (from
    the live sequence, or by restoring ``checkpoint``)."""

    seq: int
    keep: int = 0
    checkpoint: PrefixCheckpoint | None = None

    @property
    def source(self) -> str:
        return "checkpoint" if self.checkpoint is not None else "slot"


@dataclass
class PrefixStats:
    """One placement's share of the telemetry (the engine adds it to the slot's counters)."""

    cached_tokens: int = 0
    hits: int = 0
    misses: int = 0
    restores: int = 0


class PrefixPolicy(Protocol):
    """How the engine places requests in sequences and what a finished sequence leaves."""

    #: Bytes of prefix-checkpoint storage reserved (host memory).
    reserved_bytes: int

    def place(self, prompt: Sequence[int], free: Sequence[int], follows: bool,
              allowed: bool) -> Placement:
        """Pick the sequence for ``prompt`` among ``free`` ones and what of it to keep
        (``follows``: the request drafts with the draft head; ``allowed``: it did not opt
        out)."""
        ...

    def apply(self, placement: Placement, target: Context, head: DraftHead,
              follows: bool) -> PrefixStats:
        """Make the sequence hold exactly the kept prefix (trim, restore or clear it, and
        tell the draft head)."""
        ...

    def prefilled(self, target: Context, seq: int, pos: int, prompt_end: bool,
                  hidden: np.ndarray | None) -> bool:
        """The target has decoded the first ``pos`` prompt positions of ``seq``: save a
        checkpoint there if one is due; True when one was saved."""
        ...

    def release(self, target: Context, seq: int, tokens: Sequence[int] | None,
                head_synced: bool) -> None:
        """``seq``'s generation is over: keep ``tokens`` (what its positions hold) as its
        entry, or clear it (None: its state is not to be trusted, or the request opted out)."""
        ...


class NoPrefixCache:
    """Reuse off: the first free sequence, nothing kept, every sequence cleared at the end."""

    reserved_bytes = 0

    def place(self, prompt: Sequence[int], free: Sequence[int], follows: bool,
              allowed: bool) -> Placement:
        return Placement(free[0])

    def apply(self, placement: Placement, target: Context, head: DraftHead,
              follows: bool) -> PrefixStats:
        head.on_place(placement.seq, follows, 0, None)
        return PrefixStats()

    def prefilled(self, target: Context, seq: int, pos: int, prompt_end: bool,
                  hidden: np.ndarray | None) -> bool:
        return False

    def release(self, target: Context, seq: int, tokens: Sequence[int] | None,
                head_synced: bool) -> None:
        target.seq_clear(seq)


class PrefixCache:
    """Every slot's cache entry and prefix checkpoints (see the module docstring)."""

    def __init__(self, kind: MemoryKind, n_swa: int, slots: int, per_slot: int,
                 checkpoint_size: int) -> None:
        self.kind = kind
        self.n_swa = n_swa
        self._entries = [_Entry() for _ in range(slots)]
        #: First position each sequence's sliding-window cells still hold, read at release
        #: (nothing decodes into a free sequence until it is placed, and every sequence has
        #: its own cache stream, so no other slot's decodes overwrite them meanwhile).
        self._window_start = [0] * slots
        self._clock = 0
        #: Checkpoints only where the live state cannot be trimmed (and the draft head needs
        #: the hidden state of a cut point, which only a checkpoint keeps).
        self.per_slot = per_slot if checkpoint_size > 0 else 0
        self.checkpoint_size = checkpoint_size
        self._buffers = [[(ctypes.c_uint8 * checkpoint_size)() for _ in range(self.per_slot)]
                         for _ in range(slots)]
        self.reserved_bytes = slots * self.per_slot * checkpoint_size

    # -- placing -------------------------------------------------------------------------------
    def place(self, prompt: Sequence[int], free: Sequence[int], follows: bool,
              allowed: bool) -> Placement:
        best: Placement | None = None
        if allowed:
            for seq in free:
                found = self._reusable(seq, prompt, follows)
                if found.keep and (best is None or found.keep > best.keep):
                    best = found
        if best is not None:
            return best
        # Nothing to reuse: evict the least recently used entry (an empty one first).
        return Placement(min(free, key=lambda s: (bool(self._entries[s].tokens),
                                                  self._entries[s].used)))

    def _reusable(self, seq: int, prompt: Sequence[int], follows: bool) -> Placement:
        """The longest prefix of ``prompt`` that ``seq`` can give, live or from a checkpoint.
        The last prompt token is never kept: it opens the first verify."""
        entry = self._entries[seq]
        if follows and not entry.head_synced:
            return Placement(seq)
        limit = min(common_prefix(entry.tokens, prompt), len(prompt) - 1)
        if limit <= 0:
            return Placement(seq)
        live = limit if self._trimmable(seq, limit, len(entry.tokens), follows) else 0
        ckpt = max((c for c in entry.checkpoints
                    if c.pos <= limit and (c.hidden is not None or not follows)),
                   key=lambda c: c.pos, default=None)
        if ckpt is not None and ckpt.pos > live:
            return Placement(seq, ckpt.pos, ckpt)
        return Placement(seq, live)

    def _trimmable(self, seq: int, keep: int, cached: int, follows: bool) -> bool:
        """Whether the live sequence can be cut back to its first ``keep`` positions."""
        if keep == cached:
            return True
        if follows or self.kind is MemoryKind.RECURRENT:
            return False
        if self.kind is MemoryKind.WINDOW:
            return self._window_start[seq] <= max(0, keep - self.n_swa)
        return True

    # -- applying ------------------------------------------------------------------------------
    def apply(self, placement: Placement, target: Context, head: DraftHead,
              follows: bool) -> PrefixStats:
        seq, keep, ckpt = placement.seq, placement.keep, placement.checkpoint
        entry = self._entries[seq]
        self._clock += 1
        entry.used = self._clock
        if keep == 0:
            self._clear(target, seq)
            head.on_place(seq, follows, 0, None)
            return PrefixStats(misses=1)
        if ckpt is not None:
            read = target.state_restore(self._buffers[seq][ckpt.buffer], ckpt.size, _PARTIAL,
                                        seq)
            if read != ckpt.size:
                raise LlamaError(f"prefix checkpoint restore read {read} of {ckpt.size} bytes")
        if keep < len(entry.tokens) and not target.seq_rm(keep, -1, seq):
            raise LlamaError(f"llama.cpp refused to cut sequence {seq} back to {keep} tokens")
        del entry.tokens[keep:]
        entry.checkpoints = [c for c in entry.checkpoints if c.pos <= keep]
        head.on_place(seq, follows, keep, ckpt.hidden if ckpt is not None else None)
        return PrefixStats(cached_tokens=keep, hits=1, restores=int(ckpt is not None))

    def _clear(self, target: Context, seq: int) -> None:
        """Empty ``seq`` (always: a sequence released without an entry still holds what its
        generation decoded)."""
        entry = self._entries[seq]
        target.seq_clear(seq)
        entry.tokens = []
        entry.checkpoints = []
        entry.head_synced = False

    # -- while prefilling ----------------------------------------------------------------------
    def prefilled(self, target: Context, seq: int, pos: int, prompt_end: bool,
                  hidden: np.ndarray | None) -> bool:
        if self.per_slot == 0:
            return False
        entry = self._entries[seq]
        last = max((c.pos for c in entry.checkpoints), default=0)
        if pos <= last or not (prompt_end or pos - last >= CHECKPOINT_SPACING):
            return False
        need = target.state_size(_PARTIAL, seq)
        if need > self.checkpoint_size:  # the reservation is the bound: never grow past it
            log.warning("prefix.checkpoint_skipped", seq=seq, pos=pos, bytes=need,
                        reserved=self.checkpoint_size)
            return False
        used = {c.buffer for c in entry.checkpoints}
        if len(used) == self.per_slot:
            oldest = entry.checkpoints.pop(0)
            used.discard(oldest.buffer)
        buffer = next(i for i in range(self.per_slot) if i not in used)
        written = target.state_save(self._buffers[seq][buffer], _PARTIAL, seq)
        if written != need:
            log.warning("prefix.checkpoint_failed", seq=seq, pos=pos, written=written, need=need)
            return False
        entry.checkpoints.append(PrefixCheckpoint(
            pos, buffer, written, hidden.copy() if hidden is not None else None))
        return True

    # -- releasing -----------------------------------------------------------------------------
    def release(self, target: Context, seq: int, tokens: Sequence[int] | None,
                head_synced: bool) -> None:
        entry = self._entries[seq]
        if tokens is None:
            self._clear(target, seq)
            return
        entry.tokens = list(tokens)
        entry.head_synced = head_synced
        # Checkpoints beyond what the sequence now holds (a cancel mid-prefill) are not its.
        entry.checkpoints = [c for c in entry.checkpoints if c.pos <= len(entry.tokens)]
        if self.kind is MemoryKind.WINDOW:
            self._window_start[seq] = max(target.pos_min(seq), 0)

    def cached(self, seq: int) -> list[int]:
        """The tokens ``seq`` holds (tests and the fleet's digests read it)."""
        return list(self._entries[seq].tokens)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists (numpy: prompts are long)."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x = np.asarray(a[:n])
    y = np.asarray(b[:n])
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n


def make_prefix_policy(enabled: bool, model: Model, target: Context, slots: int,
                       per_slot: int) -> PrefixPolicy:
    """The engine's policy: :class:`PrefixCache` when reuse is on, else :class:`NoPrefixCache`."""
    if not enabled:
        return NoPrefixCache()
    kind = MemoryKind.of(model, target.spec.swa_full)
    size = checkpoint_bytes(model, target) if per_slot > 0 else 0
    cache = PrefixCache(kind, model.n_swa, slots, per_slot, size)
    log.info("prefix.cache", memory=kind.value, n_swa=model.n_swa,
             checkpoints_per_slot=cache.per_slot, checkpoint_bytes=size,
             reserved_bytes=cache.reserved_bytes)
    return cache
