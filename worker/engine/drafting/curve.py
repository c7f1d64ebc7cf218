"""What a verify of ``r`` rows costs on this model, device, build and thread count: one curve,
timed once, from which every table that prices rows is read.

Every draft decision prices rows (the suffix drafter's one-slot lengths, the row budget's
multi-slot widths, the verify shape), and each used to time its own table at load: the same
decodes of ``r`` rows on an empty context, three times over, which made a Gemma 270M worker
ready 16 s after launch at ``--slots 4`` and 430 s at ``--slots 8 --draft-max 64`` (the step
table timed 272 decodes of up to 520 rows). They time one thing, and it is simple past a few
tiles: on a 2-core CPU every row past ~16 costs the same (5.2-5.8 ms on Gemma, up to 520
rows), and the cost does not depend on the slot count or the context size (within 4 % at 4k,
131k and 262k cells); it depends on the model, the build's kernels, the CPU and the threads.

So a worker times :data:`PROBE_WIDTHS` once (every count to two tiles' end, where neighbours
differ most, then 12, 16 and 32 rows), after one untimed decode of the widest (a new width's
first decode grows the output buffer, ~25 % slow), and keeps the curve on disk keyed by what
it depends on (:mod:`worker.engine.drafting.cache`): a restart or a scale-up reads it instead
(~1 s saved on Gemma's CPU worker). A count not timed is priced at its tile's end
(:data:`TILE`), on the line between the timed widths around it, and past 32 rows on the line
through 16 and 32. On a CPU a count inside a tile runs dearer than the tile's end, so that
estimate errs cheap: the width is tried, and :class:`~worker.engine.drafting.costs.RowCosts`
learns its price from the verifies that run it (a width priced too dear would never run, and
never be corrected).

On a device that replays a repeated decode's graph (a GPU), the widths plain decoding runs
step after step are also timed *steady* (the second of two decodes in a row), every width
after another shape, as a verify runs (NVIDIA H200, Gemma 270M: one row 1.16 ms steady,
2.26 ms after another shape).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from time import perf_counter

from worker.llm import Batch, Context

#: The row counts a curve times: every count to two tiles (a CPU's quantized products take
#: rows four at a time, so 5-7 rows can cost more than 8), then sparse widths to where every
#: further row costs the same.
PROBE_WIDTHS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 32)
#: Rows a CPU's quantized products take at once: a count inside a tile costs about what the
#: tile's end does (Gemma 270M, 4 slots: 5-7 rows 58-68 ms, 8 rows 51 ms), so an untimed
#: count is priced at its tile's end (cheap, if anything: tried, then learnt).
TILE = 4
#: The widths also timed steady on a device that replays graphs: a row per busy slot.
STEADY_WIDTHS = tuple(range(1, 9))


@dataclass
class CostCurve:
    """Seconds of a decode of ``r`` rows with logits on every row, on an empty context:
    ``timed[r]`` after a decode of another width (as a verify runs), ``steady[r]`` as the
    second of two decodes of ``r`` rows in a row (as plain decoding runs on a device that
    replays graphs; empty elsewhere)."""

    timed: dict[int, float]
    steady: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if 1 not in self.timed or min(self.timed.values(), default=0.0) <= 0.0:
            raise ValueError(f"a cost curve needs positive timings from 1 row: {self.timed}")

    def table(self, max_rows: int, steady: Collection[int] = ()) -> list[float]:
        """``seconds[r]`` for ``r = 0 .. max_rows`` (``seconds[0] = 0``): a timed width's own
        (its steady timing for the widths in ``steady``, where one was taken); a width not
        timed what its tile's end costs (:data:`TILE`), timed or on the line between the
        timed widths around it; past the widest timed, the line through the widest two
        (never falling)."""
        widths = sorted(self.timed)
        table = [0.0] + [self._at(rows, widths) for rows in range(1, max_rows + 1)]
        for rows in steady:
            if 0 < rows <= max_rows and rows in self.steady:
                table[rows] = self.steady[rows]
        return table

    def _at(self, rows: int, widths: list[int]) -> float:
        if rows in self.timed:
            return self.timed[rows]
        widest = widths[-1]
        if rows > widest:
            below = widths[-2] if len(widths) > 1 else widest
            slope = (max(0.0, (self.timed[widest] - self.timed[below]) / (widest - below))
                     if below < widest else 0.0)
            return self.timed[widest] + slope * (rows - widest)
        end = min(widest, -(-rows // TILE) * TILE)  # a partial tile costs the whole one
        if end in self.timed:
            return self.timed[end]
        above = next(w for w in widths if w > end)
        below = max((w for w in widths if w < end), default=above)
        if below == above:
            return self.timed[above]
        share = (end - below) / (above - below)
        return self.timed[below] + share * (self.timed[above] - self.timed[below])

    def as_json(self) -> dict[str, dict[str, float]]:
        return {"timed": {str(r): s for r, s in self.timed.items()},
                "steady": {str(r): s for r, s in self.steady.items()}}

    @classmethod
    def from_json(cls, data: Mapping[str, Mapping[str, float]]) -> CostCurve:
        return cls({int(r): float(s) for r, s in data["timed"].items()},
                   {int(r): float(s) for r, s in data.get("steady", {}).items()})


def time_decodes(target: Context, batch: Batch, widths: Iterable[int],
                 steady: Collection[int] = (), reps: int = 1) -> dict[int, float]:
    """Seconds of a ``w``-row decode with logits on every row, for each of ``widths``
    (the minimum over ``reps`` passes: load only ever adds time), on an idle ``target``:
    sequence 0 is emptied before each decode (clearing the whole cache instead zeroed every
    cell, 2-22 ms a decode at 8 slots), the whole cache once afterwards. The widths in
    ``steady`` are timed as the second of two decodes in a row; every other one right after
    a decode of another width. Each decode is waited for
    (:meth:`~worker.llm.Context.synchronize`: a GPU's ``llama_decode`` returns once its work
    is queued)."""
    order = sorted(set(widths))
    seconds = {w: float("inf") for w in order}
    for _ in range(reps):
        for rows in order:
            for _ in range(2 if rows in steady else 1):
                seqs = _fill(batch, rows, target.spec.n_outputs_max_per_seq, target.spec.n_seq_max)
                for seq in range(seqs):
                    target.seq_clear(seq)
                t0 = perf_counter()
                target.decode(batch)
                target.synchronize()
                took = perf_counter() - t0
            seconds[rows] = min(seconds[rows], took)
    target.clear()
    return seconds


def _fill(batch: Batch, rows: int, per_seq: int, seqs: int) -> int:
    """``batch`` holding ``rows`` dummy rows with logits, at most ``per_seq`` a sequence (a
    target sampled on the device caps a sequence's rows: ``ContextSpec.n_outputs_max_per_seq``;
    0: no cap), as a verify of several slots spreads them; returns the sequences used."""
    batch.clear()
    per_seq = per_seq or rows
    used = 0
    while used * per_seq < rows and used < seqs:
        batch.add([0] * min(per_seq, rows - used * per_seq), 0, True, seq=used)
        used += 1
    return used


def measure_curve(target: Context, batch: Batch, max_rows: int,
                  replays: bool = False) -> CostCurve:
    """Time the curve on an idle ``target`` whose batch holds ``max_rows`` rows: the
    :data:`PROBE_WIDTHS` that fit (and the widest that fits, if none of them is), narrowest
    first after an untimed decode of the widest (which grows the output buffer once, and
    is not the width timed next: on a device that replays graphs, a width timed right after
    itself would be priced steady), and there the :data:`STEADY_WIDTHS` steady as well."""
    widths = [w for w in PROBE_WIDTHS if w <= max_rows] or [max_rows]
    widest = max(widths)
    time_decodes(target, batch, [widest])  # grows the output buffer: not timed
    timed = time_decodes(target, batch, widths)
    steady = (time_decodes(target, batch, [w for w in STEADY_WIDTHS if w <= max_rows],
                           steady=STEADY_WIDTHS) if replays else {})
    return CostCurve(timed, steady)
