"""Which draft lengths are worth verifying, from the target's own measured cost per batch width
(its cost curve, :mod:`worker.engine.drafting.curve`).

A verify of ``n`` drafts is a decode of ``n + 1`` rows with logits on every row, and its cost
is not linear in the rows: on CPU builds the matmul kernels process columns in tiles, so an
odd row count can cost more than the next even one (Gemma 270M Q4_K_M, one thread: 4 rows
2.7x a single row, 5 rows 4.1x, 16 rows 6.3x, 17 rows 7.9x). Verifying 15 drafts instead of 16
then buys more tokens per second even when all 16 would have been accepted. Where the
curve is flat (expected on GPUs for these widths; not measured here) the shape comes out as
the identity.
"""

from __future__ import annotations


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
