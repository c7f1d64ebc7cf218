"""The draft-length decision: given per-token confidences and measured row costs, the length.

Row costs are the ones that matter in practice: a GPU-like flat curve (rows nearly free),
Gemma 270M Q4_K_M on one CPU thread (measured, docs/engine.md: a second row nearly doubles a
decode, 4 rows cost less than 3 or 5), and a linear curve (every row costs a decode, so no
draft can ever pay).
"""

from __future__ import annotations

import copy
import random
from pathlib import Path

import pytest

from shared.protocol import SpecMethod
from worker.engine.drafting.costs import (
    FLOOR,
    REFIT_SHIFT,
    RESIDUAL_RATE,
    WIDER_FROM,
    RowCosts,
    cap_wide,
)
from worker.engine.drafting.curve import PROBE_WIDTHS, CostCurve
from worker.engine.drafting.width import PLAIN_MARGIN, best_draft_length

from .conftest import open_engine

FLAT = [0.0] + [1.0] * 17
GEMMA_CPU = [0.0, 1.0, 1.96, 3.49, 2.69, 4.10, 4.3, 4.5, 4.7, 4.01, 5.63, 5.7, 5.8, 5.9, 6.0,
             6.1, 6.2, 6.33, 7.87][:18]
LINEAR = [float(r) for r in range(18)]


def test_free_rows_draft_everything_that_may_be_accepted() -> None:
    assert best_draft_length([0.3] * 10, FLAT) == 10
    assert best_draft_length([], FLAT) == 0


def test_rows_that_cost_a_decode_never_pay() -> None:
    """Even certain drafts only tie with plain steps (ties go to the shorter draft)."""
    assert best_draft_length([1.0] * 16, LINEAR) == 0
    assert best_draft_length([0.99] * 16, LINEAR) == 0


def test_cpu_costs_demand_confidence() -> None:
    # One sure token does not pay for a second row that costs 1.96 decodes...
    assert best_draft_length([0.95], GEMMA_CPU) == 0
    # ...but three sure tokens on the cheap 4-row verify do (4 tokens for 2.69 decodes), and
    # a fourth would need the dear 5-row verify.
    assert best_draft_length([0.99, 0.99, 0.99], GEMMA_CPU) == 3
    assert best_draft_length([0.99] * 4, GEMMA_CPU) == 3
    # A long sure run reaches the cheap wide verifies.
    assert best_draft_length([0.999] * 16, GEMMA_CPU) == 16
    # Coin-toss continuations (CSV values after a repeated key) are never drafted.
    assert best_draft_length([0.5] * 16, GEMMA_CPU) == 0


def test_a_draft_must_beat_a_plain_step_by_the_margin() -> None:
    """Estimated chances of the drafts chosen err high, so a bet that promises less than
    PLAIN_MARGIN over a plain step is not taken; one that promises more is."""
    two_rows = 1.5  # a second row at half a decode
    barely = two_rows * 1.05 - 1.0  # a token likely enough to be worth 5 % over plain
    assert PLAIN_MARGIN > 0.05
    assert best_draft_length([barely], [0.0, 1.0, two_rows]) == 0
    clear = two_rows * (1.0 + 2 * PLAIN_MARGIN) - 1.0
    assert best_draft_length([clear], [0.0, 1.0, two_rows]) == 1


def test_an_unlikely_token_ends_the_draft_before_it() -> None:
    confident = [0.999] * 8
    assert best_draft_length([*confident, 0.05, *confident], FLAT) == 16  # free rows: go on
    assert best_draft_length([*confident, 0.05, *confident], GEMMA_CPU) == 8


def test_length_is_bounded_by_the_measured_rows() -> None:
    assert best_draft_length([1.0] * 40, FLAT) == len(FLAT) - 2


def test_row_costs_follow_the_load_at_every_width_from_whatever_width_runs() -> None:
    """Under load a verify costs more than its idle entry, the more the wider it is. Plain
    verifies run every step and drafting ones now and then, yet every row count is priced at
    the load they measure, a width never run (32) included: a table that followed each
    width's own observations kept the seldom-run widths at their idle cost, so drafting
    looked cheaper than it ran."""
    idle = [0.0] + [10.0 + 2.0 * r for r in range(1, 41)]
    costs = RowCosts(idle)
    assert costs.seconds == idle
    for step in range(200):
        rows = 20 if step % 5 == 0 else 8
        costs.observe(rows, idle[rows] + 1.0 + 0.5 * rows)
    for rows in (8, 20, 32, 40):  # within the slope's shrinkage (SLOPE_PRIOR)
        assert costs.seconds[rows] == pytest.approx(idle[rows] + 1.0 + 0.5 * rows, rel=0.01)
    for _ in range(500):  # the load lifts: the fit follows it back down
        costs.observe(8, idle[8])
    assert costs.seconds[32] == pytest.approx(idle[32], rel=0.01)


def test_row_costs_shift_every_width_alike_while_one_width_runs() -> None:
    """Only plain steps seen: no slope can be told, so the load adds the same seconds to
    every row count; and a host faster than at load never makes a row nearly free."""
    idle = [0.0] + [10.0 + 2.0 * r for r in range(1, 41)]
    costs = RowCosts(idle)
    costs.observe(8, idle[8] + 3.0)
    # What the step took against what the table said before learning from it.
    assert (costs.observed, costs.predicted) == (idle[8] + 3.0, idle[8])
    for _ in range(99):
        costs.observe(8, idle[8] + 3.0)
    assert costs.seconds[1:] == pytest.approx([s + 3.0 for s in idle[1:]], rel=1e-3)
    # One spike moves the line by its weight (1 in about 50) and its width's residual by
    # RESIDUAL_RATE of the rest; the other widths only by the line.
    costs.observe(8, idle[8] + 100.0)
    assert costs.seconds[8] < idle[8] + 3.0 + 100.0 * (0.03 + RESIDUAL_RATE)
    assert costs.seconds[20] < idle[20] + 3.0 + 100.0 * 0.03
    for _ in range(300):
        costs.observe(8, 0.1)
    assert costs.seconds[1] == pytest.approx(FLOOR * idle[1])
    assert all(c >= FLOOR * s for c, s in zip(costs.seconds[1:], idle[1:], strict=True))
    costs.observe(41, 1.0)  # rows never measured are ignored, not invented
    assert len(costs.seconds) == 41
    with pytest.raises(ValueError):
        RowCosts([0.0, 0.0])


def test_a_width_that_runs_is_priced_at_what_it_ran() -> None:
    """The load's line is one for all widths, but the tile steps move with the context: a
    width that keeps running off the line (33 rows as cheap as the line's 25) is priced at
    what it ran, the others stay on the line."""
    idle = [0.0] + [10.0 + 2.0 * r for r in range(1, 41)]
    costs = RowCosts(idle)
    for step in range(300):
        rows = 1 if step % 2 else 25
        costs.observe(rows, idle[rows] + 0.5 * rows)
        if step % 10 == 0:
            costs.observe(33, idle[25] + 0.5 * 25)
    assert costs.seconds[33] == pytest.approx(idle[25] + 0.5 * 25, rel=0.03)
    assert costs.seconds[29] > costs.seconds[33]
    assert costs.seconds[25] == pytest.approx(idle[25] + 0.5 * 25, rel=0.03)


def test_a_curve_prices_untimed_widths_at_their_tile_s_end_and_extends_its_line() -> None:
    """A width the curve did not time costs what its tile's end does (cheap inside a CPU
    tile: tried, then learnt), on the line between the timed widths around it; past the
    widest timed, the line through the widest two (never falling); the steady timings price
    only the widths asked for."""
    curve = CostCurve({1: 1.0, 2: 1.5, 4: 2.0, 8: 3.0, 16: 5.0}, steady={1: 0.5, 2: 1.2})
    table = curve.table(20)
    assert table[:9] == [0.0, 1.0, 1.5, 2.0, 2.0, 3.0, 3.0, 3.0, 3.0]
    assert table[9:17] == [4.0] * 4 + [5.0] * 4  # 12 rows: halfway from 8 to 16
    assert table[17:] == pytest.approx([5.25, 5.5, 5.75, 6.0])
    assert curve.table(4, steady=[1])[:3] == [0.0, 0.5, 1.5]
    assert CostCurve({1: 2.0, 8: 1.0}).table(10)[9:] == [1.0, 1.0]  # a line never falls
    assert CostCurve.from_json(curve.as_json()) == curve
    with pytest.raises(ValueError):
        CostCurve({2: 1.0})


def test_an_engine_times_its_curve_once_and_every_table_reads_it(dense_model: Path) -> None:
    """One curve of the probe widths that fit the target's output rows: the suffix drafter's
    one-slot table and (with several slots) the row budget's steps both read it."""
    with open_engine(dense_model, SpecMethod.SUFFIX, draft_max=30) as engine:
        assert engine.suffix is not None and engine.curve is not None
        assert sorted(engine.curve.timed) == [w for w in PROBE_WIDTHS if w <= 31]
        seconds = engine.suffix.costs.seconds
        assert len(seconds) == 32 and seconds[0] == 0.0
        assert all(0 < seconds[r] <= seconds[r + 1] for r in range(1, 31))
        assert seconds == cap_wide(engine.curve.table(31))


def test_a_wide_width_is_never_priced_dearer_a_row_than_the_ladder_s_base() -> None:
    """A spike at load that priced 128 rows high would keep every long draft out for good
    (no verify of that width ever runs to correct it): past WIDER_FROM rows a width costs
    at most its share of WIDER_FROM rows' time, and no entry exceeds a wider one. Tables
    that end at WIDER_FROM or below only get the latter."""
    top = 2 * WIDER_FROM
    timed = [0.0] + [0.3 * r + 1.0 for r in range(1, top + 1)]
    timed[top] = 3.0 * timed[WIDER_FROM]  # the spike
    for r in range(WIDER_FROM + 1, top):
        timed[r] = timed[top]  # untimed counts carry the next timed one's cost
    capped = cap_wide(timed)
    assert capped[:WIDER_FROM + 1] == timed[:WIDER_FROM + 1]
    assert capped[top] == pytest.approx(2 * timed[WIDER_FROM])
    assert all(capped[r] <= capped[WIDER_FROM] * r / WIDER_FROM + 1e-12
               for r in range(WIDER_FROM, top + 1))
    assert all(capped[r] <= capped[r + 1] for r in range(1, top))
    short = [0.0, 1.0, 3.0, 2.5, 4.0]
    assert cap_wide(short) == [0.0, 1.0, 2.5, 2.5, 4.0]


def test_row_costs_between_refits_stay_within_the_refit_shift_of_the_exact_table() -> None:
    """The whole table is recomputed only when the load's line moved by REFIT_SHIFT or every
    REFIT_EVERY verifies; in between every price stays within REFIT_SHIFT of what a refit
    on every verify gives, the observed width's own entry exactly follows its residual, and
    ``floor_from`` is always the cheapest price from each width on."""
    rng = random.Random(5)
    idle = [0.0] + [10.0 + 2.0 * r + (3.0 if r % 8 == 1 else 0.0) for r in range(1, 41)]
    costs = RowCosts(idle)
    for step in range(2000):
        rows = rng.choice((1, 1, 1, 2, 5, 9, 17, 33, 40))
        load = 3.0 if step > 1000 else 0.0
        costs.observe(rows, idle[rows] * rng.uniform(0.97, 1.05) + load + 0.2 * rows)
        exact = copy.deepcopy(costs)
        exact._refit(*exact.load())
        assert costs.seconds[rows] == pytest.approx(
            exact.seconds[rows], rel=REFIT_SHIFT, abs=REFIT_SHIFT * idle[1])
        for r in range(1, len(idle)):
            assert costs.seconds[r] == pytest.approx(
                exact.seconds[r], rel=REFIT_SHIFT, abs=REFIT_SHIFT * idle[1]), (step, r)
            assert costs.floor_from[r] == min(costs.seconds[r:]), (step, r)
