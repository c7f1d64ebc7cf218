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

Two rules sit on top of the grammar's. Where the output is JSON, a number's digit runs are
capped as llama.cpp caps them (:mod:`.numbers`: masks, greedy's check and the draft cut all
apply it). And the slot's ``max_tokens`` is a budget the output must close within
(:meth:`SlotConstraint.settle`, :mod:`.close`): near the end of the budget every token the
target picks is kept only if a close of the grammar still fits after it, else it is replaced
by the first token of the close from where the slot stands, so a document cut by the budget
is a closed one. Drafts are cut where that check fails, so a draft never carries a token the
close would replace.

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
from worker.engine.constraint.close import SEARCH_LIMIT, close_plan, closer
from worker.engine.constraint.numbers import NumberCap, number_cap
from worker.engine.constraint.tokenizer import GrammarVocab, grammar_vocab
from worker.engine.core.constraint import UNCONSTRAINED, SlotConstraint
from worker.engine.core.draft import Draft
from worker.engine.core.telemetry import SpecCounters
from worker.llm import Model

#: A close not looked for yet (``GrammarConstraint._plans``; None: none fits).
_NOT_YET: list[int] = []
#: How near the end of its budget a slot's closes are watched (tokens left): the searches
#: are paid for only there. Further away a single token would have to lengthen the shortest
#: close by this much for the budget to be missed.
HORIZON = 256


class GrammarConstraint:
    """A slot's llguidance matcher, kept at the slot's committed tokens between steps.

    Within a step the matcher may stand ``len(self._path)`` draft tokens further; masks and
    closes are kept per path until the next commit. ``cap``: the number cap of the output's
    JSON (None: not JSON); ``budget``: the tokens the slot may generate (None: no close is
    steered to). Its counts go to the slot's ``counters``.
    """

    def __init__(self, matcher: LLMatcher, vocab: GrammarVocab, counters: SpecCounters,
                 cap: NumberCap | None = None, budget: int | None = None) -> None:
        self._matcher = matcher
        self._vocab = vocab
        self._counters = counters
        self._path: list[int] = []
        #: Allowed ids by path (MTP drafting and the verify rows ask for the same states,
        #: with the step's forced-run check in between).
        self._masks: dict[tuple[int, ...], np.ndarray] = {}
        self._eos = vocab.tokenizer.eos_token
        #: The token that ends the generation where the grammar may end (None: the model has
        #: no end token, and llguidance's is a virtual id past the logits, no token at all).
        self._end = self._eos if self._eos < vocab.n_vocab else None
        self._eog = np.asarray(vocab.eog, dtype=np.int64)
        self._forced = 0
        self._cap = cap
        #: The cap's state at the committed tokens, and after each token of ``_path``.
        self._lex0 = cap.start if cap is not None else 0
        self._lex: list[int] = []
        #: Tokens the budget leaves at the committed tokens (None: nothing is steered).
        self._left = budget
        #: A close that fits the budget there, by path (None: none does).
        self._plans: dict[tuple[int, ...], list[int] | None] = {}
        #: Paths whose last token replaced the target's pick (a close steered to).
        self._replaced: list[tuple[int, ...]] = []
        self._closing = False
        self._closer = closer(vocab)

    # -- the steps ---------------------------------------------------------------------------
    def guide(self, draft: Draft, room: int) -> tuple[Draft, int]:
        t0 = perf_counter()
        self._goto(())
        valid = self._matcher.validate_tokens(draft.tokens) if draft.tokens else 0
        valid = min(valid, self._uncapped(draft.tokens[:valid]))
        self._counters.mask_cut_drafts += len(draft.tokens) - valid
        draft = draft.cut(valid)
        forced = self._matcher.compute_ff_tokens()[:room] if room > 0 else []
        end = next((i for i, t in enumerate(forced) if t in self._vocab.eog), None)
        if end is not None:  # a complete grammar ends the generation at its commit
            forced = forced[:end]
        n = len(forced)
        if n and draft.tokens[:n] != forced:  # the proposer did not propose the forced run
            draft = Draft(forced)
        fits = min(self._fits(draft.tokens), self._endless(draft.tokens))
        if fits < len(draft.tokens):  # the close would replace it, or nothing may follow it
            self._counters.mask_cut_drafts += len(draft.tokens) - fits
            draft = draft.cut(fits)
            n = min(n, fits)
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
            allowed = (self._matcher.validate_tokens([token]) == 1
                       and not self._capped(token))
        if not allowed:
            ids = self._allowed()
            token = int(ids[np.argmax(logits[ids])])
        self._counters.mask_seconds += perf_counter() - t0
        return self.settle(path, token)

    def settle(self, path: Sequence[int], token: int) -> int:
        if token in self._vocab.eog or not self._watched(len(path) + 1):
            return token
        t0 = perf_counter()
        if self._plan([*path, token]) is None:
            plan = self._plan(path)
            # The close's first token, or the end where the grammar may end here; nothing to
            # steer to when no close fits here either, or the model has no token that ends.
            close = plan[0] if plan else self._end if plan is not None else None
            if close is not None:
                token = close
                self._replaced.append((*path, token))
        self._counters.mask_seconds += perf_counter() - t0
        return token

    def commit(self, n_accepted: int, committed: Sequence[int]) -> bool:
        t0 = perf_counter()
        key = tuple(committed)
        watched = self._watched(len(key))
        plan = self._plan(key) if watched else None
        if not self._closing and any(self._kept(key, p) for p in self._replaced):
            self._closing = True
            self._counters.grammar_forced_closes += 1
        self._goto(committed)  # rolls back the rejected drafts, consumes the bonus
        self._path = []
        self._lex0 = self._lex_at()
        self._lex = []
        if self._left is not None:
            # No close fits any more (a token before the horizon lengthened it past the
            # budget, or the search finds none): nothing is left to steer to or search for.
            self._left = self._left - len(committed) if plan is not None or not watched else None
        self._plans = {(): plan} if watched else {}
        self._replaced = []
        mask = self._masks.get(key)
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
        if self._cap is not None:
            del self._lex[common:]
            state = self._lex_at()
            for token in rest:
                state, _ = self._cap.step(state, token)
                self._lex.append(state)

    def _lex_at(self) -> int:
        """The number cap's state where the matcher stands."""
        return self._lex[-1] if self._lex else self._lex0

    def _capped(self, token: int) -> bool:
        """``token`` would run a number past the cap from where the matcher stands."""
        return self._cap is not None and self._cap.step(self._lex_at(), token)[1]

    def _uncapped(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` (drafts from the committed tokens) the cap lets through."""
        if self._cap is None:
            return len(tokens)
        state = self._lex0
        for i, token in enumerate(tokens):
            state, over = self._cap.step(state, token)
            if over:
                return i
        return len(tokens)

    # -- the budget ----------------------------------------------------------------------------
    def _kept(self, committed: tuple[int, ...], replaced: tuple[int, ...]) -> bool:
        """The slot kept the token the close put at the end of ``replaced`` (an end token is
        kept by ending right there: the slot commits what came before it)."""
        if replaced[-1] in self._vocab.eog:
            return committed == replaced[:-1]
        return committed[:len(replaced)] == replaced

    def _watched(self, depth: int) -> bool:
        """Whether the budget's close is watched ``depth`` tokens past the committed ones."""
        return self._left is not None and self._left - depth <= HORIZON

    def _endless(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` (drafts the grammar allows, from the committed tokens) may
        be verified: all, but the one that completes the grammar where the model has no end
        token. The row after a completing draft may then choose nothing (the grammar allows
        only its end, which no token of the model spells) and the slot would commit the
        token it chose anyway; verified as the last row's pick instead, the completing token
        ends the generation at its commit, as in plain decoding."""
        if self._end is not None or not tokens:
            return len(tokens)
        self._goto(tokens)
        return len(tokens) - 1 if self._matcher.is_stopped() else len(tokens)

    def _fits(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` (drafts from the committed tokens) leave a close that fits
        the budget after each of them."""
        for i, token in enumerate(tokens):
            if token in self._vocab.eog:  # an end the grammar allows ends it closed
                break
            if self._watched(i + 1) and self._plan(tokens[:i + 1]) is None:
                return i
        return len(tokens)

    def _plan(self, path: Sequence[int]) -> list[int] | None:
        """A close from after ``path`` within what the budget leaves there ([] where the
        grammar may end; None: none found). Derived from the close before the path's last
        token where that is watched (its tail, when the token is its first or spells its
        first bytes; itself, when it still closes after the token), so a close once found is
        followed to the end and a state's close depends only on the tokens that led there;
        else searched for."""
        key = tuple(path)
        plan = self._plans.get(key, _NOT_YET)
        if plan is not _NOT_YET:
            return plan
        assert self._left is not None  # asked only where the budget is watched
        left = self._left - len(key)
        before = self._plan(key[:-1]) if key and self._watched(len(key) - 1) else None
        if before and before[0] == key[-1]:
            plan = before[1:]
        else:
            rest = self._closer.after(before, key[-1]) if before else None
            if rest is not None and self._closes(key, rest, left):
                plan = rest
            elif before is not None and self._closes(key, before, left):
                plan = before
            else:
                self._goto(key)
                plan = close_plan(self._matcher, self._vocab, left, self._cap, self._lex_at())
        self._plans[key] = plan
        return plan

    def _closes(self, path: tuple[int, ...], plan: list[int], left: int) -> bool:
        """``plan`` still closes the grammar after ``path``, within ``left`` tokens."""
        if len(plan) > left:
            return False
        self._goto(path)
        if not plan:
            return self._matcher.is_accepting()
        if self._matcher.validate_tokens(plan) < len(plan):
            return False
        self._matcher.consume_tokens(plan)
        closes = self._matcher.is_accepting()
        self._matcher.rollback(len(plan))
        return closes

    def _allowed_eos(self) -> bool:
        return self._matcher.validate_tokens([self._eos]) == 1

    def _allowed(self) -> np.ndarray:
        """Ids allowed where the matcher stands (cached per path). A state that allows
        nothing (a vocabulary that cannot spell what the grammar needs next) allows the end
        ids, or everything when the model has none: the commit then finds the matcher in
        its error state and ends the generation. (A completed grammar is no such state: a
        model with no end token never verifies the row after it, :meth:`_endless`.)"""
        key = tuple(self._path)
        ids = self._masks.get(key)
        if ids is None:
            ids = self._mask_ids()
            if self._cap is not None and len(ids):
                uncapped = ids[~self._cap.forbidden(self._lex_at())[ids]]
                ids = uncapped if len(uncapped) else ids  # the cap yields to the grammar
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
    #: The number cap of the output's JSON (None: the output is not JSON).
    cap: NumberCap | None = None
    #: Tokens of the shortest document the close search finds from the start (None: none
    #: within ``SEARCH_LIMIT``): a ``max_tokens`` under it cannot be closed within.
    shortest: int | None = None

    def closes_within(self, max_tokens: int | None) -> bool:
        """Whether a budget of ``max_tokens`` can be steered to a closed document."""
        return (max_tokens is not None and self.shortest is not None
                and self.shortest <= max_tokens)

    def budget_note(self, max_tokens: int) -> str | None:
        """What a result cut by ``max_tokens`` says when the budget could never hold a
        closed document (None: it could, so the close was steered to)."""
        if self.closes_within(max_tokens):
            return None
        shortest = (f"the {self.shortest} tokens of the shortest document it allows"
                    if self.shortest is not None else
                    f"any document it allows (none within {SEARCH_LIMIT} tokens)")
        return (f"{self.kind} constraint: max_tokens {max_tokens} is under {shortest}, so "
                "the output was cut where the budget ended and may not parse")


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
    opening = constraint.json_opening()
    cap = number_cap(vocab, opening.encode()) if opening is not None else None
    plan = close_plan(matcher, vocab, SEARCH_LIMIT, cap, cap.start if cap else 0)
    return CompiledGrammar(matcher, vocab, kind, cap, len(plan) if plan is not None else None)


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
            # Once per model, not the grammar's time: the vocabulary and what every grammar
            # reads from it (the number cap's digit table, the close's one-byte tokens).
            vocab = grammar_vocab(model)
            number_cap(vocab, b"")
            closer(vocab)
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
         counters: SpecCounters, max_tokens: int | None = None) -> SlotConstraint:
    """A slot's constraint: :data:`UNCONSTRAINED` for None; a compiled grammar's matcher
    counting into the slot's ``counters`` (a :class:`Constraint` not compiled yet, as
    ``engine.generate`` passes one, is compiled here, off this thread's stack, and waited
    for), steered to a close within ``max_tokens`` where the budget can hold one (the
    engine's one hook: it passes the request's budget at admission; the constraint counts
    what it commits)."""
    if compiled is None:
        return UNCONSTRAINED
    if isinstance(compiled, Constraint):
        compiled = compile_off_thread(compiled, model).future.result()
    budget = max_tokens if compiled.closes_within(max_tokens) else None
    return GrammarConstraint(compiled.matcher, compiled.vocab, counters, compiled.cap, budget)


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
