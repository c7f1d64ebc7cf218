"""The speculative decoding engine: one resident model, a target context of S sequences, and
the step loop that serves them all.

Every step of every generation is the same: ask each slot's width policy how far to draft, let
its proposer draft (the slots that use the engine's draft head together, in batched draft
decodes), verify every slot's
``[last, drafts..]`` in ONE target decode (with the next slices of prompts still loading),
then accept, commit, stream and roll back per slot. Plain decoding is that loop with a
proposer that never drafts, and :meth:`SpeculativeEngine.generate` is one slot stepped until
it is done, so speculation on or off, greedy or sampled, one slot or eight, there is one loop
to get right.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import ExitStack
from time import perf_counter

from shared.admission import vocabulary_refusal
from shared.capacity import within_capacity
from shared.constraint import Constraint
from shared.logs import get_logger
from shared.protocol import FinishReason, SamplingParams, SpecMethod, SpecSettings, Telemetry
from worker.engine.config import (
    PREFILL_CHUNK,
    EngineConfig,
    draft_spec,
    model_spec,
    target_spec,
)
from worker.engine.constraint.matcher import bind
from worker.engine.core.constraint import UNCONSTRAINED
from worker.engine.core.draft import Draft
from worker.engine.core.telemetry import SpecCounters
from worker.engine.drafting.cache import curve_for
from worker.engine.drafting.planner import DraftPlanner, Proposed, StepRecord, Verified
from worker.engine.logprobs import make_logprobs
from worker.engine.overlap import HostWork, make_overlap, no_work
from worker.engine.plan import ModelFacts, plan_engine
from worker.engine.prefix_cache import Placement, PrefixStats, make_prefix_policy
from worker.engine.proposers.base import Proposer
from worker.engine.proposers.factory import (
    make_head,
    make_proposer,
    make_suffix_shared,
    staged,
    uses_suffix,
)
from worker.engine.sampling import make_sampler, verifies_on_device
from worker.engine.slot import (
    GenerationResult,
    Phase,
    Slot,
    SlotRequest,
    SlotUpdate,
    token_origin,
)
from worker.engine.text import TextStream
from worker.engine.verify import PrefillChunk, Verifier, VerifyJob
from worker.llm import Context, Model

__all__ = ["EngineConfig", "GenerationResult", "NoFreeSlotError", "SlotRequest", "SlotUpdate",
           "SpeculativeEngine"]

log = get_logger("engine")


class NoFreeSlotError(RuntimeError):
    """:meth:`SpeculativeEngine.admit` was called while every slot is busy."""


def _never() -> bool:
    return False


def _ignore(tokens: list[int], text: str) -> None:
    """Default ``on_tokens``: nobody is streaming."""


def _charge_host(steps: list[tuple[Slot, list[int]]], seconds: float, tokens: int) -> None:
    """A step's host time (its wall time so far minus the target's decode), shared by its
    decoding slots in proportion to the tokens each committed (evenly when none did)."""
    if not steps or seconds <= 0.0:
        return
    for slot, committed in steps:
        share = len(committed) / tokens if tokens else 1 / len(steps)
        slot.counters.host_seconds += seconds * share


class SpeculativeEngine:
    """Loads the model and its contexts once; serves up to ``config.slots`` generations at a
    time through :meth:`admit` / :meth:`step` / :meth:`cancel`, or one with :meth:`generate`."""

    def __init__(self, config: EngineConfig) -> None:
        if config.n_ctx < 2:
            raise ValueError(f"n_ctx must be at least 2, got {config.n_ctx}")
        if config.slots < 1:
            raise ValueError(f"slots must be at least 1, got {config.slots}")
        self.config = config
        self._slots: dict[int, Slot] = {}
        #: What the engine allocated from llama.cpp, freed newest first by :meth:`close`.
        self._allocated = ExitStack()
        self.model = Model(model_spec(config))
        self._allocated.callback(self.model.close)
        try:
            #: Every load-time decision (method, N, rollback, checkpoints), made once.
            self.plan = plan_engine(config, ModelFacts.of(self.model))
            self.method = self.plan.method
            self.draft_max = self.plan.draft_max
            self.rollback = self.plan.rollback_policy(config.fail_device_checkpoint)
            self._allocated.callback(self.rollback.close)
            spec = target_spec(config, self.plan.n_rs_seq, self.draft_max,
                               self.plan.device_verify)
            self.target = Context(self.model, spec)
            self._allocated.callback(self.target.close)
            #: Which sequence a request runs in and what of an earlier one it keeps.
            self.prefix = make_prefix_policy(config.prefix_cache, self.model, self.target,
                                             config.slots, config.prefix_checkpoints)
            #: Drafter state that follows the target (the MTP head's draft context), or none.
            self.head = make_head(self.plan.mtp, self.model, self.target,
                                  draft_spec(config, self.draft_max))
            self._allocated.callback(self.head.close)
            #: How verify steps are padded to shapes a GPU replays, and plans priced.
            buckets = self.plan.buckets(config.n_ctx)
            self.verifier = Verifier(self.target, self.rollback, spec.n_batch, buckets,
                                     make_overlap(self.plan.overlap))
            self._allocated.callback(self.verifier.close)
            # Calibration decodes on the target: a failure there must free the model too.
            replays = self.model.offloaded  # plain steps replay a graph on a GPU
            #: What a verify of r rows costs here (None: nothing this engine decides prices
            #: rows), timed once or read from the worker's cache.
            self.curve = (config.row_costs or curve_for(self.target, self.verifier.batch, spec,
                                                        replays, config.cost_cache)
                          if self._prices_rows(config) else None)
            #: How far every slot drafts each step (``drafting/planner.py``).
            self.planner = DraftPlanner(self.curve, config.slots, self.draft_max, replays,
                                        budget=config.row_budget,
                                        shape=config.calibrate_verify, buckets=buckets)
            self.suffix = make_suffix_shared(self.method, self.target,
                                             config.lookup_cache_bytes, self.planner.bar,
                                             self.planner.one_slot)
        except BaseException:
            self.close()
            raise
        self._lifetime = SpecCounters(spec_method=self.method, draft_max=self.draft_max,
                                      deterministic=config.deterministic)
        #: Seconds the steps' target decodes took (synchronised, prefill chunks included):
        #: the rest of a step's wall time is host work (bench/slots.py: host ms a token).
        self.decode_seconds = 0.0
        log.info("engine.loaded", model=config.model_path, method=str(self.method),
                 draft_max=self.draft_max, n_ctx=config.n_ctx, slots=config.slots,
                 n_rs_seq=self.target.n_rs_seq, rollback=type(self.rollback).__name__,
                 verify_shape=self.planner.shape, deterministic=config.deterministic,
                 offloaded=self.model.offloaded, verify_buckets=self.plan.verify_buckets,
                 row_costs=self.suffix.costs.relative() if self.suffix else None)

    def _prices_rows(self, config: EngineConfig) -> bool:
        """Something this engine decides prices verify rows: the suffix drafter's lengths,
        the row budget of several slots, or the verify shape."""
        return self.draft_max > 0 and (uses_suffix(self.method) or config.calibrate_verify
                                       or (config.row_budget and config.slots > 1))

    # -- tokens ----------------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        return self.model.tokenize(text)

    def detokenize(self, tokens: list[int]) -> str:
        return self.model.detokenize(tokens)

    # -- slots -----------------------------------------------------------------------------
    @property
    def active(self) -> list[Slot]:
        """Slots serving a request, in admission order."""
        return list(self._slots.values())

    @property
    def free_slots(self) -> int:
        return self.config.slots - len(self._slots)

    def admit(self, request: SlotRequest) -> Slot:
        """Start ``request`` in a free slot; it is prefilled and decoded by the next steps.

        Bad requests (empty or out-of-vocabulary prompt, a ``logit_bias`` id outside the
        vocabulary, ``max_tokens < 1``, a prompt that leaves no room in the per-slot context,
        a method the engine was not loaded for) are a ``ValueError`` here, before anything is
        allocated.
        """
        # Narrowed to what the engine was loaded for, unset fields the engine's: the rule of
        # shared/capacity.py, applied here once for the worker as at submit for the fleet.
        spec = within_capacity(request.spec or self.config.request_defaults,
                               self.plan.capacity())
        method = spec.method
        self._check_request(request)
        free = [s for s in range(self.config.slots) if s not in self._slots]
        if not free:
            raise NoFreeSlotError(f"all {self.config.slots} slots are busy")
        draft_max = min(spec.draft_max, self.draft_max) if method is not SpecMethod.NONE else 0
        counters = SpecCounters(spec_method=method, draft_max=draft_max,
                                deterministic=self.config.deterministic,
                                prompt_tokens=len(request.prompt_tokens))
        # Compiled against this vocabulary before anything is placed (the serving loop has
        # compiled it already, off this thread): a ConstraintError.
        constraint = bind(request.constraint, self.model, counters, request.max_tokens)
        follows = self.head.follows(method)
        placement = self.prefix.place(request.prompt_tokens, free, follows,
                                      request.prefix_cache)
        reused = self.prefix.apply(placement, self.target, self.head, follows)
        seq = placement.seq
        history = list(request.prompt_tokens)
        on_device = self.plan.device_verify and verifies_on_device(
            request.sampling, request.logprobs, constraint is not UNCONSTRAINED, follows,
            history)
        on_device = self.target.sample_on_device(seq, on_device)
        sampler = make_sampler(request.sampling, len(request.prompt_tokens), on_device)
        proposer = request.proposer or make_proposer(
            method, spec, self.head.proposer(seq, sampler, constraint), self.suffix)
        slot = Slot(
            seq=seq, request=request, method=method, spec=spec, draft_max=draft_max,
            proposer=proposer, staged=staged(proposer), follows_head=follows,
            # Which positions the head drafts decides a sampled request's tokens (its drafts
            # are draws): its drafter is asked at every step, never skipped for a while.
            policy=self.planner.policy(draft_max, spec.adaptive,
                                       idle_skips=request.sampling.greedy or not follows),
            sampler=sampler, logprobs=make_logprobs(self.model, request.logprobs),
            stream=TextStream(self.model, request.stop),
            counters=counters,
            rollback_before=self.rollback.telemetry(seq),
            history=history,
            constraint=constraint,
            prefilled=placement.keep,
        )
        self._count_reuse(slot, placement, reused)
        self._slots[seq] = slot
        log.debug("slot.admitted", seq=seq, prompt_tokens=len(request.prompt_tokens),
                  method=str(method), cached_tokens=placement.keep)
        return slot

    def cancel(self, slot: Slot) -> None:
        """Stop ``slot`` at the next step (its result says ``cancelled``); others run on."""
        slot.cancelled = True

    @property
    def overlaps(self) -> bool:
        """Whether :meth:`step`'s ``during`` runs while the device decodes (a GPU), so host
        work handed to it costs the step nothing; else it runs after the decode."""
        return self.plan.overlap

    def step(self, during: HostWork = no_work) -> list[SlotUpdate]:
        """One engine step over every active slot: draft, one target decode (verifies plus
        prefill chunks), accept, commit, roll back. Returns an update for every slot that
        verified or finished. ``during``: host work that does not need this step's outputs
        (the serving loop's token events), run while the device decodes where it can
        (:attr:`overlaps`), else after the decode; it must not raise. If the step raises,
        every active slot has been dropped (their sequences are free again) and the caller
        decides what happens to their requests."""
        try:
            return self._step(during)
        except BaseException:
            for slot in self.active:
                self._release(slot, keep=False)  # its state is not to be trusted
            raise

    def generate(self, prompt_tokens: list[int], max_tokens: int,
                 spec: SpecSettings | None = None, *, sampling: SamplingParams | None = None,
                 logprobs: int | None = None, stop: Sequence[str] = (),
                 on_tokens: Callable[[list[int], str], None] | None = None,
                 should_stop: Callable[[], bool] | None = None,
                 proposer: Proposer | None = None,
                 constraint: Constraint | None = None) -> GenerationResult:
        """Generate up to ``max_tokens`` after ``prompt_tokens``: one slot, stepped to the end.

        ``spec`` narrows the engine's capacity for this request (None: the config's
        ``request_defaults``; unset fields and a larger ``draft_max`` are the engine's);
        ``sampling`` is the target distribution (None: greedy) and ``logprobs`` asks for each
        token's log probability and that many alternatives (see :class:`SlotRequest`).
        ``on_tokens`` receives each step's newly committed tokens
        and their text; ``should_stop`` is polled once per decode step to cancel.
        ``proposer`` replaces the drafter ``spec`` selects (tests drive rollback with an oracle);
        ``constraint`` masks the output to a grammar (:class:`SlotRequest`).
        Other slots admitted meanwhile are stepped along with it (their updates are dropped:
        callers that share an engine drive :meth:`step` themselves).
        """
        slot = self.admit(SlotRequest(prompt_tokens, max_tokens, spec,
                                      sampling or SamplingParams(), stop, proposer,
                                      logprobs=logprobs, constraint=constraint))
        notify = on_tokens or _ignore
        cancelled = should_stop or _never
        while True:
            if slot.phase is Phase.DECODE and cancelled():
                self.cancel(slot)
            for update in self.step():
                if update.slot is not slot:
                    continue
                if update.verified:
                    notify(update.tokens, update.text)
                if update.result is not None:
                    return update.result

    def telemetry(self) -> Telemetry:
        """Cumulative over every generation this engine has served."""
        return self._lifetime.to_telemetry()

    def close(self) -> None:
        """Free every llama.cpp allocation, newest first; a second call does nothing. Slots
        still active are dropped with their sequences' memory: a closed engine serves none."""
        self._slots.clear()
        self._allocated.close()

    # -- internals -------------------------------------------------------------------------
    def _check_request(self, request: SlotRequest) -> None:
        """Reject what cannot run, at the edge, with a message naming the limit. The service
        refuses out-of-vocabulary ids before they reach a worker (``shared.admission``); an
        engine driven directly checks them here too, since a bias id past the vocabulary
        would be gathered out of bounds on the device (``device_sampling._adjusted``)."""
        prompt, max_tokens = request.prompt_tokens, request.max_tokens
        n_vocab = self.model.n_vocab
        if not prompt:
            raise ValueError("the prompt is empty")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        if len(prompt) >= self.config.n_ctx:
            raise ValueError(f"the prompt has {len(prompt)} tokens; the context holds "
                             f"{self.config.n_ctx} (prompt + at least one generated token)")
        refusal = vocabulary_refusal(request, n_vocab)
        if refusal is not None:
            field, why = refusal
            raise ValueError(f"{field}: {why}")

    def _step(self, during: HostWork) -> list[SlotUpdate]:
        started = perf_counter()
        updates = [self._finish(s, FinishReason.CANCELLED, verified=False)
                   for s in self.active if s.cancelled]
        decoding = [s for s in self.active if s.phase is Phase.DECODE]
        chunks = self._chunks([s for s in self.active if s.phase is Phase.PREFILL])
        drafts = self.planner.plan([Proposed(d, s.forced, s.counters, s.method, s.policy)
                                    for s, d in zip(decoding, self._draft(decoding),
                                                    strict=True)])
        jobs = [VerifyJob(s.seq, s.history[-1], d, len(s.history) - 1, s.sampler, s.proposer,
                          s.history, s.logprobs, s.constraint)
                for s, d in zip(decoding, drafts, strict=True)]
        if not jobs and not chunks:
            during()
            return updates
        outcomes, times = self.verifier.step(chunks, jobs, self._prefilled, during)
        self.decode_seconds += times.decode
        steps: list[tuple[Slot, list[int]]] = []
        origins: dict[int, str] = {}
        for slot, draft, outcome, pad in zip(decoding, drafts, outcomes, times.padded,
                                             strict=True):
            c = slot.counters
            c.draft_seconds += times.observe
            c.decode_seconds += times.target
            c.record_verify(len(draft.tokens), outcome.n_accepted)
            c.padded_rows += pad
            committed = slot.commit(outcome, self.model, self.config.n_ctx)
            steps.append((slot, committed))
            origins[slot.seq] = token_origin(len(committed), outcome.n_accepted, slot.forced)
        committed_tokens = sum(len(committed) for _, committed in steps)
        _charge_host(steps, perf_counter() - started - times.decode, committed_tokens)
        for slot, committed in steps:
            if slot.finish is not None:
                updates.append(self._finish(slot, slot.finish, committed, origin=origins[slot.seq]))
            else:
                updates.append(SlotUpdate(slot, committed, slot.stream.take(final=False), True,
                                          logprobs=slot.logprobs_of_last(len(committed)),
                                          origin=origins[slot.seq]))
        self.planner.observe(StepRecord(
            sum(len(d.tokens) + 1 for d in drafts), times.decode,
            [Verified(s.policy, len(d.tokens), o.n_accepted, s.forced)
             for s, d, o in zip(decoding, drafts, outcomes, strict=True)],
            committed_tokens, perf_counter() - started, prefilled=bool(chunks)))
        return updates

    def _chunks(self, loading: list[Slot]) -> list[PrefillChunk]:
        """This step's prompt slices: up to :data:`PREFILL_CHUNK` tokens, oldest slot first.
        A slot with nothing left to prefill (a one-token prompt) just starts decoding."""
        budget = PREFILL_CHUNK
        chunks: list[PrefillChunk] = []
        for slot in loading:
            if slot.to_prefill == 0:
                self._start_decoding(slot)
                continue
            n = min(budget, slot.to_prefill)
            if n == 0:
                continue
            start = slot.prefilled
            chunks.append(PrefillChunk(slot.seq, slot.history[start:start + n], start))
            budget -= n
        return chunks

    def _prefilled(self, chunk: PrefillChunk, row0: int) -> None:
        """A chunk was decoded (its hidden rows are still in the target's outputs): feed the
        draft head, checkpoint the prefix where one is due."""
        slot = self._slots[chunk.seq]
        hidden = (self.head.on_prefill(chunk.seq, chunk.tokens, chunk.pos0, row0)
                  if slot.follows_head else None)
        slot.prefilled += len(chunk.tokens)
        if slot.request.prefix_cache and self.prefix.prefilled(
                self.target, chunk.seq, slot.prefilled, slot.to_prefill == 0, hidden):
            slot.counters.prefix_checkpoint_saves += 1
        if slot.to_prefill == 0:
            self._start_decoding(slot)

    def _count_reuse(self, slot: Slot, placement: Placement, reused: PrefixStats) -> None:
        """What the placement kept, in the slot's telemetry and the log."""
        c = slot.counters
        c.cached_tokens = reused.cached_tokens
        c.prefix_hits = reused.hits
        c.prefix_misses = reused.misses
        c.prefix_restores = reused.restores
        if reused.hits:
            log.info("prefix.reused", **slot.request.log_fields, seq=slot.seq,
                     source=placement.source, cached_tokens=reused.cached_tokens,
                     prompt_tokens=len(slot.request.prompt_tokens),
                     prefill_tokens=slot.to_prefill + 1)

    def _start_decoding(self, slot: Slot) -> None:
        slot.proposer.start(slot.history)
        slot.phase = Phase.DECODE
        slot.ready_at = perf_counter()

    def _draft(self, slots: list[Slot]) -> list[Draft]:
        """Every decoding slot's draft for this step: each slot's staged draft first, then
        the draft head once for every slot that asked for it (each of those is charged the
        head's whole time: it waited for all of it), and each of those chooses."""
        widths = [self._width(s) for s in slots]
        drafts: list[Draft] = []
        asking: list[int] = []
        for i, (slot, width) in enumerate(zip(slots, widths, strict=True)):
            t0 = perf_counter()
            draft, needs_head = slot.staged.stage(slot.history, width, slot.spec.p_min)
            slot.counters.draft_seconds += perf_counter() - t0
            drafts.append(draft)
            if needs_head:
                asking.append(i)
        if asking:
            t0 = perf_counter()
            heads = self.head.draft([slots[i].staged.request(slots[i].history, widths[i],
                                                             slots[i].spec.p_min)
                                     for i in asking])
            for i, head in zip(asking, heads, strict=True):
                drafts[i] = slots[i].staged.choose(drafts[i], head)
            seconds = perf_counter() - t0
            for i in asking:
                slots[i].counters.draft_seconds += seconds
        out: list[Draft] = []
        for slot, draft in zip(slots, drafts, strict=True):
            # The grammar cuts what it forbids and puts its forced run in front; the planner
            # then cuts what the proposer added (draft_min, the verify shape), never that run.
            draft, slot.forced = slot.constraint.guide(draft, self._room(slot))
            out.append(self.planner.trim(draft, slot.forced, slot.spec.draft_min))
        return out

    def _width(self, slot: Slot) -> int:
        return self.planner.width(slot.policy, self._room(slot))

    def _room(self, slot: Slot) -> int:
        """The most drafts this step may verify: the slot's width, capped so the step can
        exceed neither ``max_tokens`` nor the slot's context."""
        pos0 = len(slot.history) - 1
        return min(slot.draft_max, slot.request.max_tokens - len(slot.generated) - 1,
                   self.config.n_ctx - pos0 - 1)

    def _finish(self, slot: Slot, reason: FinishReason, committed: Sequence[int] = (),
                verified: bool = True, origin: str = "") -> SlotUpdate:
        """End ``slot``'s generation, free its sequence, and build its result (``origin``:
        how each of the ``committed`` tokens was produced, :func:`token_origin`)."""
        now = perf_counter()
        c = slot.counters
        ready = slot.ready_at or now
        c.prefill_seconds = ready - slot.admitted_at
        c.wall_seconds = now - ready
        c.generated_tokens = len(slot.generated)
        c.set_rollback(slot.rollback_before, self.rollback.telemetry(slot.seq))
        self._release(slot, keep=slot.request.prefix_cache)
        self._lifetime.merge(c)
        self.planner.finished(slot.method, c)
        telemetry = c.to_telemetry()
        text = slot.stream.take(final=True)
        result = GenerationResult(slot.generated, slot.stream.text, reason, telemetry,
                                  slot.sampler.seed, slot.generated_logprobs)
        log.info("generation.finished", **slot.request.log_fields, seq=slot.seq,
                 finish_reason=str(reason),
                 method=str(slot.method), prompt_tokens=len(slot.request.prompt_tokens),
                 generated=len(slot.generated), acceptance=round(telemetry.acceptance, 4),
                 tokens_per_verify=round(telemetry.tokens_per_verify, 3),
                 effective_tps=round(telemetry.effective_tokens_per_second, 2),
                 telemetry=telemetry.model_dump(mode="json"))
        return SlotUpdate(slot, list(committed), text, verified, result,
                          slot.logprobs_of_last(len(committed)), origin)

    def _release(self, slot: Slot, keep: bool) -> None:
        """Give ``slot``'s sequence back: its rollback checkpoint is forgotten, and what its
        positions hold stays as the sequence's prefix-cache entry when ``keep`` (else it is
        cleared)."""
        tokens = slot.decoded() if keep else None
        slot.phase = Phase.DONE
        del self._slots[slot.seq]
        self.rollback.release(slot.seq)
        self.prefix.release(self.target, slot.seq, tokens, slot.follows_head)

    def __enter__(self) -> SpeculativeEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
