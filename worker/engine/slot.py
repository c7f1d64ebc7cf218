"""One sequence of the engine's target context and the request it is serving.

The engine runs up to ``slots`` generations at once; each lives in a :class:`Slot` with
everything that is per request: its sequence id, drafter, width policy, sampler, text
stream with stop strings, cancel flag, history and telemetry counters. The engine's step only
sees slots, so one request's state can never leak into another's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from time import perf_counter

from shared.constraint import Constraint
from shared.protocol import (
    FinishReason,
    SamplingParams,
    SpecMethod,
    SpecSettings,
    Telemetry,
    TokenLogprob,
)
from worker.engine.constraint.matcher import CompiledGrammar
from worker.engine.core.constraint import UNCONSTRAINED, SlotConstraint
from worker.engine.core.draft import VerifyOutcome
from worker.engine.core.sampler import Sampler
from worker.engine.core.telemetry import SpecCounters
from worker.engine.drafting.width import BudgetedWidth
from worker.engine.logprobs import LogprobReporter
from worker.engine.proposers.base import Proposer
from worker.engine.proposers.head import Staged
from worker.engine.rollback.base import RollbackStats
from worker.engine.text import TextStream
from worker.llm import Model


@dataclass(frozen=True)
class SlotRequest:
    """What a caller asks one slot to generate (see :meth:`SpeculativeEngine.admit`).

    ``spec`` narrows the engine's capacity (None: ``EngineConfig.request_defaults``; what it
    leaves unset is the engine's); ``sampling`` is the
    target distribution (greedy by default; a seed of None is drawn and reported in the
    result); ``logprobs`` None returns none, ``k`` returns each token's log probability and
    its ``k`` most likely alternatives; ``proposer`` replaces the drafter ``spec`` selects
    (tests drive rollback with an oracle); ``constraint`` masks the target distribution to
    a grammar (``worker/engine/constraint/``): compiled already against the engine's model
    (the serving loop compiles off the engine's thread), or compiled at admission.
    ``log_fields`` go on the
    engine's own log events of this slot (a worker running several jobs at once passes the
    job id, so ``generation.finished`` names the job it belongs to).
    """

    prompt_tokens: Sequence[int]
    max_tokens: int
    spec: SpecSettings | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: Sequence[str] = ()
    proposer: Proposer | None = None
    log_fields: Mapping[str, object] = field(default_factory=dict)
    logprobs: int | None = None
    #: Reuse a cached prefix and leave this request's tokens cached (False: prefill from the
    #: first token, leave nothing behind).
    prefix_cache: bool = True
    constraint: Constraint | CompiledGrammar | None = None


@dataclass
class GenerationResult:
    """``seed``: the one the sampler used (drawn when the request gave none);
    ``logprobs``: one per token when the request asked for them."""

    tokens: list[int]
    text: str
    finish_reason: FinishReason
    telemetry: Telemetry
    seed: int
    logprobs: list[TokenLogprob] = field(default_factory=list)


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
    #: ``proposer`` as the step drives it (:func:`~.proposers.factory.staged`).
    staged: Staged
    #: The request drafts with the engine's draft head, which follows its sequence.
    follows_head: bool
    policy: BudgetedWidth
    sampler: Sampler
    logprobs: LogprobReporter
    stream: TextStream
    counters: SpecCounters
    rollback_before: RollbackStats
    history: list[int]
    #: The grammar the output follows (:data:`UNCONSTRAINED`: none).
    constraint: SlotConstraint = UNCONSTRAINED
    #: Forced tokens at the front of this step's draft (jump-forward).
    forced: int = 0
    generated: list[int] = field(default_factory=list)
    generated_logprobs: list[TokenLogprob] = field(default_factory=list)
    phase: Phase = Phase.PREFILL
    #: Prompt positions the target has decoded (the last prompt token opens the first verify).
    prefilled: int = 0
    cancelled: bool = False
    finish: FinishReason | None = None
    admitted_at: float = field(default_factory=perf_counter)
    ready_at: float = 0.0
    #: What the target's positions hold once the generation has ended on a verify (the
    #: accepted drafts, even those past an ending that commit did not keep).
    kv_at_finish: list[int] | None = None

    def decoded(self) -> list[int]:
        """The tokens the sequence's positions hold now, in order (its prefix-cache entry):
        the prompt prefilled so far while loading, then everything but the last committed
        token (which opens the next verify)."""
        if self.kv_at_finish is not None:
            return self.kv_at_finish
        if self.phase is Phase.PREFILL:
            return self.history[:self.prefilled]
        return self.history[:-1]

    @property
    def to_prefill(self) -> int:
        """Prompt positions still to decode before the slot can verify."""
        return len(self.request.prompt_tokens) - 1 - self.prefilled

    def logprobs_of_last(self, n: int) -> list[TokenLogprob]:
        """The logprobs of the last ``n`` generated tokens (none when not asked for)."""
        return self.generated_logprobs[len(self.generated_logprobs) - n:] if n else []

    def commit(self, outcome: VerifyOutcome, model: Model, n_ctx: int) -> list[int]:
        """Take the verify's accepted drafts and bonus token up to the first ending (end of
        generation, stop string, ``max_tokens``, end of the context, a grammar with nothing
        more to say); returns what was kept
        (their logprobs, when asked for, are the last ones of ``generated_logprobs``)."""
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
        # A grammar with nothing more to say ends the generation; an end token right where
        # it completed (a verify's row after the last draft) is that same ending, and so is
        # the budget or the context running out on the token that completed it: the output
        # is whole (a steered close ends this way), which "length" would deny.
        if self.constraint.commit(outcome.n_accepted, committed):
            self.finish = FinishReason.STOP
        if self.finish is not None:
            self.kv_at_finish = [*self.history, *outcome.accepted]
        self.generated += committed
        self.history += committed
        self.generated_logprobs += outcome.logprobs[: len(committed)]
        return committed


@dataclass(frozen=True)
class SlotUpdate:
    """What one engine step did for one slot.

    ``verified``: the slot took part in this step's verify (``tokens`` may still be empty: an
    end-of-generation token commits nothing). ``logprobs`` match ``tokens`` when the request
    asked for them; ``origin`` says how each was produced (:func:`token_origin`). ``result``
    is set when the slot finished; its sequence is free again from the next
    :meth:`SpeculativeEngine.admit`.
    """

    slot: Slot
    tokens: list[int]
    text: str
    verified: bool
    result: GenerationResult | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    origin: str = ""


def token_origin(committed: int, accepted: int, forced: int) -> str:
    """How each of the ``committed`` tokens of one verify was produced, one
    ``TOKEN_ORIGINS`` letter a token: what :meth:`Slot.commit` kept is a prefix of the
    ``accepted`` drafts (the grammar's ``forced`` run at their front) and the target's own
    token after them."""
    drafted = min(accepted, committed)
    grammar = min(forced, drafted)
    return "f" * grammar + "d" * (drafted - grammar) + "t" * (committed - drafted)
