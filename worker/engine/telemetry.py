"""Counters of what speculation did and bought, turned into :class:`Telemetry`.

One :class:`SpecCounters` per generation; the engine merges each into a lifetime total, and
both render through the same :meth:`SpecCounters.to_telemetry`, so per-request and cumulative
figures can never be computed two different ways.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from shared.protocol import SpecMethod, Telemetry
from worker.engine.rollback.base import RollbackStats


def _add_lists(into: list[int], other: list[int]) -> None:
    into.extend([0] * (len(other) - len(into)))
    for i, v in enumerate(other):
        into[i] += v


def _count_positions(into: list[int], n: int) -> None:
    """Count one at each of the first ``n`` positions (per verify: no throwaway lists)."""
    if len(into) < n:
        into.extend([0] * (n - len(into)))
    for i in range(n):
        into[i] += 1


@dataclass
class SpecCounters:
    """Raw counts and seconds; every rate is derived only when rendering."""

    spec_method: SpecMethod = SpecMethod.NONE
    draft_max: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    #: Target verify decodes (a width-0 step is a verify of one row: a plain decode).
    target_decodes: int = 0
    #: Verify decodes that carried at least one drafted token.
    drafts: int = 0
    drafted: int = 0
    accepted: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    decode_seconds: float = 0.0
    #: Wall time of the decode loop (after prefill): drafting, verifying and bookkeeping.
    wall_seconds: float = 0.0
    rollback: RollbackStats = field(default_factory=RollbackStats)

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
        """Fold one generation into a lifetime total."""
        self.spec_method = other.spec_method
        self.draft_max = max(self.draft_max, other.draft_max)
        for name in ("prompt_tokens", "generated_tokens", "target_decodes", "drafts",
                     "drafted", "accepted", "prefill_seconds", "draft_seconds",
                     "decode_seconds", "wall_seconds"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        _add_lists(self.drafted_per_position, other.drafted_per_position)
        _add_lists(self.accepted_per_position, other.accepted_per_position)
        self.rollback = self.rollback + other.rollback

    def to_telemetry(self) -> Telemetry:
        def ratio(a: float, b: float) -> float:
            return a / b if b > 0 else 0.0

        return Telemetry(
            spec_method=self.spec_method,
            draft_max=self.draft_max,
            drafts=self.drafts,
            drafted=self.drafted,
            accepted=self.accepted,
            acceptance=ratio(self.accepted, self.drafted),
            accepted_per_position=list(self.accepted_per_position),
            drafted_per_position=list(self.drafted_per_position),
            mean_accepted_length=ratio(self.accepted, self.drafts),
            # vLLM's definition: the bonus token counts, so a draft-carrying verify yields 1 + k.
            mean_acceptance_length=1.0 + ratio(self.accepted, self.drafts) if self.drafts else 0.0,
            target_decodes=self.target_decodes,
            tokens_per_verify=ratio(self.generated_tokens, self.target_decodes),
            draft_seconds=self.draft_seconds,
            draft_seconds_per_token=ratio(self.draft_seconds, self.generated_tokens),
            decode_seconds=self.decode_seconds,
            prefill_seconds=self.prefill_seconds,
            wall_seconds=self.wall_seconds,
            tokens_per_second=ratio(self.generated_tokens, self.decode_seconds),
            effective_tokens_per_second=ratio(self.generated_tokens, self.wall_seconds),
            generated_tokens=self.generated_tokens,
            prompt_tokens=self.prompt_tokens,
            # RollbackStats' fields are Telemetry's: a field only one of them has fails here.
            **asdict(self.rollback),
        )
