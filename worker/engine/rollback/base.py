"""The rollback seam between the verify loop and the target context's memory.

The verify loop decodes ``[last, d1..dn]`` of a sequence at positions ``pos0..pos0+n`` and
accepts ``k`` drafts. That sequence must then look exactly as if it had decoded only
``[last, d1..dk]``: positions ``pos0+k+1..`` gone, recurrent state as of ``pos0+k``. How that is
achieved depends on the model (KV trim only; recurrent snapshots; checkpoint + replay) and
lives behind this Protocol, so the hot loop has no ``if recurrent`` branches.

Several sequences (slots) share the target context and are verified in one decode, so a
rollback is per sequence and happens in two phases (notes, "several sequences"): every
sequence's :meth:`Rollback.rewind` first (direct snapshot rollbacks apply only to the batch
decoded last, so they must all precede any replay decode), then one :meth:`Rollback.settle`
that restores the checkpoints of the deep rejections and replays them all in one decode.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, Protocol

from shared.protocol import CheckpointMode
from worker.llm import Context

#: Marks the :class:`RollbackStats` counters that add up across generations.
_COUNT: dict[str, Any] = {"count": True}


class RollbackError(RuntimeError):
    """llama.cpp did not roll the state back; continuing would decode from a wrong state."""


@dataclass(frozen=True)
class RollbackStats:
    """What a rollback policy did for one sequence, as :class:`shared.protocol.Telemetry`
    reports it. Policies count for as long as the engine lives: a generation's share is
    ``after - before``, and a lifetime total is the sum of the shares. Counters add up; the
    other fields are the latest state (``a + b`` keeps ``b``'s)."""

    replay_events: int = field(default=0, metadata=_COUNT)
    replay_tokens: int = field(default=0, metadata=_COUNT)
    checkpoint_saves: int = field(default=0, metadata=_COUNT)
    host_fallbacks: int = field(default=0, metadata=_COUNT)
    #: Where the sequence's checkpoints are stored now (None: the policy never checkpoints).
    checkpoint_mode: CheckpointMode | None = None
    host_fallback_reason: str | None = None
    checkpoint_reservation_bytes: int | None = None
    #: Direct rollback snapshots (None: a pure-attention model, trimmed instead).
    rollback_depth: int | None = None
    #: The devices whose share of the sequence's device checkpoint fell back to the host.
    host_fallback_devices: list[str] | None = None

    def _counts(self, other: RollbackStats, sign: int) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) + sign * getattr(other, f.name)
                for f in fields(self) if f.metadata.get("count")}

    def __add__(self, later: RollbackStats) -> RollbackStats:
        return replace(later, **self._counts(later, 1))

    def __sub__(self, before: RollbackStats) -> RollbackStats:
        return replace(self, **self._counts(before, -1))


class Rollback(Protocol):
    """One policy instance per target context, holding per-sequence state."""

    #: Snapshots per sequence the target context must be created with (``n_rs_seq``).
    n_rs_seq: int

    def prepare(self, target: Context, seq: int, n_draft: int) -> None:
        """Called right before the verify decode of a draft of ``n_draft`` tokens of ``seq``."""
        ...

    def rewind(self, target: Context, seq: int, batch: Sequence[int], pos0: int,
               n_accepted: int) -> None:
        """Called after the verify decode when ``n_accepted < len(batch) - 1``: keep
        ``batch[:n_accepted + 1]`` of ``seq`` (at ``pos0..``), drop the rest (now, or at
        :meth:`settle`). Raises :class:`RollbackError` when llama.cpp refuses."""
        ...

    def settle(self, target: Context) -> None:
        """Finish the rewinds of this step that need more than a trim (restore + replay).
        The caller must have read every output row it needs: a replay replaces them."""
        ...

    def release(self, seq: int) -> None:
        """``seq`` is handed to another request: forget its checkpoint."""
        ...

    def telemetry(self, seq: int) -> RollbackStats:
        """What the policy did for ``seq`` so far (since the engine loaded)."""
        ...

    def close(self) -> None:
        """Free what the policy allocated from llama.cpp (the engine calls it on close)."""
        ...
