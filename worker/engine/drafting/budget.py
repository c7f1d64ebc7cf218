"""How many draft rows one step of several slots should verify, from measured row costs.

Every verified row pays for the output layer (on a CPU with Gemma's 262k vocabulary, most of
a row's cost). Alone, a slot's draft rows ride on a decode whose fixed cost (reading the
weights) dominates, so even a 50% draft pays. With S slots in one batch the fixed cost is
shared by S plain rows already, and a draft row only pays when its chance of being accepted
beats what the same time buys as plain rows: the threshold rises with S (notes: llama-server's
ngram-mod gains less from ``-np 8`` than plain decoding does). So each step verifies, of all
the slots' draft rows together, the likeliest ones up to the total with the most expected
committed tokens per second (:func:`plan_widths`); the rest are trimmed (never changes
output: a shorter draft verifies the same tokens).

A row's chance is the drafter's own calibrated confidence where it has one (the suffix
drafter's, per evidence cell), else its slot's own record at that draft position: the share
of verifies that drafted position ``m`` and accepted it (which needs every position before it
accepted too), shrunk towards what earlier requests of the same method did there (an
optimistic guess before any request finished), so a new request starts from experience and
still drafts enough to be measured.
"""

from __future__ import annotations

from collections.abc import Sequence

from worker.engine.core.draft import Draft
from worker.engine.core.telemetry import SpecCounters
from worker.engine.drafting.width import PLAIN_BAR

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


def draft_chances(draft: Draft, counters: SpecCounters,
                  before: SpecCounters | None = None) -> list[float]:
    """Chance that each position of ``draft`` is accepted: the running product of the
    drafter's confidences when it gave them, else the slot's record (:func:`reach`)."""
    if draft.confidences is None:
        return reach(counters, len(draft.tokens), before)
    chances, level = [], 1.0
    for p in draft.confidences:
        level *= p
        chances.append(level)
    return chances


def plan_widths(chances: Sequence[Sequence[float]], costs: Sequence[float],
                bar: float = PLAIN_BAR) -> list[int]:
    """Draft rows to verify per slot, decided for all busy slots together: the split that
    maximises the step's goodput, expected committed tokens per second (SmartSpec's rule).

    ``chances[i][m]`` is slot i's chance that its draft position m + 1 is accepted (its draft
    is ``len(chances[i])`` long); ``costs[r]`` the seconds of an r-row verify decode at the
    batch the step really runs, every slot's rows together (``costs[0] = 0``). Every slot
    keeps its plain row (that token always comes). A slot's row m only counts when its rows
    before it are accepted, so its chances are made non-increasing and taken in order; for
    each total R the likeliest ``R - slots`` draft rows are the best R rows, and the R with
    the most tokens per second wins (ties: fewer rows) if it beats the plain rows alone by
    the factor ``bar``, at least
    :data:`~worker.engine.drafting.width.PLAIN_BAR`: the rows taken are the
    likeliest-looking of every slot's draft, so their chances err high as one slot's do (and
    the engine's :class:`~worker.engine.drafting.bar.DraftBar` raises it further where drafted
    steps yield less than the costs promised). The
    cost table is searched whole, not
    climbed row by row, so a tile step in the costs (rows 5..8 costing what 8 do) cannot stop
    the search at its foot.

    Batch size enters through ``costs`` alone: a row that pays beside one plain row (a decode
    that mostly reads weights) does not beside eight, whose plain rows already share that
    fixed cost, and where rows grow dearer with the batch (compute-bound) the bar rises
    further. Drafting nothing at high load (vLLM's disable-by-batch-size) is the case where no
    draft row beats the step's tokens per row.
    """
    slots = len(chances)
    widths = [0] * slots
    if slots == 0 or slots >= len(costs):
        return widths
    rows: list[tuple[float, int, int]] = []
    for i, chance in enumerate(chances):
        level = 1.0
        for m, p in enumerate(chance):
            level = min(level, p)
            rows.append((-level, m, i))
    rows.sort()
    del rows[len(costs) - 1 - slots:]
    tokens = float(slots)
    best, best_rate = 0, bar * tokens / costs[slots]
    for k, (gain, _, _) in enumerate(rows, start=1):
        tokens -= gain
        rate = tokens / costs[slots + k]
        if rate > best_rate:
            best, best_rate = k, rate
    for _, _, i in rows[:best]:
        widths[i] += 1
    return widths
