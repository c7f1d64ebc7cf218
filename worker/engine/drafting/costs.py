"""What a verify of ``r`` rows costs on this model and device, kept current while serving.

The draft-length decision weighs expected accepted tokens against verify rows, so it needs
the price of a row where the engine runs: on a CPU with Gemma's 262k-vocabulary output layer
a second row nearly doubles a decode, on a GPU rows are nearly free. A table starts from the
engine's cost curve (:mod:`worker.engine.drafting.curve`: decodes timed once on an empty context,
or read from the worker's cache), which gives its shape (the CPU's tile steps). A real verify
runs dearer than that, the wider the more so: its rows attend what is cached (one slot of
200-300 tokens: 1 row +5 %, 16 rows +20-30 %; 8 slots of 150-600 tokens: 6-39 % at 8-32
rows). So every verify the engine runs anyway, whatever its width, refits one line for what
the load adds (:meth:`RowCosts.observe`), and every width is priced at the current load, the
widths seldom run included; a width that runs also learns its own residual, which is how a
width the curve did not time (priced as the next wider one timed: cheap, so it is tried)
gets its price.
"""

from __future__ import annotations

import numpy as np

from worker.engine.drafting.curve import CostCurve
from worker.engine.drafting.width import cheapest_from

#: From this count on, no width may cost more a row than this many rows do (:func:`cap_wide`).
WIDER_FROM = 64


def no_dearer_than_wider(seconds: list[float]) -> list[float]:
    """A timed table with no entry above a wider one: a spike at load only ever adds time,
    and an entry kept above a wider one would never be chosen (tile effects make a few
    widths slightly cheaper than their narrower neighbours, which then cost what the wider
    one does)."""
    out = list(seconds)
    for rows in range(len(out) - 2, 0, -1):
        out[rows] = min(out[rows], out[rows + 1])
    return out


def cap_wide(seconds: list[float]) -> list[float]:
    """A timed table made safe to plan with: no width past :data:`WIDER_FROM` rows dearer a
    row than :data:`WIDER_FROM` rows, then :func:`no_dearer_than_wider`.

    Past 64 rows a verify only got cheaper a row at every depth measured (Gemma 270M Q4_K_M,
    AVX-512, 2 threads, as a share of a one-row decode, 64 -> 128 rows: empty context 0.272 ->
    0.255, 450 deep 0.305 -> 0.266, 1500 deep 0.287 -> 0.244), while one table timed at load
    priced 128 rows at 0.30 where those say 0.25-0.27. A width priced high is never
    drafted, so no verify ever corrects it (:meth:`RowCosts.observe` learns from what
    runs); capped, it is tried, and its own residual then follows what it costs."""
    out = list(seconds)
    base = min(WIDER_FROM, len(out) - 1)
    for rows in range(base + 1, len(out)):
        out[rows] = min(out[rows], out[base] * rows / base)
    return no_dearer_than_wider(out)


#: Each observed verify's weight in the load fit decays by this factor per later one: the fit
#: follows about the last fifty.
DECAY = 0.98
#: The fit's slope is shrunk to 0 by this many (rows^2 x verifies): while the verifies seen
#: all had one width, the load adds the same seconds to every row count.
SLOPE_PRIOR = 64.0
#: How far one verify moves its own width's residual from the load's line (an exponential
#: average: a spike moves it a share, a lasting difference is followed within a few verifies).
RESIDUAL_RATE = 0.2
#: The whole table is recomputed once the load's line moved by this share of the one-row
#: or the widest price since it last was (:meth:`RowCosts.observe`) ...
REFIT_SHIFT = 0.01
#: ... or after this many verifies.
REFIT_EVERY = 8
#: A prediction is never below this share of the idle table (the load fit may go negative
#: when the host got faster after load, never so far as a free row).
FLOOR = 0.5


class RowCosts:
    """``seconds[r]``: the current cost of an ``r``-row verify decode (``seconds[0] = 0``):
    the idle table timed at load plus what the current load adds, fitted online.

    One instance per engine and use (one slot's verifies: the suffix drafter's; steps of
    several slots: the row budget's), shared by every generation: what one request measured
    serves the next. Following each row count's own observations instead (as this table did
    before) left the plain width's entry current, since it runs every step, and the wide
    ones near their idle cost, since each runs now and then: drafting looked cheaper than it
    ran, by 20-30 % at one slot and 15-53 % at eight, against the plain rows it displaced.
    The load's line is ``extra = a + b * rows``, least squares over the recent verifies
    (weights decay by :data:`DECAY` a verify), the slope shrunk towards 0
    (:data:`SLOPE_PRIOR`) and never below it (more rows never cost less). A width that runs
    also keeps its own residual from that line (:data:`RESIDUAL_RATE`): the tile steps move
    with the context (Gemma 270M on an AVX-512 CPU: at load 25 rows cost 0.85x what 33 do,
    a quote 700 tokens deep ran them alike, 130-150 ms), and the line alone priced the 33-row
    verify 20 % over what it ran, so the drafter kept drafting 24 instead of 32.
    """

    def __init__(self, idle: list[float]) -> None:
        if len(idle) < 2 or idle[0] != 0.0 or min(idle[1:]) <= 0.0:
            raise ValueError(f"row costs must be [0, positive...], got {idle}")
        self.idle = list(idle)
        self.seconds = list(idle)
        #: ``floor_from[r]``: the cheapest verify of ``r`` or more rows, as the table stands
        #: (what lets a drafter stop walking where no longer draft could pay).
        self.floor_from = cheapest_from(self.seconds)
        # Decayed sums of weight, rows, extra seconds, rows^2, rows x extra.
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self._residual = np.zeros(len(idle))
        self._idle = np.array(idle)
        self._idle_floor = FLOOR * self._idle
        self._rows = np.arange(len(idle), dtype=float)
        #: Seconds the observed verifies took, and what the table said each would take before
        #: it learned from it: how far the costs the drafts were planned with were off.
        self.observed = self.predicted = 0.0
        #: The line the whole table was last computed on, and verifies observed since.
        self._fitted = (0.0, 0.0)
        self._since_refit = 0

    @classmethod
    def for_one_slot(cls, curve: CostCurve, draft_max: int, replays: bool = False) -> RowCosts:
        """One slot's verifies of 1 .. ``draft_max`` + 1 rows (the suffix drafter's table),
        as :func:`cap_wide` makes it safe to plan with.

        ``replays``: the device replays a repeated decode's graph (``Model.offloaded``), so
        the plain row is priced as plain decoding runs it, steady; every verify width after
        another shape, as a verify runs. Priced like a verify there, the plain row cost what
        two draft rows do, and drafts that lost to plain decoding looked like gains
        (docs/benchmarks.md, "GPU, second run"). Not on a CPU, where nothing is replayed."""
        return cls(cap_wide(curve.table(draft_max + 1, steady={1} if replays else ())))

    @classmethod
    def for_steps(cls, curve: CostCurve, slots: int, draft_max: int,
                  replays: bool = False) -> RowCosts:
        """Steps of several slots: verifies of 1 .. ``slots`` x (``draft_max`` + 1) rows (the
        row budget's table), no entry above a wider one. Past the curve's widest timed width
        the rows follow its line: on a CPU every row past ~16 costs the same (Gemma 270M: 5.2-
        5.8 ms, up to 520 rows), where a table timed at load spent 417 s on 272 decodes of
        up to 520 rows to find it. ``replays`` as in :meth:`for_one_slot`: the plain steps'
        widths (a row per busy slot) are priced steady."""
        return cls(no_dearer_than_wider(curve.table(
            slots * (draft_max + 1), steady=range(1, slots + 1) if replays else ())))

    def observe(self, rows: int, seconds: float) -> None:
        """A verify of ``rows`` rows just took ``seconds``: refit the load, and the table.

        The whole table is recomputed when the load's line has moved by :data:`REFIT_SHIFT`
        of a price since it last was, or :data:`REFIT_EVERY` verifies ago; in between only
        the observed width's own entry follows (its residual moved). At one slot every verify
        is observed, and recomputing all 128 widths each time was the largest part of the
        suffix drafter's host time on steps that drafted nothing (~60 of ~230 us a step,
        Gemma 270M on the CPU)."""
        if not 0 < rows < len(self.idle) or seconds <= 0.0:
            return
        self.observed += seconds
        self.predicted += self.seconds[rows]
        extra = seconds - self.idle[rows]
        self._w = DECAY * self._w + 1.0
        self._x = DECAY * self._x + rows
        self._y = DECAY * self._y + extra
        self._xx = DECAY * self._xx + rows * rows
        self._xy = DECAY * self._xy + rows * extra
        a, b = self.load()
        residual = self._residual
        residual[rows] += RESIDUAL_RATE * (seconds - self.idle[rows] - a - b * rows
                                           - residual[rows])
        self._since_refit += 1
        fit_a, fit_b = self._fitted
        widest = len(self.idle) - 1
        if (self._since_refit >= REFIT_EVERY
                or abs(a - fit_a + (b - fit_b)) > REFIT_SHIFT * self.idle[1]
                or abs(a - fit_a + (b - fit_b) * widest) > REFIT_SHIFT * self.idle[widest]):
            self._refit(a, b)
            return
        # The line as last fitted, this width's residual as it is now.
        self.seconds[rows] = float(max(self._idle_floor[rows],
                                       self.idle[rows] + fit_a + fit_b * rows + residual[rows]))
        floor = self.floor_from
        for r in range(rows, 0, -1):  # the cheapest from r on, as far as it changed
            cheapest = min(self.seconds[r], floor[r + 1]) if r < widest else self.seconds[r]
            if cheapest == floor[r] and r < rows:
                break
            floor[r] = cheapest

    def _refit(self, a: float, b: float) -> None:
        """The whole table on the line ``a + b * rows`` and every width's residual."""
        table = np.maximum(self._idle_floor, self._idle + a + b * self._rows + self._residual)
        table[0] = 0.0
        self.seconds = table.tolist()
        self.floor_from = np.minimum.accumulate(table[::-1])[::-1].tolist()
        self._fitted = (a, b)
        self._since_refit = 0

    def load(self) -> tuple[float, float]:
        """The fitted extra seconds of a verify, ``(a, b)`` in ``a + b * rows``."""
        if self._w == 0.0:
            return 0.0, 0.0
        mean_x, mean_y = self._x / self._w, self._y / self._w
        spread = self._xx - self._w * mean_x * mean_x
        slope = max(0.0, (self._xy - self._w * mean_x * mean_y) / (spread + SLOPE_PRIOR))
        return mean_y - slope * mean_x, slope

    def relative(self) -> list[float]:
        """Costs as multiples of a one-row decode (what logs and docs show)."""
        one = self.seconds[1]
        return [round(s / one, 2) for s in self.seconds]
