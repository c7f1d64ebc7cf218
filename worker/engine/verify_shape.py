"""Which draft lengths are worth verifying, from the target's own measured cost per batch width.

A verify of ``n`` drafts is a decode of ``n + 1`` rows with logits on every row, and its cost
is not linear in the rows: on CPU builds the matmul kernels process columns in tiles, so an
odd row count can cost more than the next even one (Gemma 270M Q4_K_M, one thread: 4 rows
2.7x a single row, 5 rows 4.1x, 16 rows 6.3x, 17 rows 7.9x). Verifying 15 drafts instead of 16
then buys more tokens per second even when all 16 would have been accepted. Where the
curve is flat (expected on GPUs for these widths; not measured here) the shape comes out as
the identity.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from time import perf_counter

from worker.llm import Batch, Context

#: Timing repetitions per row count; the minimum is kept (load spikes only ever add time).
REPS = 2


def measure_costs(target: Context, batch: Batch, max_rows: int, reps: int = REPS,
                  widths: Sequence[int] | None = None,
                  steady: Collection[int] = ()) -> list[float]:
    """``costs[k]``: seconds of a ``k``-row decode with logits on every row (``costs[0] = 0``).

    Decodes dummy tokens at the start of an empty context and clears it again afterwards.
    ``widths`` (default: every row count) limits the timing to those row counts; a count
    between them gets the cost of the next wider one timed. That bounds it where cost rises
    with rows; on a CPU a count that ends inside a tile runs dearer than the tile's end
    (docs/benchmarks.md, "Partial tiles"), which the drafts seldom stop at.

    Each count is timed right after a decode of another count, as a verify runs, except the
    ``steady`` ones: those are timed as the second of two decodes in a row, as plain decoding
    runs them step after step. The caller says which
    (:meth:`~worker.engine.draft_cost.RowCosts.measure`): on a GPU the repeat replays a
    CUDA graph (NVIDIA H200, Gemma 270M Q4_K_M: one row 1.16 ms steady against 2.26 ms
    after another shape), on a CPU nothing is replayed.
    """
    timed = sorted({w for w in (widths or range(1, max_rows + 1)) if 0 < w < max_rows}
                   | {max_rows})
    costs = [0.0] + [float("inf")] * max_rows
    for _ in range(reps):
        for rows in timed:
            for _ in range(2 if rows in steady else 1):
                target.clear()
                t0 = perf_counter()
                target.decode(batch.set([0] * rows, 0, True))
                target.synchronize()  # a GPU's decode returns before its work is done
                seconds = perf_counter() - t0
            costs[rows] = min(costs[rows], seconds)
    target.clear()
    for rows in range(max_rows - 1, 0, -1):
        if rows not in timed:
            costs[rows] = costs[rows + 1]
    return costs


def best_lengths(costs: list[float]) -> list[int]:
    """``shape[n]``: how many of ``n`` drafted tokens to verify, for ``n = 0 .. len(costs) - 2``.

    The length ``m <= n`` with the most tokens per second if every draft were accepted,
    ``(m + 1) / costs[m + 1]`` (longer wins ties). Assuming full acceptance favours long
    drafts, so the shape only trims where a shorter verify is cheaper outright per token.
    """
    shape: list[int] = []
    best, best_rate = 0, 0.0
    for n in range(len(costs) - 1):
        rate = (n + 1) / costs[n + 1]
        if rate >= best_rate:
            best, best_rate = n, rate
        shape.append(best)
    return shape
