"""The speculative decoding engine: one resident model, a target context, and the decode loop.

Every step of every generation is the same: ask the width policy how far to draft, let the
proposer draft, verify ``[last, drafts..]`` in one target decode, commit the accepted prefix
plus the bonus token. Plain decoding is that loop with a proposer that never drafts, so
speculation on or off, greedy or sampled, there is one loop to get right.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from time import perf_counter

from shared.logs import get_logger
from shared.protocol import FinishReason, SpecMethod, SpecSettings, Telemetry
from worker.engine.config import EngineConfig, draft_spec, model_spec, target_spec
from worker.engine.draft_length_policy import make_policy
from worker.engine.proposers.base import Proposer
from worker.engine.proposers.factory import (
    make_proposer,
    resolve_engine_method,
    resolve_request_method,
)
from worker.engine.proposers.mtp import MtpProposer
from worker.engine.rollback import make_rollback
from worker.engine.sampling import make_picker
from worker.engine.telemetry import SpecCounters
from worker.engine.text import TextStream
from worker.engine.verify import Verifier
from worker.engine.verify_shape import best_lengths, measure_costs
from worker.llm import Context, Model

log = get_logger("engine")

@dataclass
class GenerationResult:
    tokens: list[int]
    text: str
    finish_reason: FinishReason
    telemetry: Telemetry


def _never() -> bool:
    return False


def _ignore(tokens: list[int], text: str) -> None:
    """Default ``on_tokens``: nobody is streaming."""


class SpeculativeEngine:
    """Loads the model and its contexts once; serves one generation at a time."""

    def __init__(self, config: EngineConfig) -> None:
        if config.n_ctx < 2:
            raise ValueError(f"n_ctx must be at least 2, got {config.n_ctx}")
        self.config = config
        wanted = config.spec.method
        self.model = Model(model_spec(config))
        try:
            self.method = resolve_engine_method(wanted, self.model)
            self.draft_max = config.spec.draft_max if self.method is not SpecMethod.NONE else 0
            self.rollback = make_rollback(self.model, self.draft_max, config.spec.rollback_depth,
                                          config.checkpoint, config.fail_device_checkpoint)
            self.target = Context(self.model,
                                  target_spec(config, self.rollback.n_rs_seq, self.draft_max))
            self.mtp = (MtpProposer(self.model, self.target, draft_spec(config))
                        if self.method is SpecMethod.MTP else None)
            self.verifier = Verifier(self.target, self.rollback, config.n_ctx)
            # Calibration decodes on the target: a failure there must free the model too.
            self.shape = (best_lengths(measure_costs(self.target, self.verifier.batch,
                                                     self.draft_max + 1))
                          if config.calibrate_verify and self.draft_max
                          else list(range(self.draft_max + 1)))
        except BaseException:
            self.close()
            raise
        self._lifetime = SpecCounters(spec_method=str(self.method), draft_max=self.draft_max)
        log.info("engine.loaded", model=config.model_path, method=str(self.method),
                 draft_max=self.draft_max, n_ctx=config.n_ctx,
                 n_rs_seq=self.target.n_rs_seq, rollback=type(self.rollback).__name__,
                 verify_shape=self.shape)

    # -- tokens ----------------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        return self.model.tokenize(text)

    def detokenize(self, tokens: list[int]) -> str:
        return self.model.detokenize(tokens)

    # -- generation ------------------------------------------------------------------------
    def generate(self, prompt_tokens: list[int], max_tokens: int,
                 spec: SpecSettings | None = None, *, temperature: float = 0.0, seed: int = 0,
                 stop: Sequence[str] = (),
                 on_tokens: Callable[[list[int], str], None] | None = None,
                 should_stop: Callable[[], bool] | None = None,
                 proposer: Proposer | None = None) -> GenerationResult:
        """Generate up to ``max_tokens`` after ``prompt_tokens``.

        ``spec`` narrows the engine's capacity for this request (a larger ``draft_max`` is
        clamped to the engine's). ``on_tokens`` receives each step's newly committed tokens
        and their text; ``should_stop`` is polled once per decode step to cancel.
        ``proposer`` replaces the drafter ``spec`` selects (tests drive rollback with an oracle).
        """
        spec = spec or self.config.spec
        method = resolve_request_method(spec.method, self.method)
        if temperature > 0 and method is not SpecMethod.NONE:
            raise ValueError("speculative decoding is greedy-only: use temperature 0, "
                             "or speculation method 'none' to sample")
        self._check_request(prompt_tokens, max_tokens)
        draft_max = min(spec.draft_max, self.draft_max) if method is not SpecMethod.NONE else 0
        counters = SpecCounters(spec_method=str(method), draft_max=draft_max,
                                prompt_tokens=len(prompt_tokens))
        proposer = proposer or make_proposer(method, spec, self.mtp)
        policy = make_policy(draft_max, spec.adaptive, self.shape)
        shape = self.shape
        pick = make_picker(temperature, seed)
        rollback_before = self.rollback.telemetry()
        stream = TextStream(self.model, stop)
        notify = on_tokens or _ignore
        cancelled = should_stop or _never
        history = list(prompt_tokens)
        generated: list[int] = []
        n_ctx = self.config.n_ctx
        finish: FinishReason | None = None
        try:
            t0 = perf_counter()
            self._prefill(history[:-1])
            proposer.start(history)
            t1 = perf_counter()
            while finish is None:
                if cancelled():
                    finish = FinishReason.CANCELLED
                    break
                pos0 = len(history) - 1
                width = shape[min(policy.width(), max_tokens - len(generated) - 1,
                                  n_ctx - pos0 - 1)]
                td = perf_counter()
                draft = proposer.propose(history, width, spec.p_min).tokens
                counters.draft_seconds += perf_counter() - td
                draft = draft[: shape[len(draft)]] if len(draft) >= spec.draft_min else []
                outcome = self.verifier.step(history[-1], draft, pos0, pick, proposer, counters)
                policy.update(len(draft), outcome.n_accepted)
                committed: list[int] = []
                for token in [*outcome.accepted, outcome.bonus]:
                    if self.model.is_eog(token):
                        finish = FinishReason.EOS
                        break
                    committed.append(token)
                    stream.push(token)
                    if stream.stopped:
                        finish = FinishReason.STOP
                    elif len(generated) + len(committed) == max_tokens:
                        finish = FinishReason.LENGTH
                    elif len(history) + len(committed) > n_ctx:
                        finish = FinishReason.CONTEXT
                    if finish is not None:
                        break
                generated += committed
                history += committed
                notify(committed, stream.take(final=finish is not None))
            t2 = perf_counter()
        finally:
            pick.close()
        counters.prefill_seconds = t1 - t0
        counters.wall_seconds = t2 - t1
        counters.generated_tokens = len(generated)
        counters.set_rollback(rollback_before, self.rollback.telemetry())
        self._lifetime.merge(counters)
        telemetry = counters.to_telemetry()
        log.info("generation.finished", finish_reason=str(finish), method=str(method),
                 prompt_tokens=len(prompt_tokens), generated=len(generated),
                 acceptance=round(telemetry.acceptance, 4),
                 tokens_per_verify=round(telemetry.tokens_per_verify, 3),
                 effective_tps=round(telemetry.effective_tokens_per_second, 2),
                 telemetry=telemetry.model_dump(mode="json"))
        return GenerationResult(generated, stream.text, finish, telemetry)

    def telemetry(self) -> Telemetry:
        """Cumulative over every generation this engine has served."""
        return self._lifetime.to_telemetry()

    def close(self) -> None:
        for part in ("verifier", "rollback", "mtp", "target", "model"):
            obj = getattr(self, part, None)
            if obj is not None:
                obj.close()
                setattr(self, part, None)

    # -- internals -------------------------------------------------------------------------
    def _check_request(self, prompt: Sequence[int], max_tokens: int) -> None:
        """Reject what cannot run, at the edge, with a message naming the limit."""
        n_vocab = self.model.n_vocab
        if not prompt:
            raise ValueError("the prompt is empty")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        if len(prompt) >= self.config.n_ctx:
            raise ValueError(f"the prompt has {len(prompt)} tokens; the context holds "
                             f"{self.config.n_ctx} (prompt + at least one generated token)")
        bad = next((t for t in prompt if not 0 <= t < n_vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token {bad} is outside the vocabulary (0..{n_vocab - 1})")

    def _prefill(self, tokens: list[int]) -> None:
        """Decode all prompt tokens but the last (which opens the first verify), no logits."""
        self.target.clear()
        if tokens:
            self.target.decode(self.verifier.batch.set(tokens, 0, False))

    def __enter__(self) -> SpeculativeEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
