"""One sequence of the engine's target context and the request it is serving.

The engine runs up to ``slots`` generations at once; each lives in a :class:`Slot` with
everything that is per request: its sequence id, drafter, width policy, token picker, text
stream with stop strings, cancel flag, history and telemetry counters. The engine's step only
sees slots, so one request's state can never leak into another's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from time import perf_counter

from shared.protocol import FinishReason, SpecMethod, SpecSettings, Telemetry
from worker.engine.draft_length_policy import DraftLengthPolicy
from worker.engine.proposers.base import Proposer, VerifyOutcome
from worker.engine.rollback.base import RollbackStats
from worker.engine.sampling import TokenPicker
from worker.engine.telemetry import SpecCounters
from worker.engine.text import TextStream
from worker.llm import Model


@dataclass(frozen=True)
class SlotRequest:
    """What a caller asks one slot to generate (see :meth:`SpeculativeEngine.admit`).

    ``spec`` narrows the engine's capacity (None: the engine's own); ``proposer`` replaces the
    drafter ``spec`` selects (tests drive rollback with an oracle). ``log_fields`` go on the
    engine's own log events of this slot (a worker running several jobs at once passes the
    job id, so ``generation.finished`` names the job it belongs to).
    """

    prompt_tokens: Sequence[int]
    max_tokens: int
    spec: SpecSettings | None = None
    temperature: float = 0.0
    seed: int = 0
    stop: Sequence[str] = ()
    proposer: Proposer | None = None
    log_fields: Mapping[str, object] = field(default_factory=dict)


@dataclass
class GenerationResult:
    tokens: list[int]
    text: str
    finish_reason: FinishReason
    telemetry: Telemetry


class Phase(Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"


@dataclass
class Slot:
    """A request being served in sequence ``seq``. Fields are the engine's to change."""

    seq: int
    request: SlotRequest
    method: SpecMethod
    spec: SpecSettings
    draft_max: int
    proposer: Proposer
    policy: DraftLengthPolicy
    pick: TokenPicker
    stream: TextStream
    counters: SpecCounters
    rollback_before: RollbackStats
    history: list[int]
    generated: list[int] = field(default_factory=list)
    phase: Phase = Phase.PREFILL
    #: Prompt positions the target has decoded (the last prompt token opens the first verify).
    prefilled: int = 0
    cancelled: bool = False
    finish: FinishReason | None = None
    admitted_at: float = field(default_factory=perf_counter)
    ready_at: float = 0.0

    @property
    def to_prefill(self) -> int:
        """Prompt positions still to decode before the slot can verify."""
        return len(self.request.prompt_tokens) - 1 - self.prefilled

    def commit(self, outcome: VerifyOutcome, model: Model, n_ctx: int) -> list[int]:
        """Take the verify's accepted drafts and bonus token up to the first ending (end of
        generation, stop string, ``max_tokens``, end of the context); returns what was kept."""
        committed: list[int] = []
        for token in [*outcome.accepted, outcome.bonus]:
            if model.is_eog(token):
                self.finish = FinishReason.EOS
                break
            committed.append(token)
            self.stream.push(token)
            if self.stream.stopped:
                self.finish = FinishReason.STOP
            elif len(self.generated) + len(committed) == self.request.max_tokens:
                self.finish = FinishReason.LENGTH
            elif len(self.history) + len(committed) > n_ctx:
                self.finish = FinishReason.CONTEXT
            if self.finish is not None:
                break
        self.generated += committed
        self.history += committed
        return committed


@dataclass(frozen=True)
class SlotUpdate:
    """What one engine step did for one slot.

    ``verified``: the slot took part in this step's verify (``tokens`` may still be empty: an
    end-of-generation token commits nothing). ``result`` is set when the slot finished; its
    sequence is free again from the next :meth:`SpeculativeEngine.admit`.
    """

    slot: Slot
    tokens: list[int]
    text: str
    verified: bool
    result: GenerationResult | None = None
