"""Suffix drafting (SuffixDecoding, arXiv 2411.04975): draft only what the evidence pays for.

Prompt lookup drafts whenever the history's tail occurred before; on repeated structure (CSV
records rewritten as JSON) the tail "key": occurs often and the value after it is different
every time, so such drafts are mostly rejected, and on a big-vocabulary model every rejected
row costs nearly a whole decode. This drafter instead

1. finds the longest indexed context (:data:`~worker.engine.proposers.token_index.ORDERS`)
   the tail matches, in the prompt and the output so far and in the worker's recent outputs
   (:class:`~worker.engine.proposers.output_cache.OutputCache`);
2. walks the continuations of all those occurrences at once, as a suffix-tree walk does:
   each step takes the token most of them go on with, counts how many agree, and keeps only
   those; every token gets a calibrated acceptance probability
   (:class:`~worker.engine.proposers.confidence.AcceptanceStats`);
3. verifies only the length with the most expected tokens per second of verify
   (:func:`~worker.engine.draft_length_policy.best_draft_length`), costed by the measured row
   costs of this model on this device (:class:`~worker.engine.draft_cost.RowCosts`).

It learns as it goes: every verify's outcome calibrates the confidences, its duration
re-measures the row cost, and its committed tokens extend both the request's index and the
cache entry of this output. Those three live as long as the engine (:class:`SuffixShared`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from time import perf_counter

from worker.engine.draft_cost import RowCosts
from worker.engine.draft_length_policy import best_draft_length
from worker.engine.proposers.base import Draft, VerifyOutcome
from worker.engine.proposers.confidence import AcceptanceStats, Cell, RequestRecord
from worker.engine.proposers.output_cache import OutputCache
from worker.engine.proposers.token_index import ORDERS, TokenIndex, context_keys

#: The walk stops once the chance that the whole draft so far is accepted falls below this.
MIN_REACH = 0.02
#: Prompt tokens a cache entry keeps before the output: the longest context indexed.
LEAD_IN = max(ORDERS)


@dataclass
class SuffixShared:
    """What every suffix drafter of one engine (one model, one device) shares."""

    costs: RowCosts
    cache: OutputCache
    stats: AcceptanceStats = field(default_factory=AcceptanceStats)


#: One occurrence being walked: the sequence it is in and where its continuation starts.
Occurrence = tuple[list[int], int]


class SuffixProposer:
    """The drafter of one generation at a time; ``start`` resets the request's own index."""

    def __init__(self, shared: SuffixShared) -> None:
        self._shared = shared
        self._local = TokenIndex()
        self._entry: int | None = None
        self._cells: list[Cell] = []
        self._draft: list[int] = []
        self._confidences: list[float] = []
        self._proposed_at = 0.0
        self._record = RequestRecord()

    def start(self, prompt: Sequence[int]) -> None:
        """Index the prompt and open this output's cache entry. The entry starts with the
        prompt's last :data:`LEAD_IN` tokens, so a repeat of this request matches its own
        output from the first step (the tail then spans prompt and output)."""
        self._local = TokenIndex(prompt)
        self._entry = self._shared.cache.open()
        self._shared.cache.extend(self._entry, prompt[-LEAD_IN:])
        self._cells, self._draft, self._confidences = [], [], []
        self._record = RequestRecord()

    def propose(self, history: Sequence[int], width: int, p_min: float) -> Draft:
        """The worthwhile prefix of the best-supported continuation; ``p_min`` also stops it
        at the first token whose calibrated confidence is below it."""
        if len(self._local) < len(history):  # normally kept in step by observe
            self._local.extend(history[len(self._local):])
        tokens, confidences, cells = self._walk(self._match(history), width, p_min)
        keep = best_draft_length(confidences, self._shared.costs.seconds)
        self._draft, self._cells = tokens[:keep], cells[:keep]
        self._confidences = confidences[:keep]
        self.stamp()
        return Draft(self._draft, confidences=self._confidences)

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
        shared = self._shared
        if outcome.alone:
            shared.costs.observe(len(outcome.draft) + 1, perf_counter() - self._proposed_at)
        for i, (mine, verified) in enumerate(zip(self._draft, outcome.draft, strict=False)):
            if mine != verified or i > outcome.n_accepted:
                break  # another drafter's token, or past the first rejection: no evidence
            shared.stats.record(self._cells[i], i < outcome.n_accepted)
        if self._draft and outcome.draft[:len(self._draft)] == self._draft:
            promised, reach = 0.0, 1.0
            for p in self._confidences:
                reach *= p
                promised += reach
            self._record.record(promised, min(outcome.n_accepted, len(self._draft)))
        else:
            self._record.record(0.0, 0)
        committed = [*outcome.accepted, outcome.bonus]
        self._local.extend(committed)
        if self._entry is not None:
            shared.cache.extend(self._entry, committed)
        self._draft, self._cells, self._confidences = [], [], []

    # -- internals -------------------------------------------------------------------------
    def _match(self, history: Sequence[int]) -> tuple[int, list[Occurrence]]:
        """The longest indexed context length the tail matches anywhere, and its occurrences
        (this request's first, then cached outputs, most recently used first)."""
        keys = context_keys(history)
        cache = self._shared.cache
        for order, key in enumerate(keys):
            if key is None:
                continue
            found: list[Occurrence] = [(self._local.tokens, s)
                                       for s in self._local.occurrences(order, key)]
            for entry, index in cache.others(self._entry):
                starts = index.occurrences(order, key)
                if starts:
                    found += [(index.tokens, s) for s in starts]
                    cache.touch(entry)
            if found:
                return ORDERS[order], found
        return 0, []

    def _walk(self, match: tuple[int, list[Occurrence]], width: int,
              p_min: float) -> tuple[list[int], list[float], list[Cell]]:
        """Follow the occurrences' continuations token by token, majority first."""
        depth, occurrences = match
        stats = self._shared.stats
        scale = self._record.scale()
        tokens: list[int] = []
        confidences: list[float] = []
        cells: list[Cell] = []
        reach = 1.0
        for i in range(width):
            counts: dict[int, int] = {}
            for seq, start in occurrences:
                if start + i < len(seq):
                    t = seq[start + i]
                    counts[t] = counts.get(t, 0) + 1
            if not counts:
                break
            token = max(counts, key=counts.__getitem__)  # ties: the most recent occurrence
            p, cell = stats.confidence(depth + i, sum(counts.values()), counts[token])
            p *= scale
            reach *= p
            if p < p_min or reach < MIN_REACH:
                break
            tokens.append(token)
            confidences.append(p)
            cells.append(cell)
            occurrences = [(seq, start) for seq, start in occurrences
                           if start + i < len(seq) and seq[start + i] == token]
        return tokens, confidences, cells
