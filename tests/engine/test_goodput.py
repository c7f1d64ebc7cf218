"""Goodput-aware drafting across slots: each step decides for every busy slot together how
many draft rows to verify, from the row costs at the batch it really runs and each slot's
chances, so that expected committed tokens per second of the step is largest (SmartSpec's
rule; vLLM's disable-by-batch-size is its degenerate case)."""

from __future__ import annotations

from pathlib import Path

from helpers import PROMPT

from shared.protocol import SpecMethod, SpecSettings
from worker.engine.core.draft import Draft
from worker.engine.core.telemetry import SpecCounters
from worker.engine.drafting.budget import draft_chances, plan_widths
from worker.engine.drafting.costs import RowCosts
from worker.engine.engine import EngineConfig, SpeculativeEngine
from worker.engine.slot import SlotRequest
from worker.launch import EngineCapacity


def rising(rows: int, fixed: float = 4.0, per_row: float = 1.0,
           growth: float = 0.05) -> list[float]:
    """A decode whose per-row cost rises with the batch: ``fixed + per_row * r * (1 + growth
    * r)`` seconds for r rows (compute-bound wide batches)."""
    return [0.0] + [fixed + per_row * r * (1 + growth * r) for r in range(1, rows + 1)]


def cumulative(p: float, n: int) -> list[float]:
    """Chances of positions 1..n when every token is accepted with ``p`` given the earlier."""
    return [p**m for m in range(1, n + 1)]


def goodput(chances: list[list[float]], widths: list[int], costs: list[float]) -> float:
    tokens = len(chances) + sum(sum(c[:w]) for c, w in zip(chances, widths, strict=True))
    return tokens / costs[len(chances) + sum(widths)]


def test_the_same_draft_pays_alone_and_not_in_a_busy_batch() -> None:
    costs = rising(80)
    draft = cumulative(0.7, 6)
    alone = plan_widths([draft], costs)
    assert alone[0] >= 2
    # Eight busy slots already share the fixed cost, and every row costs more at that batch:
    # the same drafts would lower the step's tokens per second. A rule that priced each
    # slot's rows as if it ran alone (costs[1 + m]) would draft here as it does above.
    busy = plan_widths([draft] * 8, costs)
    assert busy == [0] * 8
    assert goodput([draft] * 8, busy, costs) > goodput([draft] * 8, alone * 8, costs)


def test_at_high_load_it_drafts_less_per_slot_and_nothing_at_the_top() -> None:
    costs = rising(16 * 9, fixed=8.0, per_row=1.0, growth=0.02)
    draft = cumulative(0.9, 8)
    per_slot = [sum(plan_widths([draft] * s, costs)) / s for s in (1, 2, 4, 8, 16)]
    assert per_slot == sorted(per_slot, reverse=True)
    assert per_slot[0] > per_slot[-1]
    assert per_slot[-1] == 0  # vLLM's disable-by-batch-size, reached by the costs alone


def test_the_whole_cost_table_is_searched_not_climbed() -> None:
    # Four plain rows cost 1.3; rows 5..8 cost 2.0 together (a tile step): one draft row
    # alone does not pay, all four do. A greedy climb stops at the foot of the step.
    costs = [0.0, 1.0, 1.1, 1.2, 1.3, 2.0, 2.0, 2.0, 2.0, 3.0, 3.0]
    chances = [[0.9]] * 4
    assert plan_widths(chances, costs) == [1, 1, 1, 1]


def test_likeliest_rows_first_and_a_slot_s_rows_in_order() -> None:
    costs = [0.0] + [3.0 + r for r in range(1, 30)]
    # Slot 0's second position cannot be likelier than its first (it needs the first).
    widths = plan_widths([[0.5, 0.99], [0.95, 0.9, 0.2], []], costs)
    assert widths == [0, 2, 0]
    assert plan_widths([], costs) == []
    assert plan_widths([[0.99]] * 3, [0.0, 1.0, 2.0]) == [0, 0, 0]  # table too short


def test_a_drafter_s_own_confidences_are_the_chances() -> None:
    counters = SpecCounters()
    assert draft_chances(Draft([1, 2, 3], confidences=[0.9, 0.5, 1.0]), counters) == [
        0.9, 0.45, 0.45]
    assert Draft([1, 2, 3], confidences=[0.9, 0.5, 1.0]).cut(1).confidences == [0.9]
    # Without confidences: the slot's record per position (optimistic before any).
    assert len(draft_chances(Draft([1, 2]), counters)) == 2


def test_the_engine_verifies_what_the_step_costs_pay_for(dense_model: Path) -> None:
    """Four n-gram slots on a repetitive prompt: with rows nearly free the drafts are
    verified; with a cost table where a row costs the same at every batch and nothing is
    shared, none are (the plan is the engine's, not the drafter's)."""
    capacity = EngineCapacity(SpecMethod.NGRAM, 4)
    spec = SpecSettings(method=SpecMethod.NGRAM, draft_max=4, adaptive=False)
    prompt = PROMPT * 3
    with SpeculativeEngine(EngineConfig(str(dense_model), n_ctx=512, slots=4, n_threads=1,
                                        capacity=capacity)) as engine:
        assert engine.planner.steps is not None
        rows = len(engine.planner.steps.seconds) - 1

        def drafted(costs: list[float]) -> int:
            engine.planner.steps = RowCosts(costs)
            slots = [engine.admit(SlotRequest(prompt, 24, spec)) for _ in range(4)]
            while engine.active:
                engine.step()
            return sum(sum(s.counters.drafted_per_position[:1]) for s in slots)

        # Fresh counters start from the optimistic guess (0.8) per position.
        assert drafted([0.0] + [1.0 + 0.001 * r for r in range(1, rows + 1)]) > 0
        # Every row costs the same and nothing is shared: a row that is not sure to be
        # accepted earns less than a plain one (ties go to fewer rows).
        assert drafted([0.0] + [1.5 * r for r in range(1, rows + 1)]) == 0
