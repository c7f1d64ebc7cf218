"""The rollback seam between the verify loop and the target context's memory.

The verify loop decodes ``[last, d1..dn]`` at positions ``pos0..pos0+n`` and accepts ``k``
drafts. The target must then look exactly as if it had decoded only ``[last, d1..dk]``:
positions ``pos0+k+1..`` gone, recurrent state as of ``pos0+k``. How that is achieved depends on
the model (KV trim only; recurrent snapshots; checkpoint + replay) and lives behind this
Protocol, so the hot loop has no ``if recurrent`` branches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from worker.llm import Context


class RollbackError(RuntimeError):
    """llama.cpp did not roll the state back; continuing would decode from a wrong state."""


class Rollback(Protocol):
    """One policy instance per target context."""

    #: Snapshots per sequence the target context must be created with (``n_rs_seq``).
    n_rs_seq: int

    def prepare(self, target: Context, n_draft: int) -> None:
        """Called right before the verify decode of a draft of ``n_draft`` tokens."""
        ...

    def rewind(self, target: Context, batch: Sequence[int], pos0: int, n_accepted: int) -> None:
        """Called after the verify decode when ``n_accepted < len(batch) - 1``: keep
        ``batch[:n_accepted + 1]`` (at ``pos0..``), drop the rest. Raises :class:`RollbackError`
        when llama.cpp refuses."""
        ...

    def telemetry(self) -> dict[str, object]:
        """Counters for :class:`shared.protocol.Telemetry` (replay_events, replay_tokens,
        checkpoint_mode, checkpoint_saves, host_fallbacks, rollback_depth)."""
        ...

    def close(self) -> None:
        """Free what the policy allocated from llama.cpp (the engine calls it on close)."""
        ...
