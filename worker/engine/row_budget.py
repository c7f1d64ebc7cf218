"""How many draft rows one step of several slots should verify, from measured row costs.

Every verified row pays for the output layer (on a CPU with Gemma's 262k vocabulary, most of
a row's cost). Alone, a slot's draft rows ride on a decode whose fixed cost (reading the
weights) dominates, so even a 50% draft pays. With S slots in one batch the fixed cost is
shared by S plain rows already, and a draft row only pays when its chance of being accepted
beats what the same time buys as plain rows: the threshold rises with S (notes: llama-server's
ngram-mod gains less from ``-np 8`` than plain decoding does). So each step adds draft rows
one at a time, the most likely accepted first, while they raise the step's expected tokens
per second; the rest are trimmed (never changes output: a shorter draft verifies the same
tokens).

A row's chance is its slot's own record at that draft position: the share of verifies that
drafted position ``m`` and accepted it (which needs every position before it accepted too),
shrunk towards what earlier requests of the same method did there (an optimistic guess
before any request finished), so a new request starts from experience and still drafts
enough to be measured.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from worker.engine.telemetry import SpecCounters

#: A position's chance before anything was measured there.
FIRST_GUESS = 0.8
#: Weight of the prior, in verifies: a slot's own record outweighs it after a few drafts.
PRIOR_TRIES = 5.0


def _share(counters: SpecCounters | None, m: int) -> tuple[float, float]:
    """(accepted, drafted) at draft position ``m`` (0-based) in ``counters``."""
    if counters is None or m >= len(counters.drafted_per_position):
        return 0.0, 0.0
    accepted = counters.accepted_per_position
    return float(accepted[m] if m < len(accepted) else 0), float(counters.drafted_per_position[m])


def reach(counters: SpecCounters, n: int, before: SpecCounters | None = None) -> list[float]:
    """Estimated chance that draft position ``m`` (1..n) is accepted, for one slot whose
    method did ``before`` in earlier requests."""
    chances = []
    for m in range(n):
        hits, tries = _share(before, m)
        prior = hits / tries if tries else FIRST_GUESS
        hits, tries = _share(counters, m)
        chances.append((PRIOR_TRIES * prior + hits) / (PRIOR_TRIES + tries))
    return chances


def plan_widths(chances: Sequence[Sequence[float]], costs: Sequence[float]) -> list[int]:
    """Draft rows to verify per slot: ``chances[i][m]`` is slot i's chance at position m + 1
    (its draft is ``len(chances[i])`` long); ``costs[r]`` the seconds of an r-row decode.

    Starts from one plain row per slot and takes the likeliest remaining draft row while the
    step's expected tokens per second rises; a slot's rows are taken in order.
    """
    rows = len(chances)
    tokens = float(rows)
    widths = [0] * rows
    heap = [(-c[0], i) for i, c in enumerate(chances) if c]
    heapq.heapify(heap)
    while heap and rows + 1 < len(costs):
        gain, i = heapq.heappop(heap)
        if (tokens - gain) * costs[rows] <= tokens * costs[rows + 1]:
            break
        tokens -= gain
        rows += 1
        widths[i] += 1
        if widths[i] < len(chances[i]):
            heapq.heappush(heap, (-chances[i][widths[i]], i))
    return widths
