"""How far every slot drafts this step: the draft decision, made in one place.

The engine asks the planner four things a step and tells it one (docs/engine.md, "The loop"):

1. :meth:`DraftPlanner.width`: how far to ask a slot's proposer, its width policy's ceiling
   within the room it has, on the verify shape;
2. :meth:`DraftPlanner.trim`: a proposed draft shorter than the request's ``draft_min`` is
   dropped, a longer one cut to the verify shape, never below the grammar's forced run;
3. :meth:`DraftPlanner.plan`: with several slots in a step, which of all their draft rows the
   step verifies (the row budget's goodput split, priced by the step costs; now and then a
   plain step the draft bar asks for, to measure what drafting is compared with);
4. :meth:`DraftPlanner.observe`: the verify ran: the step costs learn its decode time, each
   slot's width policy what it accepted, the draft bar what the step yielded.

What it plans with lives here too: the cost curve and the tables read from it (the one-slot
table the suffix drafter prices its lengths with is :attr:`DraftPlanner.one_slot`), the
bar, and the counters of finished requests per method (the row budget's prior for a new
request's acceptance, :meth:`DraftPlanner.finished`). A drafter that prices its own draft
(suffix drafting: ``best_draft_length`` on its confidences) reads the same costs and bar,
so no two parts of the engine can decide with different numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shared.protocol import SpecMethod
from worker.engine.core.draft import Draft
from worker.engine.core.telemetry import SpecCounters
from worker.engine.drafting.bar import DraftBar
from worker.engine.drafting.buckets import NO_BUCKETS, BucketPolicy
from worker.engine.drafting.budget import draft_chances, plan_widths
from worker.engine.drafting.costs import RowCosts
from worker.engine.drafting.curve import CostCurve
from worker.engine.drafting.shape import best_lengths
from worker.engine.drafting.width import BudgetedWidth, DraftLengthPolicy, make_policy


@dataclass(frozen=True)
class Proposed:
    """One decoding slot's draft as the step plans it: the draft, the grammar's forced run at
    its head (kept whatever the budget says), the slot's counters, its method (whose
    finished requests are its prior) and its width policy (told what the budget granted)."""

    draft: Draft
    forced: int
    counters: SpecCounters
    method: SpecMethod
    policy: BudgetedWidth


@dataclass(frozen=True)
class Verified:
    """What one slot's verify established, as the planner learns from it."""

    policy: DraftLengthPolicy
    drafted: int
    accepted: int
    forced: int


@dataclass(frozen=True)
class StepRecord:
    """One engine step as the planner learns from it: its verify rows and their decode time,
    the slots' outcomes, the tokens committed and the step's whole wall time. A step that
    also prefilled a prompt chunk teaches the costs and the bar nothing (its decode carried
    rows no verify priced)."""

    rows: int
    decode_seconds: float
    verified: Sequence[Verified]
    committed: int
    wall_seconds: float
    prefilled: bool


class DraftPlanner:
    """The draft decision of one engine of ``slots`` slots and draft width ``draft_max``:
    everything it prices comes from ``curve`` (None: the engine never drafts, or nothing it
    does prices rows); ``replays``: the device replays repeated decodes' graphs (a GPU), so
    plain widths are priced steady; ``budget``: several slots share each step's rows
    (:meth:`plan`); ``shape``: verify only the lengths whose rows pay at full acceptance;
    ``buckets``: how the verifier pads a step, so every table prices a plan at what it
    decodes (:mod:`~worker.engine.drafting.buckets`)."""

    def __init__(self, curve: CostCurve | None, slots: int, draft_max: int, replays: bool,
                 budget: bool, shape: bool, buckets: BucketPolicy = NO_BUCKETS) -> None:
        # ``buckets``: a plan of r rows costs what the step it pads to decodes.
        curve = buckets.priced(curve) if curve is not None else None
        #: ``shape[n]``: how many of n drafted tokens are worth verifying (identity: all).
        self.shape = (best_lengths(curve.table(draft_max + 1)) if shape and curve is not None
                      else list(range(draft_max + 1)))
        #: What a draft must promise over a plain step, learnt from realised step rates.
        self.bar = DraftBar(slots)
        #: One slot's verifies (the suffix drafter prices its lengths with these).
        self.one_slot = (RowCosts.for_one_slot(curve, draft_max, replays)
                         if curve is not None else None)
        #: Steps of several slots (the row budget's table); None: one slot, or no budget.
        self.steps = (RowCosts.for_steps(curve, slots, draft_max, replays)
                      if curve is not None and budget and slots > 1 and draft_max else None)
        #: Finished requests' counters per method: the row budget's prior for the next ones.
        self._prior: dict[SpecMethod, SpecCounters] = {}
        #: Drafters that keep proposing nothing are skipped for a while (a GPU: host work is
        #: a large share of its steps, two thirds by issue 47's figures); on a CPU (1-3%)
        #: the drafts a skip misses cost more than the lookups it saves
        #: (:meth:`BudgetedWidth.proposed`).
        self.idle_skip = replays

    def policy(self, draft_max: int, adaptive: bool, idle_skips: bool = True) -> BudgetedWidth:
        """A new request's width policy (``draft_max`` 0: it never drafts); ``idle_skips``:
        its drafter may be skipped a while after proposing nothing, where this planner skips
        (:attr:`idle_skip`; not where which positions are drafted decides the tokens: a
        sampled request's head drafts)."""
        return BudgetedWidth(make_policy(draft_max, adaptive, self.shape),
                             self.idle_skip and idle_skips)

    def width(self, policy: DraftLengthPolicy, room: int) -> int:
        """How far to ask the proposer: the policy's ceiling within ``room``, on the shape."""
        return self.shape[min(policy.width(), room)]

    def trim(self, draft: Draft, forced: int, draft_min: int) -> Draft:
        """A draft shorter than ``draft_min`` dropped (a plain step), a longer one cut to the
        verify shape; the grammar's ``forced`` run is never cut."""
        n = len(draft.tokens)
        return draft.cut(max(self.shape[n] if n >= draft_min else 0, forced))

    def plan(self, proposed: Sequence[Proposed]) -> list[Draft]:
        """The drafts the step verifies. One slot verifies what its drafter chose (the suffix
        drafter prices its own length); several share the step's rows by the row budget, or
        verify none in a probe the draft bar asks for (greedy drafts are cut; a sampled draft
        keeps its width: which positions are drafts decides its tokens, and they must not
        depend on the neighbours'; forced tokens stay: the grammar allows nothing else)."""
        drafts = [p.draft for p in proposed]
        for p in proposed:
            p.policy.proposed(len(p.draft.tokens) - p.forced)
        if self.steps is None or len(proposed) < 2:
            return drafts
        if self.bar.probe(len(proposed)):
            widths = [0] * len(proposed)
        else:
            chances = [draft_chances(p.draft, p.counters, self._prior.get(p.method))
                       for p in proposed]
            widths = plan_widths(chances, self.steps.seconds, self.bar.level)
            for p, w in zip(proposed, widths, strict=True):
                if p.draft.dists is None:  # a sampled draft keeps its width: never cut
                    p.policy.granted(len(p.draft.tokens) - p.forced, max(w - p.forced, 0))
        return [p.draft.cut(max(w, p.forced)) if p.draft.dists is None else p.draft
                for p, w in zip(proposed, widths, strict=True)]

    def observe(self, step: StepRecord) -> None:
        """Learn from a step: each slot's width policy from the tokens its proposer drafted
        (the grammar's forced ones are not its), then, for a step of verifies alone, the step
        costs from its decode and the bar from what it yielded."""
        for v in step.verified:
            forced = min(v.forced, v.accepted)
            v.policy.update(v.drafted - forced, v.accepted - forced)
        if step.prefilled:
            return
        if self.steps is not None:
            self.steps.observe(step.rows, step.decode_seconds)
        self.bar.record(len(step.verified), step.committed, step.wall_seconds,
                        any(v.drafted for v in step.verified))

    def finished(self, method: SpecMethod, counters: SpecCounters) -> None:
        """A request of ``method`` ended: its acceptance joins the prior of the next ones."""
        self._prior.setdefault(method, SpecCounters()).merge(counters)
