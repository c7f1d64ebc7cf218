"""One slot's constraint: the grammar's mask on the target distribution, and what it forces.

A constrained slot holds an llguidance matcher that has consumed exactly the slot's committed
tokens. Every step asks it four things, in this order (docs/structured.md):

1. :meth:`SlotConstraint.guide`: the proposer's draft is cut at the first token the grammar
   forbids (a point-mass draft of a forbidden token would be rejected anyway: cutting it
   before it costs a verify row changes nothing), and the tokens the grammar forces from
   here (llguidance's fast-forward tokens) become the draft where the proposer did not
   already propose them: jump-forward, verified in the same one decode as any draft.
2. :meth:`SlotConstraint.masked` / :meth:`SlotConstraint.choose`: row ``i`` of the verify is
   the target's distribution after ``drafts[:i]``, so the matcher walks the draft's prefixes
   (consume forward, roll back on a branch) and masks each row the sampler reads; greedy
   checks the raw argmax first and computes a full mask only when the grammar forbids it.
   The MTP head drafts through the same :meth:`masked`, so its sampled drafts already follow
   the grammar and rejection sampling runs against the masked target.
3. :meth:`SlotConstraint.commit`: the matcher rolls back what the verify rejected and
   consumes the bonus token, i.e. it follows the slot to its committed tokens whatever the
   target's rollback did (a trim, a snapshot or a checkpoint restore and replay); a grammar
   that can say no more ends the generation (``stop``).

:data:`~worker.engine.core.constraint.UNCONSTRAINED` answers all of them with "no change",
so the hot loop never asks whether a slot is constrained.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from time import perf_counter

import numpy as np
from llguidance import LLMatcher

from shared.constraint import Constraint, ConstraintError, check_constraint
from shared.constraint_sandbox import WALL_FACTOR, WORKER_STACK_MIB, parser_limits
from worker.engine.constraint.tokenizer import GrammarVocab, grammar_vocab
from worker.engine.core.constraint import UNCONSTRAINED, SlotConstraint
from worker.engine.core.draft import Draft
from worker.engine.core.telemetry import SpecCounters
from worker.llm import Model


class GrammarConstraint:
    """A slot's llguidance matcher, kept at the slot's committed tokens between steps.

    Within a step the matcher may stand ``len(self._path)`` draft tokens further; masks are
    kept per path until the next commit. Its counts go to the slot's ``counters``.
    """

    def __init__(self, matcher: LLMatcher, vocab: GrammarVocab, counters: SpecCounters) -> None:
        self._matcher = matcher
        self._vocab = vocab
        self._counters = counters
        self._path: list[int] = []
        #: Allowed ids by path (MTP drafting and the verify rows ask for the same states,
        #: with the step's forced-run check in between).
        self._masks: dict[tuple[int, ...], np.ndarray] = {}
        self._eos = vocab.tokenizer.eos_token
        self._eog = np.asarray(vocab.eog, dtype=np.int64)
        self._forced = 0

    # -- the steps ---------------------------------------------------------------------------
    def guide(self, draft: Draft, room: int) -> tuple[Draft, int]:
        t0 = perf_counter()
        self._goto(())
        valid = self._matcher.validate_tokens(draft.tokens) if draft.tokens else 0
        self._counters.mask_cut_drafts += len(draft.tokens) - valid
        draft = draft.cut(valid)
        forced = self._matcher.compute_ff_tokens()[:room] if room > 0 else []
        end = next((i for i, t in enumerate(forced) if t in self._vocab.eog), None)
        if end is not None:  # a complete grammar ends the generation at its commit
            forced = forced[:end]
        n = len(forced)
        if n and draft.tokens[:n] != forced:  # the proposer did not propose the forced run
            draft = Draft(forced)
        self._forced = n
        self._counters.mask_seconds += perf_counter() - t0
        return draft, n

    def masked(self, path: Sequence[int], logits: np.ndarray) -> np.ndarray:
        t0 = perf_counter()
        self._goto(path)
        ids = self._allowed()
        out = np.full(logits.shape, -np.inf, dtype=np.float32)
        out[ids] = logits[ids]
        self._counters.mask_seconds += perf_counter() - t0
        return out

    def choose(self, path: Sequence[int], logits: np.ndarray, token: int) -> int:
        t0 = perf_counter()
        self._goto(path)
        if token in self._vocab.eog:
            allowed = bool(self._allowed_eos())
        else:
            allowed = self._matcher.validate_tokens([token]) == 1
        if not allowed:
            ids = self._allowed()
            token = int(ids[np.argmax(logits[ids])])
        self._counters.mask_seconds += perf_counter() - t0
        return token

    def commit(self, n_accepted: int, committed: Sequence[int]) -> bool:
        t0 = perf_counter()
        self._goto(committed)  # rolls back the rejected drafts, consumes the bonus
        self._path = []
        mask = self._masks.get(tuple(committed))
        self._masks = {} if mask is None else {(): mask}
        c = self._counters
        c.constrained_tokens += len(committed)
        c.forced_tokens += min(n_accepted, self._forced, len(committed))
        done = self._matcher.is_stopped() or self._matcher.is_error()
        c.mask_seconds += perf_counter() - t0
        return done

    # -- internals ---------------------------------------------------------------------------
    def _goto(self, path: Sequence[int]) -> None:
        """Stand the matcher after ``path``: roll back to the common prefix with where it
        stands, consume the rest. Every token consumed here was allowed (cut drafts, masked
        picks); one that is not leaves the matcher in its error state, which ends the slot's
        generation at its next commit."""
        here = self._path
        common = 0
        limit = min(len(path), len(here))
        while common < limit and path[common] == here[common]:
            common += 1
        if len(here) > common:
            self._matcher.rollback(len(here) - common)
            del here[common:]
        rest = list(path[common:])
        end = next((i for i, t in enumerate(rest) if t in self._vocab.eog), None)
        if end is not None:  # nothing follows an end token: stand where it was drafted
            rest = rest[:end]
        if rest:
            self._matcher.consume_tokens(rest)
            here.extend(rest)

    def _allowed_eos(self) -> bool:
        return self._matcher.validate_tokens([self._eos]) == 1

    def _allowed(self) -> np.ndarray:
        """Ids allowed where the matcher stands (cached per path). A state that allows
        nothing (a vocabulary that cannot spell what the grammar needs next) allows the end
        ids, or everything when the model has none: the commit then finds the matcher in
        its error state and ends the generation."""
        key = tuple(self._path)
        ids = self._masks.get(key)
        if ids is None:
            ids = self._mask_ids()
            if not len(ids):
                ids = self._eog if len(self._eog) else np.arange(self._vocab.n_vocab)
            self._masks[key] = ids
        return ids

    def _mask_ids(self) -> np.ndarray:
        return _mask_ids(self._matcher, self._vocab)


@dataclass(frozen=True)
class CompiledGrammar:
    """A constraint compiled against a model's vocabulary, its matcher standing before the
    first token: what a slot binds (:func:`bind`). Compiling takes from milliseconds to
    (for a large schema against a 262k vocabulary) a second, so the serving loop compiles
    off the engine's thread (:func:`compile_off_thread`) while the other slots decode."""

    matcher: LLMatcher
    vocab: GrammarVocab
    kind: str


def compile_grammar(constraint: Constraint, model: Model) -> CompiledGrammar:
    """``constraint`` compiled against ``model``'s vocabulary, under llguidance's parser
    limits. The sandbox checks it first (``check_constraint``: what would crash or stall a
    compiler is refused there, in a child process), so what is compiled here, in-process,
    has passed with 1/8 of the stack it gets here (:func:`compile_off_thread`).

    Raises :class:`ConstraintError` (a ValueError: the job's error names it) when the
    grammar does not compile against this vocabulary or allows no first token in it."""
    check_constraint(constraint)
    vocab = grammar_vocab(model)
    kind = constraint.kind.value
    matcher = LLMatcher(vocab.tokenizer, constraint.llguidance_grammar(), log_level=0,
                        limits=parser_limits())
    if matcher.is_error():
        raise ConstraintError(f"{kind} constraint does not compile against this model's "
                              f"vocabulary: {matcher.get_error()}")
    if not len(_mask_ids(matcher, vocab)) or matcher.is_error():
        raise ConstraintError(f"{kind} constraint: this model's vocabulary cannot spell any "
                              f"start it allows ({_reason(matcher.get_error())})")
    return CompiledGrammar(matcher, vocab, kind)


class GrammarCompile:
    """A :func:`compile_grammar` running off the engine's thread (:func:`compile_off_thread`):
    its ``future``, and when it began compiling (None while the model's vocabulary view is
    still being built, ~2 s once per model for 262k tokens: not the grammar's time).

    Its budget is the compiling thread's CPU time, as the sandbox's is the child's
    (:mod:`shared.constraint_sandbox`): a compile that waits for a core beside a busy decode
    is not the grammar's fault. A starved thread is still given up on after
    :data:`~shared.constraint_sandbox.WALL_FACTOR` times the budget of wall time."""

    def __init__(self) -> None:
        self.future: Future[CompiledGrammar] = Future()
        self.started: float | None = None
        self._clock: int | None = None
        self._cpu_started = 0.0

    def begin(self) -> None:
        """Called on the compiling thread as the grammar's own compile starts."""
        try:
            self._clock = time.pthread_getcpuclockid(threading.get_ident())
            self._cpu_started = time.clock_gettime(self._clock)
        except (AttributeError, OSError):  # no per-thread CPU clock: the wall clock decides
            self._clock = None
        self.started = perf_counter()

    def overdue(self, budget: float) -> bool:
        """Compiling for longer than ``budget`` seconds of its thread's CPU time (or
        ``WALL_FACTOR * budget`` of wall time)."""
        if self.started is None:
            return False
        wall = perf_counter() - self.started
        if self._clock is None or wall > WALL_FACTOR * budget:
            return wall > budget
        try:
            return time.clock_gettime(self._clock) - self._cpu_started > budget
        except OSError:  # the thread has ended: its result is in the future
            return False


def compile_off_thread(constraint: Constraint, model: Model) -> GrammarCompile:
    """:func:`compile_grammar` on a thread of its own with a
    :data:`~shared.constraint_sandbox.WORKER_STACK_MIB` stack (llguidance compiles
    recursively, and releases the GIL while it does, so the engine decodes on meanwhile)."""
    compile_ = GrammarCompile()

    def run() -> None:
        if not compile_.future.set_running_or_notify_cancel():
            return
        try:
            grammar_vocab(model)
            compile_.begin()
            compile_.future.set_result(compile_grammar(constraint, model))
        except BaseException as exc:  # noqa: BLE001  the waiting job reports it
            compile_.future.set_exception(exc)

    with _STACK_LOCK:  # threading.stack_size is process-wide: set it for this thread only
        previous = threading.stack_size(WORKER_STACK_MIB * 1024 * 1024)
        try:
            threading.Thread(target=run, name="grammar-compile", daemon=True).start()
        finally:
            threading.stack_size(previous)
    return compile_


_STACK_LOCK = threading.Lock()


def bind(compiled: CompiledGrammar | Constraint | None, model: Model,
         counters: SpecCounters) -> SlotConstraint:
    """A slot's constraint: :data:`UNCONSTRAINED` for None; a compiled grammar's matcher
    counting into the slot's ``counters`` (a :class:`Constraint` not compiled yet, as
    ``engine.generate`` passes one, is compiled here, off this thread's stack, and waited
    for)."""
    if compiled is None:
        return UNCONSTRAINED
    if isinstance(compiled, Constraint):
        compiled = compile_off_thread(compiled, model).future.result()
    return GrammarConstraint(compiled.matcher, compiled.vocab, counters)


def _mask_ids(matcher: LLMatcher, vocab: GrammarVocab) -> np.ndarray:
    """The mask's ids within the model's vocabulary where ``matcher`` stands, plus every
    end-of-generation id when the grammar may end there (llguidance knows one end token; a
    model may have several, such as Gemma's ``<eos>`` and ``<end_of_turn>``)."""
    words = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
    bits = np.unpackbits(words, bitorder="little")
    eos = vocab.tokenizer.eos_token
    if eos < len(bits) and bits[eos]:
        bits[np.asarray(vocab.eog, dtype=np.int64)] = 1
    return np.nonzero(bits[: vocab.n_vocab].view(np.bool_))[0]  # bool: ~8x faster


def _reason(error: str) -> str:
    """llguidance's error, or the tokenizer's own message when that is what failed (it comes
    wrapped in a Rust panic and a Python traceback)."""
    raised = re.search(r"ValueError\((['\"])(.+?)\1\)", error)
    if raised:
        return raised.group(2)
    return error.splitlines()[0] if error else "no token allowed"
