"""MTP self-speculation: the model's own NextN head drafts from the target's hidden states.

One model, two contexts. The draft context (``ctx_type = MTP``) runs only the NextN block,
and an entry at position ``p`` is (token ``p``, the target's hidden state at ``p - 1``); its
output predicts token ``p + 1``. The draft context therefore has to be kept in step with the
target: it is fed every prompt position as the target prefills it and, after each verify,
only the confirmed token and the accepted drafts: the rejected tail never has to be computed,
and the draft context never has to be rolled back (docs/engine.md, "Proposers").

The draft context holds as many sequences as the target (one per slot), and
:class:`MtpDrafter` drafts for every MTP slot of an engine step together: the catch-up of
each slot's last verify rides in the same decode as its first drafted position, and each
further chain position of all slots is one more decode. It is the engine's
:class:`~worker.engine.proposers.head.DraftHead` (the hooks the engine and the prefix cache
call); :class:`MtpProposer` is one slot's view of it, behind the ordinary
:class:`~worker.engine.proposers.base.Proposer` interface and staged for the batched draft
(:class:`~worker.engine.proposers.head.Staged`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from shared.logs import get_logger
from shared.protocol import SpecMethod
from worker.engine.core.constraint import UNCONSTRAINED, SlotConstraint
from worker.engine.core.draft import Draft, VerifyOutcome
from worker.engine.proposers.head import DraftRequest
from worker.llm import Batch, Context, ContextSpec, LlamaError, Model

if TYPE_CHECKING:
    from worker.engine.core.distribution import Distribution
    from worker.engine.core.sampler import Sampler

log = get_logger("engine.mtp")


def uses_mtp(method: SpecMethod) -> bool:
    """A request (or an engine) of ``method`` drafts with the MTP head."""
    return method in (SpecMethod.MTP, SpecMethod.MTP_SUFFIX)


class MtpUnavailableError(ValueError):
    """The model cannot draft for itself (no NextN head, or not loaded with it)."""


def require_mtp_head(model: Model) -> None:
    """Refuse MTP on a GGUF without a NextN head, naming the methods that do work for it."""
    if not model.has_mtp_head:
        raise MtpUnavailableError(
            f"{model.spec.path} has no MTP (NextN) head (nextn_predict_layers = 0): "
            "use spec method 'ngram' or 'auto'"
        )


@dataclass
class _Feed:
    """Entries waiting to be fed: ``tokens`` at ``pos0..`` with their input hidden rows."""

    tokens: list[int]
    pos0: int
    inputs: np.ndarray


class _SeqState:
    """What the draft context knows about one sequence."""

    def __init__(self, n_embd: int) -> None:
        #: Target hidden state of the position before the next token to feed.
        self.pending = np.zeros(n_embd, dtype=np.float32)
        #: Positions ``[0, fed)`` of the draft KV hold entries conditioned on the target.
        self.fed = 0
        self.backlog: _Feed | None = None


class MtpDrafter:
    """Owns the draft context (one sequence per slot) for the engine's lifetime."""

    def __init__(self, model: Model, target: Context, spec: ContextSpec) -> None:
        require_mtp_head(model)
        if not model.spec.load_mtp:
            raise MtpUnavailableError("the MTP drafter needs the model loaded with load_mtp=True")
        self._target = target
        target.expose_hidden(masked=False)
        self._draft = Context(model, spec)
        # Unmasked, like the target: llama.cpp's masked NextN rows (outputs only) come back
        # wrong for every sequence but the first of a decode with catch-up entries, which
        # would chain a busy engine's drafts on another slot's state.
        self._draft.expose_hidden(masked=False)
        self._batch = Batch(spec.n_batch, model.n_embd)
        self._seqs = [_SeqState(model.n_embd) for _ in range(spec.n_seq_max)]

    # -- the DraftHead hooks ----------------------------------------------------------------
    def follows(self, method: SpecMethod) -> bool:
        return uses_mtp(method)

    def proposer(self, seq: int, sampler: Sampler,
                 constraint: SlotConstraint = UNCONSTRAINED) -> MtpProposer:
        """The drafter of slot ``seq`` (one generation's, drafting with its ``sampler`` under
        its ``constraint``)."""
        return MtpProposer(self, seq, sampler, constraint)

    def on_place(self, seq: int, follows: bool, keep: int, hidden: np.ndarray | None) -> None:
        """Resume ``seq`` at ``keep`` for a request that drafts with the head; otherwise (or
        with nothing kept) forget the sequence's draft state."""
        if follows and keep:
            self.resume(seq, keep, hidden)
        else:
            self.reset(seq)

    def on_prefill(self, seq: int, tokens: Sequence[int], pos0: int,
                   row0: int) -> np.ndarray | None:
        self.feed_prompt(seq, tokens, pos0, row0)
        return self.pending(seq)

    # -- the draft context -------------------------------------------------------------------

    def reset(self, seq: int) -> None:
        """A new generation in ``seq``: forget the previous one's draft KV and hand-over."""
        state = self._seqs[seq]
        if state.fed:
            self._draft.seq_clear(seq)
        self._seqs[seq] = _SeqState(len(state.pending))

    def resume(self, seq: int, keep: int, hidden: np.ndarray | None) -> None:
        """A new generation in ``seq`` reuses the first ``keep`` positions of the previous
        one's (prefix reuse): keep the draft KV up to there and resume from the target's hidden
        state at ``keep - 1``: ``hidden`` (a prefix checkpoint's), or None when ``keep`` is the
        end of the previous generation, whose pending catch-up is fed now."""
        state = self._seqs[seq]
        if hidden is None:
            if state.backlog is not None:
                feed, state.backlog = state.backlog, None
                self._feed_now(seq, feed)
            if state.fed != keep:
                raise LlamaError(f"MTP draft context holds {state.fed} positions of sequence "
                                 f"{seq}, the reused prefix {keep}")
            return
        if not self._draft.seq_rm(keep, seq=seq):
            raise LlamaError(f"could not cut the MTP draft context back to position {keep}")
        state.fed = keep
        state.backlog = None
        state.pending = hidden.copy()

    def pending(self, seq: int) -> np.ndarray:
        """The target's hidden state the next fed position of ``seq`` takes (a prefix
        checkpoint stores it: a draft resumed there needs it)."""
        return self._seqs[seq].pending

    def feed_prompt(self, seq: int, tokens: Sequence[int], pos0: int, start: int) -> None:
        """Feed prompt positions ``pos0..`` that the target's last decode prefilled, their
        hidden rows at batch entries ``start..``."""
        rows = self._target.hidden_rows(len(tokens), start)
        self._feed_now(seq, _Feed(list(tokens), pos0, self._inputs(seq, rows)))

    def observe(self, seq: int, outcome: VerifyOutcome) -> None:
        """Keep ``[last, accepted drafts]`` of the verify (their hidden rows are still in the
        target's outputs, from entry ``outcome.row0``) for the next draft decode to feed.

        A slot whose lookup drafted instead of the head (``mtp+suffix``) is observed again
        before the head next drafts: the new entries join the waiting ones (they follow them
        position for position). A backlog past half a batch is fed at once, so a draft's
        first decode always has room for it."""
        n = outcome.n_accepted + 1
        rows = self._target.hidden_rows(n, outcome.row0)
        state = self._seqs[seq]
        feed = _Feed([outcome.last_token, *outcome.accepted], outcome.pos0,
                     self._inputs(seq, rows))
        if state.backlog is not None:
            old = state.backlog
            feed = _Feed(old.tokens + feed.tokens, old.pos0,
                         np.concatenate([old.inputs, feed.inputs]))
        state.backlog = None
        if len(feed.tokens) > self._batch.capacity // 2:
            self._feed_now(seq, feed)
        else:
            state.backlog = feed

    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        """Chain the head for every request at once: (last, target hidden) -> d1, (d1, head's
        own hidden) -> d2, ... Each chain position of all still-drafting slots is one decode;
        the first also feeds every slot's pending catch-up.

        Only the first drafted entry of a slot is conditioned on the target; the later ones are
        the head's own guesses, so they are trimmed from the draft KV afterwards.
        """
        tokens: list[list[int]] = [[] for _ in requests]
        dists: list[list[Distribution | None]] = [[] for _ in requests]
        row: dict[int, int] = {}
        self._make_room(requests)
        batch = self._batch.clear()
        for i, r in enumerate(requests):
            state = self._seqs[r.seq]
            if state.backlog is not None:
                feed, state.backlog = state.backlog, None
                skip = state.fed - feed.pos0
                if skip < len(feed.tokens):
                    batch.add(feed.tokens[skip:], feed.pos0 + skip, False, feed.inputs[skip:],
                              r.seq)
                state.fed = feed.pos0 + len(feed.tokens)
            if r.width > 0:
                row[i] = batch.add([r.history[-1]], len(r.history) - 1, True,
                                   state.pending[None, :], r.seq)
        drafted = set(row)
        if batch.n_tokens:
            self._draft.decode(batch)  # a failure here would lose catch-up: it must raise
        step = 0
        while row:
            nxt: dict[int, int] = {}
            batch.clear()
            for i, at in row.items():
                r = requests[i]
                seen = [*r.history, *tokens[i]] if r.sampler.penalised else r.history
                logits = r.constraint.masked(tokens[i], self._draft.logits(at))
                picked = r.sampler.draft(logits, len(r.history) + step, seen, r.p_min)
                if picked is None:
                    continue
                token, dist = picked
                tokens[i].append(token)
                dists[i].append(dist)
                if len(tokens[i]) < r.width:
                    nxt[i] = batch.add([token], len(r.history) + step, True,
                                       self._draft.hidden(at)[None, :], r.seq)
            row, step = nxt, step + 1
            if row:
                try:
                    self._draft.decode(batch)
                except LlamaError as exc:
                    log.warning("mtp.draft_failed", step=step, error=str(exc))
                    break
        for i in drafted:
            r = requests[i]
            state = self._seqs[r.seq]
            state.fed = len(r.history)
            if not self._draft.seq_rm(state.fed, seq=r.seq):
                raise LlamaError(f"could not trim the MTP draft context at position {state.fed}")
        return [Draft(t, _sampled(d)) for t, d in zip(tokens, dists, strict=True)]

    def close(self) -> None:
        self._batch.close()
        self._draft.close()

    def _make_room(self, requests: Sequence[DraftRequest]) -> None:
        """Feed waiting catch-up now, slot by slot, until what is left of it and every slot's
        first drafted row fit one batch (only slots whose lookup drafted for several steps
        have that much waiting)."""
        waiting = [(r.seq, feed) for r in requests
                   if (feed := self._seqs[r.seq].backlog) is not None]
        need = len(requests) + sum(len(feed.tokens) for _, feed in waiting)
        for seq, feed in waiting:
            if need <= self._batch.capacity:
                return
            self._seqs[seq].backlog = None
            need -= len(feed.tokens)
            self._feed_now(seq, feed)

    def _inputs(self, seq: int, rows: np.ndarray) -> np.ndarray:
        """Entry i's input is the hidden row of the position before it; afterwards the last
        row is what the next entry will need."""
        state = self._seqs[seq]
        inputs = np.concatenate([state.pending[None, :], rows[:-1]])
        state.pending = rows[-1].copy()
        return inputs

    def _feed_now(self, seq: int, feed: _Feed) -> None:
        """Decode ``feed`` into the draft context in slices of the batch (prompt catch-up)."""
        state = self._seqs[seq]
        step = self._batch.capacity
        for start in range(state.fed - feed.pos0, len(feed.tokens), step):
            end = min(start + step, len(feed.tokens))
            self._draft.decode(self._batch.set(feed.tokens[start:end], feed.pos0 + start, False,
                                               feed.inputs[start:end], seq))
        state.fed = feed.pos0 + len(feed.tokens)


class MtpProposer:
    """One slot's MTP drafter: the :class:`Proposer` face of :class:`MtpDrafter` for ``seq``,
    staged so that the engine drafts every MTP slot of a step together (it always asks for
    the head: the head's catch-up rides on that draft even when ``width`` is 0)."""

    def __init__(self, drafter: MtpDrafter, seq: int, sampler: Sampler,
                 constraint: SlotConstraint = UNCONSTRAINED) -> None:
        self.drafter = drafter
        self.seq = seq
        self.sampler = sampler
        self.constraint = constraint

    def start(self, prompt: Sequence[int]) -> None:
        """Nothing to do: the engine fed the prompt to the draft context as it prefilled."""

    def propose(self, history: Sequence[int], width: int, p_min: float) -> Draft:
        return self.drafter.draft([self.request(history, width, p_min)])[0]

    def observe(self, outcome: VerifyOutcome) -> None:
        self.drafter.observe(self.seq, outcome)

    def stage(self, history: Sequence[int], width: int, p_min: float) -> tuple[Draft, bool]:
        return Draft([]), True

    def request(self, history: Sequence[int], width: int, p_min: float) -> DraftRequest:
        return DraftRequest(self.seq, history, width, p_min, self.sampler, self.constraint)

    def choose(self, staged: Draft, head: Draft) -> Draft:
        return head


def _sampled(dists: list[Distribution | None]) -> list[Distribution] | None:
    """The draft's distributions when its tokens were sampled (a sampler gives one for every
    token or for none); None for argmax drafts."""
    kept = [d for d in dists if d is not None]
    return kept or None
