"""Suffix drafting (SuffixDecoding, arXiv 2411.04975): draft only what the evidence pays for.

Prompt lookup drafts whenever the history's tail occurred before; on repeated structure (CSV
records rewritten as JSON) the tail "key": occurs often and the value after it is different
every time, so such drafts are mostly rejected, and on a big-vocabulary model every rejected
row costs nearly a whole decode. This drafter instead

1. finds, in each of two sources, the longest indexed context
   (:data:`~worker.engine.proposers.token_index.ORDERS`) the tail matches: the request's own
   prompt and output so far, and the worker's recent outputs
   (:class:`~worker.engine.proposers.output_cache.OutputCache`); an earlier answer to the
   same prompt that this output has kept to is a match of the whole request, counted as
   deep as the longest context, however short the prompt;
2. walks the continuations of each source's occurrences at once, as a suffix-tree walk does:
   each step takes the token most of them go on with, counts how many agree, and keeps only
   those; every token gets a calibrated acceptance probability
   (:class:`~worker.engine.proposers.confidence.AcceptanceStats`, per source);
3. keeps, of each source's draft, only the length with the most expected tokens per second
   of verify (:func:`~worker.engine.drafting.width.best_draft_length`), costed by the
   measured row costs of this model on this device
   (:class:`~worker.engine.drafting.costs.RowCosts`), and verifies the source's draft that
   promises more (SuffixDecoding scores its prompt tree and its global tree the same way).

The sources are walked apart because pooling them let the larger one outvote the right one:
a repeat whose output left the cached one (Gemma Q4, CSV rewritten as JSON) matched 16
cached records and 4 of its own at the same depth, and the cached majority's continuation
was drafted and rejected over and over while its own records agreed with what it wrote.

It learns as it goes: every verify's outcome calibrates the confidences, its duration
re-measures the row cost, and its committed tokens extend both the request's index and the
cache entry of this output, with the target's margin for each (read from the verify's rows):
where that was a near-tie a later repeat may part from this output, and a draft across it
is costed as fragile (``confidence.py``), and a repeat verifies each near-tie in the shape of
the verify that chose it (``repeat_shape.py``). Those live as long as the engine
(:class:`SuffixShared`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from time import perf_counter

from worker.engine.core.draft import Draft, VerifyOutcome
from worker.engine.drafting.bar import DraftBar
from worker.engine.drafting.costs import RowCosts
from worker.engine.drafting.width import DraftLength, expected_tokens
from worker.engine.proposers.confidence import AcceptanceStats, Cell, RequestRecord
from worker.engine.proposers.output_cache import Origin, OutputCache
from worker.engine.proposers.repeat_shape import Shape, aligned_length, next_verify
from worker.engine.proposers.token_index import ORDERS, TokenIndex, follow, tail_keys

#: The walk stops once the chance that the whole draft so far is accepted falls below this.
MIN_REACH = 0.02
#: Prompt tokens a cache entry keeps before the output: the longest context indexed.
LEAD_IN = max(ORDERS)


#: The target's margin for each committed token at its verify rows (``Context.margins``):
#: ``(row0, tokens) -> margins``, read while the verify's outputs are still there.
MarginReader = Callable[[int, Sequence[int]], list[float]]


def no_margins(row0: int, tokens: Sequence[int]) -> list[float]:
    """A drafter state without a target to read (tests of the drafter alone): nothing is
    known to be fragile."""
    return []


def no_ends(token: int) -> bool:
    """A drafter state without a vocabulary (tests of the drafter alone): no token ends a
    generation."""
    return False


@dataclass
class SuffixShared:
    """What every suffix drafter of one engine (one model, one device) shares."""

    costs: RowCosts
    cache: OutputCache
    stats: AcceptanceStats = field(default_factory=AcceptanceStats)
    margins: MarginReader = no_margins
    #: Whether a token ends a generation (``Model.is_eog``): the request's own text never
    #: drafts one (:meth:`SuffixProposer._walk`).
    ends: Callable[[int], bool] = no_ends
    #: What a draft must promise over a plain step (the engine's, learned from its steps).
    bar: DraftBar = field(default_factory=lambda: DraftBar(1))

    def cold(self) -> SuffixShared:
        """This state with nothing learned from traffic, as a fresh worker starts: an empty
        output cache of the same bounds and fresh calibration (row costs and margins kept)."""
        return replace(self, cache=OutputCache(self.cache.max_bytes, self.cache.max_entries),
                       stats=AcceptanceStats())


#: Positions of a sequence that are fragile, and how fragile (:func:`~.confidence.fragility`).
Fragile = Mapping[int, int]
#: One occurrence being walked: the sequence it is in, where its continuation starts, and
#: where that sequence is fragile (only a cached output knows: the request's own text is
#: matched in other contexts than it was written in).
Occurrence = tuple[TokenIndex, int, Fragile]
#: A source's match: the context length matched and the occurrences found at it.
Match = tuple[int, list[Occurrence]]
#: The sources a draft comes from: the request's own prompt and output, other outputs.
OWN, SHARED = 0, 1
_FIRM: Fragile = {}


@dataclass
class Candidate:
    """One source's draft: its tokens, their confidences and evidence cells."""

    source: int
    tokens: list[int] = field(default_factory=list)
    confidences: list[float] = field(default_factory=list)
    cells: list[Cell] = field(default_factory=list)


class SuffixProposer:
    """The drafter of one generation at a time; ``start`` resets the request's own index."""

    def __init__(self, shared: SuffixShared) -> None:
        self._shared = shared
        self._local = TokenIndex()
        self._entry: int | None = None
        self._origin = Origin(0, 0)
        self._prompt_len = 0
        #: Per cached answer to this prompt: how many of this output's tokens it is known to
        #: equal (None once one differed: an output that parted from it never rejoins it).
        self._kept: dict[int, int | None] = {}
        self._chosen = Candidate(OWN)
        self._proposed_at = 0.0
        self._records = (RequestRecord(), RequestRecord())
        #: The near-ties' shapes (by output position) of the earlier answer this output
        #: repeats, as the last lookup found it; empty when it repeats none.
        self._repeating: dict[int, Shape] = {}
        #: The last draft repeats an earlier answer with a near-tie ahead, so its length is
        #: that near-tie's shape (:mod:`.repeat_shape`): a longer draft of another drafter
        #: would break it (:class:`~.combined.MtpSuffixProposer` reads it).
        self.shaped = False

    def start(self, prompt: Sequence[int]) -> None:
        """Index the prompt and open this output's cache entry. The entry starts with the
        prompt's last :data:`LEAD_IN` tokens, so a repeat of this request matches its own
        output from the first step (the tail then spans prompt and output). Only a repeat:
        a request whose prompt merely ends the same way (the same code after another
        instruction) is not answered with the earlier answer's start (:meth:`_matches`),
        which it drafted at 0.99 and had rejected at once (Gemma 270M, "copy this" after
        "copy this and rename")."""
        self._local = TokenIndex(prompt)
        self._origin = Origin.of(prompt, LEAD_IN)
        self._prompt_len = len(prompt)
        self._kept = {}
        self._entry = self._shared.cache.open(self._origin)
        self._shared.cache.extend(self._entry, prompt[-LEAD_IN:])
        self._chosen = Candidate(OWN)
        self._records = (RequestRecord(), RequestRecord())

    def propose(self, history: Sequence[int], width: int, p_min: float) -> Draft:
        """The worthwhile prefix of the best-supported continuation of either source, the one
        with the most expected tokens per second (ties: the request's own); ``p_min`` also
        stops a walk at the first token whose calibrated confidence is below it."""
        if len(self._local) < len(history):  # normally kept in step by observe
            self._local.extend(history[len(self._local):])
        if width <= 0:  # nothing may be drafted this step: no lookups
            self.shaped = False
            self._chosen = Candidate(OWN)
            self.stamp()
            return Draft([])
        costs = self._shared.costs
        seconds = costs.seconds
        best, best_rate = Candidate(OWN), 0.0
        for source, match in enumerate(self._matches(history)):
            length = DraftLength(seconds, self._shared.bar.level, costs.floor_from)
            walked = self._walk(source, match, width, p_min, length)
            keep = length.best
            rate = expected_tokens(walked.confidences[:keep]) / seconds[keep + 1]
            if keep and rate > best_rate:
                best = Candidate(source, walked.tokens[:keep], walked.confidences[:keep],
                                 walked.cells[:keep])
                best_rate = rate
        pos = len(history) - self._prompt_len
        verify = next_verify(pos, self._repeating) if best.source == SHARED else None
        self.shaped = verify is not None
        if verify is not None:
            keep = aligned_length(len(best.tokens), pos, verify)
            best = Candidate(SHARED, best.tokens[:keep], best.confidences[:keep],
                             best.cells[:keep])
        self._chosen = best
        self.stamp()
        return Draft(best.tokens, confidences=best.confidences)

    def stamp(self) -> None:
        """The verify starts now: the time until :meth:`observe` is its cost. A drafter that
        runs after this one in the same step (the combined drafter's MTP) calls it again."""
        self._proposed_at = perf_counter()

    def observe(self, outcome: VerifyOutcome) -> None:
        """Learn the verify's cost and how each of our verified tokens went; record the
        committed tokens in the request's index and in this output's cache entry.

        The time since :meth:`stamp` is this verify's cost only when its rows had the decode
        to themselves: a step shared with other slots or a prompt chunk costs what all its rows
        cost (the engine's step costs learn those), and charging it to this width would make a
        lone plain step look dear and every draft after it cheap."""
        shared, chosen = self._shared, self._chosen
        if outcome.alone:
            shared.costs.observe(len(outcome.draft) + 1, perf_counter() - self._proposed_at)
        for i, (mine, verified) in enumerate(zip(chosen.tokens, outcome.draft, strict=False)):
            if mine != verified or i > outcome.n_accepted:
                break  # another drafter's token, or past the first rejection: no evidence
            shared.stats.record(chosen.cells[i], i < outcome.n_accepted)
        verified_ours = bool(chosen.tokens) and (
            outcome.draft[:len(chosen.tokens)] == chosen.tokens)
        for source, record in enumerate(self._records):
            if verified_ours and source == chosen.source:
                promised = expected_tokens(chosen.confidences) - 1.0  # the bonus is not drafted
                record.record(promised, min(outcome.n_accepted, len(chosen.tokens)))
            else:
                record.record(0.0, 0)
        committed = [*outcome.accepted, outcome.bonus]
        self._local.extend(committed)
        if self._entry is not None:
            shared.cache.extend(self._entry, committed, shared.margins(outcome.row0, committed),
                                len(outcome.draft) + 1 if outcome.alone else None)
        self._chosen = Candidate(OWN)

    # -- internals -------------------------------------------------------------------------
    def _matches(self, history: Sequence[int]) -> tuple[Match, Match]:
        """Per source (:data:`OWN`, :data:`SHARED`): the longest indexed context length the
        tail matches there and its occurrences (cached outputs most recently used first);
        ``(0, [])`` where it matches nowhere. Earlier answers to this same prompt that this
        output is still in step with come first, matched as a whole request (:meth:`_repeats`)."""
        # The request's index holds the history (propose keeps it in step): its prefix
        # hashes give every order's key at once.
        local = self._local
        keys = local.tail_keys() if len(local) == len(history) else tail_keys(history)
        cache = self._shared.cache
        own: Match = (0, [])
        for order, key in enumerate(keys):
            if key is not None:
                starts = self._local.occurrences(order, key)
                if starts:
                    own = (ORDERS[order], [(self._local, s, _FIRM) for s in starts])
                    break
        repeat = self._repeats(history)
        if repeat[1]:
            return own, repeat
        for order, key in enumerate(keys):
            if key is None:
                continue
            found: list[Occurrence] = []
            for entry, index in cache.holding(order, key, self._entry):
                starts = index.occurrences(order, key)
                origin = cache.origin(entry)
                if origin.prompt != self._origin.prompt:  # another request's answer
                    starts = [s for s in starts if s != origin.lead_in]
                if starts:
                    found += [(index, s, cache.fragile(entry)) for s in starts]
                    cache.touch(entry)
            if found:
                return own, (ORDERS[order], found)
        return own, (0, [])

    def _repeats(self, history: Sequence[int]) -> Match:
        """Earlier answers to this very prompt that this output has kept to so far: the
        whole history matches each (the same prompt, the same tokens since), so the match
        counts as deep as the longest context indexed, however short the prompt. The tail
        lookup alone matched a repeat of a short prompt only as deep as the prompt and guessed
        it like a coincidence of that length (Gemma 270M, "write a story about ...", 28
        tokens: 16 deep, 11 drafts at 0.95, where the answer was then accepted 53 drafts at
        a time). ``(0, [])`` when there is none, or when every such answer ends here.

        Each step compares only the tokens committed since the last (:attr:`_kept`): the
        history only grows, so the whole output is never compared again. The most recent such
        answer's near-tie shapes are kept for :meth:`propose` (:attr:`_repeating`)."""
        cache = self._shared.cache
        head, written = self._prompt_len, len(history) - self._prompt_len
        found: list[Occurrence] = []
        self._repeating = {}
        for entry, index in cache.answers(self._entry, self._origin.prompt):
            origin = cache.origin(entry)
            kept = self._kept.get(entry, 0)
            if kept is None:
                continue
            # An answer still being written (another slot's) is compared as far as it goes.
            lead_in = origin.lead_in
            end = min(written, len(index) - lead_in)
            theirs = index[lead_in + kept:lead_in + end]
            if theirs != list(history[head + kept:head + end]):
                self._kept[entry] = None
                continue
            self._kept[entry] = end
            if lead_in + written < len(index):  # it goes on past this output
                if not found:
                    self._repeating = {k - lead_in: shape
                                       for k, shape in cache.shapes(entry).items()}
                found.append((index, lead_in + written, cache.fragile(entry)))
                cache.touch(entry)
        return (max(len(history), LEAD_IN), found) if found else (0, [])

    def _walk(self, source: int, match: Match, width: int, p_min: float,
              length: DraftLength) -> Candidate:
        """Follow the occurrences' continuations token by token, majority first.

        An occurrence in the request's own text whose continuation reaches the end of the
        history goes on with the draft itself: the tail recurring ``k`` tokens back says the
        text repeats with period ``k``, so the draft repeats it (as an n-gram lookup over
        history plus draft does; llama-server's ngram-mod drafts 48-64 tokens of a loop).
        Without it a looping story drafted one period at a time (Gemma 270M: 15 of the 32
        its confidences paid for, at 1.00 acceptance). A cached output ends where it ends.
        A token is drafted as fragile as the most fragile position an agreeing occurrence
        holds it at.

        The request's own text stops before a token that ends a generation: its output holds
        none, so one comes from the prompt, where it ends a turn of the chat template, and an
        answer that quotes the user's last words goes on after them (Gemma 270M, a story
        quoting "finds a message in a bottle.": 13 tokens of template drafted at 0.99 and
        rejected at once, and the request's record then kept it from drafting for about
        twenty verifies). A cached output may draft its own end: a repeat ends there too.

        The walk stops where ``length`` says no longer draft could be kept: what it walked
        past that was never verified. The walk is native code
        (:func:`~worker.engine.proposers.token_index.follow`): it ran at every draft step of
        every slot, and its Python was the drafter's largest host cost after the lookups."""
        depth, occurrences = match
        shared = source == SHARED
        tokens, confidences, cells = follow(
            occurrences, width, not shared, None if shared else self._shared.ends,
            self._shared.stats, depth, shared, self._records[source].scale(), p_min,
            MIN_REACH, length)
        return Candidate(source, tokens, confidences, cells)
