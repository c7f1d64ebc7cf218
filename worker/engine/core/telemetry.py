"""Counters of what speculation did and bought, turned into :class:`Telemetry`.

One :class:`SpecCounters` per generation; the engine merges each into a lifetime total, and
both render through the same :meth:`SpecCounters.to_telemetry`, so per-request and cumulative
figures can never be computed two different ways. Every field declares how two generations
combine (:func:`count`, :func:`peak`, :func:`latest`, or ``+`` for the rollback share), and
:meth:`SpecCounters.merge` follows only those declarations: a field without one fails at
import, so no counter can be silently left out of a lifetime total.

Adding a counter (e.g. ``cached_tokens``) takes two declarations, one on each side of the wire:

1. ``shared/protocol.py``: a :class:`Telemetry` field marked
   ``Annotated[int, Summed("<prometheus series>", "<what it counts>")] = 0``. The worker's
   Prometheus metrics make its series and the log monitor sums it from that mark alone.
2. here: ``cached_tokens: int = count()`` on :class:`SpecCounters` (or a counted field of
   :class:`RollbackStats` for what a rollback policy counts); the engine advances it,
   ``merge`` and ``to_telemetry`` carry it by name.

Then add its line to docs/telemetry.md. ``tests/test_telemetry_paths.py`` fails, naming the
field, when a summed Telemetry field has no source here or no Prometheus series.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from shared.protocol import SpecMethod, Telemetry
from worker.engine.rollback.base import RollbackStats

_MERGE = "merge"
#: Marks the fields Telemetry carries by name as a ``Summed`` field.
_SUMMED = "summed"


def _add_lists(into: list[int], other: list[int]) -> list[int]:
    """Position-wise sum (the longer list's tail kept)."""
    longer, shorter = (into, other) if len(into) >= len(other) else (other, into)
    return [v + (shorter[i] if i < len(shorter) else 0) for i, v in enumerate(longer)]


def count() -> Any:
    """A number that adds up over generations (tokens, decodes, seconds)."""
    return field(default=0, metadata={_MERGE: operator.add, _SUMMED: True})


def positions() -> Any:
    """A per-draft-position list, summed position by position."""
    return field(default_factory=list, metadata={_MERGE: _add_lists, _SUMMED: True})


def peak(default: int = 0) -> Any:
    """A setting that a total reports at its largest (the widest draft any generation ran)."""
    return field(default=default, metadata={_MERGE: max})


def latest(default: Any) -> Any:
    """State that a total reports as the latest generation's."""
    return field(default=default, metadata={_MERGE: lambda _old, new: new})


def _count_positions(into: list[int], n: int) -> None:
    """Count one at each of the first ``n`` positions (per verify: no throwaway lists)."""
    if len(into) < n:
        into.extend([0] * (n - len(into)))
    for i in range(n):
        into[i] += 1


@dataclass
class SpecCounters:
    """Raw counts and seconds; every rate is derived only when rendering."""

    spec_method: SpecMethod = latest(SpecMethod.NONE)
    draft_max: int = peak()
    #: The engine decodes width-invariantly (``EngineConfig.deterministic``).
    deterministic: bool = latest(False)
    prompt_tokens: int = count()
    #: Prompt positions the prefix cache kept (``worker/engine/prefix_cache.py``), whether the
    #: placement reused a prefix, and how (a checkpoint restored); checkpoints saved.
    cached_tokens: int = count()
    prefix_hits: int = count()
    prefix_misses: int = count()
    prefix_restores: int = count()
    prefix_checkpoint_saves: int = count()
    generated_tokens: int = count()
    #: Target verify decodes (a width-0 step is a verify of one row: a plain decode).
    target_decodes: int = count()
    #: Verify decodes that carried at least one drafted token.
    drafts: int = count()
    drafted: int = count()
    accepted: int = count()
    drafted_per_position: list[int] = positions()
    accepted_per_position: list[int] = positions()
    prefill_seconds: float = count()
    draft_seconds: float = count()
    decode_seconds: float = count()
    #: Wall time of the decode loop (after prefill): drafting, verifying and bookkeeping.
    wall_seconds: float = count()
    #: This generation's share of its steps' host time (step wall minus target decode).
    host_seconds: float = count()
    #: Under a constraint (``worker/engine/constraint/``): tokens committed, forced tokens
    #: (jump-forward drafts) accepted, drafted tokens cut because the constraint forbids them,
    #: seconds spent on masks, draft checks and the matcher's bookkeeping, and whether the
    #: budget steered the output to its close (1 a generation).
    constrained_tokens: int = count()
    forced_tokens: int = count()
    mask_cut_drafts: int = count()
    mask_seconds: float = count()
    grammar_forced_closes: int = count()
    #: Rows the verifier added to this slot's verifies to reach a replayable row count
    #: (``worker/engine/drafting/buckets.py``).
    padded_rows: int = count()
    rollback: RollbackStats = field(default_factory=RollbackStats,
                                    metadata={_MERGE: operator.add})

    def record_verify(self, drafted: int, accepted: int) -> None:
        """One verify decode of ``drafted`` drafts of which the first ``accepted`` matched."""
        self.target_decodes += 1
        if not drafted:
            return
        self.drafts += 1
        self.drafted += drafted
        self.accepted += accepted
        _count_positions(self.drafted_per_position, drafted)
        _count_positions(self.accepted_per_position, accepted)

    def set_rollback(self, before: RollbackStats, after: RollbackStats) -> None:
        """Rollback counters live as long as the engine; keep this generation's share."""
        self.rollback = after - before

    def merge(self, other: SpecCounters) -> None:
        """Fold one generation into a lifetime total, each field by its declared rule."""
        for name, rule in _RULES.items():
            setattr(self, name, rule(getattr(self, name), getattr(other, name)))

    def to_telemetry(self) -> Telemetry:
        def ratio(a: float, b: float) -> float:
            return a / b if b > 0 else 0.0

        return Telemetry(
            **{name: getattr(self, name) for name in SUMMED_FIELDS},
            spec_method=self.spec_method,
            draft_max=self.draft_max,
            deterministic=self.deterministic,
            acceptance=ratio(self.accepted, self.drafted),
            mean_accepted_length=ratio(self.accepted, self.drafts),
            # vLLM's definition: the bonus token counts, so a draft-carrying verify yields 1 + k.
            mean_acceptance_length=1.0 + ratio(self.accepted, self.drafts) if self.drafts else 0.0,
            tokens_per_verify=ratio(self.generated_tokens, self.target_decodes),
            draft_seconds_per_token=ratio(self.draft_seconds, self.generated_tokens),
            host_seconds_per_token=ratio(self.host_seconds, self.generated_tokens),
            tokens_per_second=ratio(self.generated_tokens, self.decode_seconds),
            effective_tokens_per_second=ratio(self.generated_tokens, self.wall_seconds),
            # RollbackStats' fields are Telemetry's: a field only one of them has fails here.
            **asdict(self.rollback),
        )


def merge_rules(counters: type) -> dict[str, Callable[[Any, Any], Any]]:
    """Each field's declared rule; a field without one is a programming error, said now."""
    rules: dict[str, Callable[[Any, Any], Any]] = {}
    for f in fields(counters):
        if _MERGE not in f.metadata:
            raise TypeError(f"{counters.__name__}.{f.name} declares no merge rule: declare it "
                            "with count(), positions(), peak() or latest()")
        rules[f.name] = f.metadata[_MERGE]
    return rules


_RULES = merge_rules(SpecCounters)
#: The counters that Telemetry carries under the same name, each a ``Summed`` field there.
SUMMED_FIELDS = tuple(f.name for f in fields(SpecCounters) if f.metadata.get(_SUMMED))
