"""The row budget of multi-slot steps: a draft row is verified only when it raises the step's
expected tokens per second, which takes a higher chance the more plain rows share the
decode's fixed cost."""

from __future__ import annotations

from pathlib import Path

from helpers import PROMPT

from shared.protocol import SamplingParams, SpecMethod, SpecSettings
from worker.engine.core.distribution import Distribution
from worker.engine.core.draft import Draft
from worker.engine.core.telemetry import SpecCounters
from worker.engine.drafting.budget import FIRST_GUESS, plan_widths, reach
from worker.engine.drafting.curve import CostCurve
from worker.engine.drafting.planner import DraftPlanner, Proposed
from worker.engine.drafting.width import PLAIN_MARGIN, BudgetedWidth
from worker.engine.slot import SlotRequest

from .conftest import open_engine


def linear(fixed: float, per_row: float, rows: int) -> list[float]:
    return [0.0] + [fixed + per_row * r for r in range(1, rows + 1)]


def test_likely_rows_are_taken_and_unlikely_ones_trimmed() -> None:
    # Four slots on a decode whose fixed cost equals one row: a row must beat 4/5, and the
    # step must beat a plain one by the margin.
    costs = linear(1.0, 1.0, 40)
    assert plan_widths([[0.95] * 5] * 4, costs) == [5, 5, 5, 5]
    assert plan_widths([[0.5] * 5] * 4, costs) == [0, 0, 0, 0]
    assert plan_widths([[0.99, 0.99, 0.99, 0.3], [0.5], [], [0.99, 0.99]], costs) == [3, 0, 0, 2]


def test_a_step_drafts_only_when_it_beats_a_plain_step_by_the_margin() -> None:
    """The rows chosen are the likeliest-looking of all slots' drafts, so their chances err
    high (the optimizer's curse, as for one slot's length): a step whose drafts promise
    less than ``PLAIN_MARGIN`` more tokens per second than its plain rows verifies none.
    Four slots, fixed cost one row: 20 rows at 0.9 promise 22 tokens for 25 rows' time
    against 4 for 5 (1.10x, not more); at 0.95, 23 for 25 (1.15x)."""
    costs = linear(1.0, 1.0, 40)
    assert PLAIN_MARGIN == 0.1
    assert plan_widths([[0.9] * 5] * 4, costs) == [0, 0, 0, 0]
    assert plan_widths([[0.95] * 5] * 4, costs) == [5, 5, 5, 5]


def test_one_slot_on_a_weight_bound_decode_drafts_even_unsure_rows() -> None:
    assert plan_widths([[0.5] * 8], linear(4.0, 1.0, 10)) == [8]
    # The same chances with eight slots sharing the fixed cost: not worth a row.
    assert plan_widths([[0.5] * 8] * 8, linear(4.0, 1.0, 80)) == [0] * 8


def test_the_row_costs_bound_the_step() -> None:
    assert sum(plan_widths([[0.99] * 9] * 2, linear(10.0, 1.0, 6))) == 6 - 2


def test_reach_moves_from_the_prior_to_the_slot_record() -> None:
    fresh = SpecCounters()
    assert reach(fresh, 2) == [FIRST_GUESS, FIRST_GUESS]
    bad = SpecCounters()
    for _ in range(50):
        bad.record_verify(2, 0)
    assert reach(bad, 3)[0] < 0.1
    earlier = SpecCounters()
    for _ in range(20):
        earlier.record_verify(1, 1)
    assert reach(fresh, 1, earlier) == [1.0]


def _planner(curve: CostCurve, slots: int) -> DraftPlanner:
    return DraftPlanner(curve, slots, draft_max=8, replays=False, budget=True, shape=False)


def _step(planner: DraftPlanner, policies: list[BudgetedWidth], chance: float) -> list[int]:
    """One step: each slot asks its policy's width and drafts that many tokens at ``chance``;
    returns the widths asked."""
    asked = [planner.width(p, room=8) for p in policies]
    counters = SpecCounters()
    planner.plan([Proposed(Draft([7] * w, confidences=[chance] * w), 0, counters,
                           SpecMethod.SUFFIX, p) for w, p in zip(asked, policies, strict=True)])
    return asked


def test_a_slot_whose_drafts_the_budget_keeps_cutting_stops_asking_its_drafter_for_a_while(
) -> None:
    """Eight slots where a draft row costs what a plain one does (a CPU at eight slots): the
    budget grants nothing, so each slot's drafter is asked after 1, 2, 4, 8, 8 ... skipped
    steps instead of at every step; a draft the budget takes (rows nearly free) restores
    asking at every step."""
    dear = _planner(CostCurve({1: 1.0, 8: 8.0, 64: 64.0}), 8)
    policies = [dear.policy(8, adaptive=False) for _ in range(8)]
    asked = [_step(dear, policies, 0.9)[0] for _ in range(40)]
    assert [i for i, w in enumerate(asked) if w] == [0, 2, 5, 10, 19, 28, 37]
    cheap = _planner(CostCurve({1: 1.0, 8: 1.05, 64: 1.5}), 8)
    policies = [cheap.policy(8, adaptive=False) for _ in range(8)]
    assert [_step(cheap, policies, 0.9)[0] for _ in range(10)] == [8] * 10
    # A slot that had backed off asks at once again after its first granted draft.
    skipped = dear.policy(8, adaptive=False)
    skipped.granted(asked=8, width=0)
    assert skipped.width() == 0 and skipped.width() == 8
    skipped.granted(asked=8, width=3)
    assert skipped.width() == 8


def test_a_sampled_draft_the_budget_keeps_whole_never_backs_its_slot_off() -> None:
    """A sampled draft keeps its width whatever the budget says (which positions are drafts
    decides its tokens), so its slot's drafter is asked at every step even where the budget
    would have cut a greedy one."""
    dear = _planner(CostCurve({1: 1.0, 8: 8.0, 64: 64.0}), 8)
    policies = [dear.policy(8, adaptive=False) for _ in range(8)]
    counters = SpecCounters()
    for _ in range(5):
        asked = [dear.width(p, room=8) for p in policies]
        assert asked == [8] * 8
        drafts = [Draft([7] * w, dists=[Distribution.point(7)] * w, confidences=[0.9] * w)
                  for w in asked]
        kept = dear.plan([Proposed(d, 0, counters, SpecMethod.MTP, p)
                          for d, p in zip(drafts, policies, strict=True)])
        assert [len(d.tokens) for d in kept] == [8] * 8


def test_a_drafter_that_proposes_nothing_is_asked_less_often_until_it_proposes_again() -> None:
    """One slot (no row budget) whose drafter finds nothing worth drafting, on a GPU (host
    work a large share of a step): from its second empty proposal in a row it is asked after
    1, 2, then 4 skipped steps while it stays empty; the first step it proposes a draft it is
    asked at every step again. A step it was not asked in does not count as empty. On a CPU
    (decodes dominate) it is asked at every step."""
    curve = CostCurve({1: 1.0, 8: 2.0, 64: 8.0})
    planner = DraftPlanner(curve, 1, draft_max=8, replays=True, budget=True, shape=False)
    policy = planner.policy(8, adaptive=False)
    counters = SpecCounters()

    def step(planner: DraftPlanner, policy: BudgetedWidth, finds: bool) -> int:
        width = planner.width(policy, room=8)
        draft = Draft([7] * width if finds else [], confidences=[0.9] * width if finds else [])
        planner.plan([Proposed(draft, 0, counters, SpecMethod.SUFFIX, policy)])
        return width

    asked = [step(planner, policy, finds=False) for _ in range(30)]
    assert [i for i, w in enumerate(asked) if w] == [0, 1, 3, 6, 11, 16, 21, 26]
    # The last skip, then asked again: it proposes.
    assert [step(planner, policy, finds=True) for _ in range(4)] == [0, 8, 8, 8]
    # The grammar's forced run is not the drafter's: a draft of forced tokens alone is empty.
    forced = Draft([3, 4], confidences=[1.0, 1.0])
    for _ in range(2):
        planner.width(policy, room=8)
        planner.plan([Proposed(forced, 2, counters, SpecMethod.SUFFIX, policy)])
    assert planner.width(policy, room=8) == 0
    # A sampled request's head drafts (which positions are drafted decides its tokens): never
    # skipped.
    keyed = planner.policy(8, adaptive=False, idle_skips=False)
    assert [step(planner, keyed, finds=False) for _ in range(20)] == [8] * 20
    # A CPU: never skipped.
    cpu = DraftPlanner(curve, 1, draft_max=8, replays=False, budget=True, shape=False)
    policy = cpu.policy(8, adaptive=False)
    assert [step(cpu, policy, finds=False) for _ in range(20)] == [8] * 20


def test_only_requests_whose_draft_positions_do_not_decide_their_tokens_skip(
        hybrid_model: Path) -> None:
    """On an engine with a draft head, a sampled request's drafter is never skipped for
    proposing nothing (the head's drafts are draws: which positions are drafted decides the
    tokens); a greedy one's is."""
    skipped = []
    for sampling in (SamplingParams(), SamplingParams(temperature=0.8, seed=3)):
        with open_engine(hybrid_model, SpecMethod.MTP, draft_max=4) as engine:
            engine.planner.idle_skip = True  # as where the layers run on a GPU
            slot = engine.admit(SlotRequest(PROMPT, 8, SpecSettings(method=SpecMethod.MTP),
                                            sampling=sampling))
            for _ in range(2):
                assert slot.policy.width() > 0
                slot.policy.proposed(0)
            skipped.append(slot.policy.width() == 0)
    assert skipped == [True, False]
