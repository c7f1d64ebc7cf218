"""What a verify of ``r`` rows costs on this model and device, measured and kept current.

The draft-length decision weighs expected accepted tokens against verify rows, so it needs
the price of a row where the engine runs: on a CPU with Gemma's 262k-vocabulary output layer
a second row nearly doubles a decode, on a GPU rows are nearly free. The table starts from
decodes timed at load (the minimum over :data:`CALIBRATION_REPS` interleaved repeats: load
spikes only ever add time) and is then re-measured for free by the verify decodes the engine
runs anyway: each observation pulls its row count's entry down at once when it is faster and
up only by a fraction :data:`RISE` when it is slower, so one spike barely moves it while a
lasting change of load, context length or clock is followed within a few dozen steps.
"""

from __future__ import annotations

from worker.engine.verify_shape import measure_costs
from worker.llm import Batch, Context

#: Timing repeats per row count at load.
CALIBRATION_REPS = 3
#: How far a slower observation moves its entry (a faster one replaces it).
RISE = 0.05
#: Every row count up to this is timed at load; wider ones every :data:`WIDE_STEP` rows.
NARROW_ROWS = 17
WIDE_STEP = 8


def calibrated_widths(max_rows: int) -> list[int]:
    """Row counts timed at load: all narrow ones (where tile effects make neighbours differ
    most), then a sparse ladder, so a capacity of 64 drafts costs a few seconds, not tens; the
    counts between get the next wider one's cost until a verify of that width measures them."""
    ladder = range(NARROW_ROWS + WIDE_STEP, max_rows + WIDE_STEP, WIDE_STEP)
    return [*range(1, min(NARROW_ROWS, max_rows) + 1), *(min(w, max_rows) for w in ladder)]


class RowCosts:
    """``seconds[r]``: the current cost of an ``r``-row verify decode (``seconds[0] = 0``).

    One instance per engine, shared by every generation: what one request measured serves the
    next.
    """

    def __init__(self, seconds: list[float]) -> None:
        if len(seconds) < 2 or seconds[0] != 0.0 or min(seconds[1:]) <= 0.0:
            raise ValueError(f"row costs must be [0, positive...], got {seconds}")
        self.seconds = list(seconds)

    @classmethod
    def measure(cls, target: Context, batch: Batch, max_rows: int) -> RowCosts:
        """Time 1..``max_rows``-row decodes on an idle ``target`` (it is cleared afterwards).

        A row count timed during a spike would look dearer than a wider verify, never be
        chosen, and so never be re-measured; since more rows are never cheaper to compute, no
        entry is kept above the next wider one (tile effects make a few widths slightly
        cheaper than their narrower neighbours: those are re-measured as soon as they run).
        """
        seconds = measure_costs(target, batch, max_rows, CALIBRATION_REPS,
                                calibrated_widths(max_rows))
        for rows in range(max_rows - 1, 0, -1):
            seconds[rows] = min(seconds[rows], seconds[rows + 1])
        return cls(seconds)

    @classmethod
    def measure_steps(cls, target: Context, batch: Batch, slots: int,
                      draft_max: int) -> RowCosts:
        """Costs of verify decodes of 1 .. ``slots`` x (``draft_max`` + 1) rows, for the row
        budget of steps with several slots (:mod:`worker.engine.row_budget`).

        A wide table cannot be timed row by row at load (520 rows for 8 slots of 64 drafts),
        so the widths a step of S slots typically decodes are timed (1, 2, S x 2^k and the
        top) and the counts between them are interpolated linearly. Not the next wider one's
        cost: that makes every count just past a timed one look dearer than it is, the
        goodput rule never chooses it, and so no step ever measures it. Interpolated entries
        are corrected by the first verifies that run at their width."""
        top = slots * (draft_max + 1)
        timed = sorted({1, 2, top, *(slots * 2**k for k in range(top.bit_length())
                                     if slots * 2**k < top)})
        seconds = measure_costs(target, batch, top, widths=timed)
        for lo, hi in zip(timed, timed[1:], strict=False):
            for rows in range(lo + 1, hi):
                seconds[rows] = seconds[lo] + (seconds[hi] - seconds[lo]) * (rows - lo) / (hi - lo)
        for rows in range(top - 1, 0, -1):
            seconds[rows] = min(seconds[rows], seconds[rows + 1])
        return cls(seconds)

    def observe(self, rows: int, seconds: float) -> None:
        """A verify decode of ``rows`` rows just took ``seconds``."""
        if not 0 < rows < len(self.seconds) or seconds <= 0.0:
            return
        current = self.seconds[rows]
        self.seconds[rows] = seconds if seconds < current else current + RISE * (seconds - current)

    def relative(self) -> list[float]:
        """Costs as multiples of a one-row decode (what logs and docs show)."""
        one = self.seconds[1]
        return [round(s / one, 2) for s in self.seconds]
