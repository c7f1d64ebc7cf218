"""How wide the next draft may be (a fixed width, or the adaptive ceiling of docs/engine.md,
"Width policy"), and how much of a draft with known per-token confidences is worth
verifying.

The loop always asks a policy and always reports back, so turning adaptation on or off is a
choice of object, not an ``if adaptive`` in the per-token path.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate
from typing import Protocol

#: A ceiling-reaching draft that accepts fewer than this many tokens counts towards backoff.
BACKOFF_BELOW = 3
#: This many such drafts in a row lower the ceiling by one.
BACKOFF_STREAK = 2


class DraftLengthPolicy(Protocol):
    """Decides the draft width of the next step and learns from its outcome."""

    def width(self) -> int:
        """Width to ask the proposer for (the loop may cap it further for budget/context)."""
        ...

    def update(self, drafted: int, accepted: int) -> None:
        """The last step drafted ``drafted`` tokens and the target accepted ``accepted``."""
        ...


class FixedWidth:
    """Always the same width; learns nothing."""

    def __init__(self, width: int) -> None:
        self._width = width

    def width(self) -> int:
        return self._width

    def update(self, drafted: int, accepted: int) -> None:
        """Fixed: outcomes do not matter."""


class AdaptiveWidth:
    """The rule of docs/engine.md, "Width policy": start at ``draft_max``; two consecutive
    drafts that reached the ceiling and accepted fewer than 3 lower it by one; a fully
    accepted ceiling-reaching draft raises it by one; never above ``draft_max``, never
    below 1.

    A draft shorter than the ceiling was cut short (p-min, no n-gram continuation, token or
    context limit, a failed draft decode) and says nothing about the ceiling, so it neither
    counts nor breaks a streak. "The ceiling" is as the verify shape trims it
    (:mod:`worker.engine.drafting.shape`): with ``shape[16] = 15``, a 15-token draft reached it.
    """

    def __init__(self, draft_max: int, shape: list[int] | None = None) -> None:
        self.draft_max = draft_max
        self.ceiling = draft_max
        self._shape = shape or list(range(draft_max + 1))
        self._streak = 0

    def width(self) -> int:
        return self.ceiling

    def update(self, drafted: int, accepted: int) -> None:
        if drafted < self._shape[self.ceiling]:
            return
        if accepted == drafted:
            self.ceiling = min(self.ceiling + 1, self.draft_max)
            self._streak = 0
        elif accepted < BACKOFF_BELOW:
            self._streak += 1
            if self._streak == BACKOFF_STREAK:
                self.ceiling = max(self.ceiling - 1, 1)
                self._streak = 0
        else:
            self._streak = 0


#: A slot whose drafts the row budget cut to nothing this many steps in a row skips its
#: drafter for as many steps (doubling, up to :data:`MAX_SKIP`), then asks it again.
MAX_SKIP = 8
#: A drafter that proposed nothing this many times in a row when asked is not asked for 1,
#: 2, then :data:`MAX_IDLE_SKIP` steps after each further empty proposal in a row (one empty
#: proposal is common between short drafts: CSV records rewritten as JSON) ...
IDLE_AFTER = 2
#: ... at most this many steps: how late it may find a repeat that started.
MAX_IDLE_SKIP = 4


class BudgetedWidth:
    """A slot's width policy as the step lets it draft: its drafter is not asked at all for a
    while (width 0), then asked again, where asking it has been in vain, in two ways.

    - **The row budget cut its drafts to nothing.** Where extra rows cost what plain ones do
      (Gemma 270M on a 2-core CPU at eight slots: 8 rows 65 ms, 16 rows 123 ms), the budget
      grants almost no draft, and every slot's drafter still looked its history up and
      walked a draft each step: 1,435 of 1,466 suffix drafts cut, 120-150 us of host time
      each, three times plain decoding's host time a token. Skips 1, 2, 4, 8 steps.
    - **The drafter proposed nothing,** where the host's work is a large share of a step
      (a GPU's fast decode: the planner's ``idle_skip``). On prose a suffix drafter finds a context
      and walks it at every step, and its confidences rarely pay for a row: at one slot 331
      of 358 lookups drafted nothing, 90 us each, where a plain step's whole host work is
      150 us (Gemma 270M, the slots bench's mixed tasks). From its second empty proposal in
      a row it skips 1, 2, then 4 steps while it stays empty, so a repeat that starts is
      drafted at most :data:`MAX_IDLE_SKIP` steps late. Where the decode dominates (a CPU:
      host work 1-3% of a step) the drafts it would miss cost more than the lookups it
      saves (CSV rewritten as JSON, cold, Gemma on the CPU: 1.03-1.13x plain skipping
      against 1.21-1.27x asking), so there it is always asked.

    A draft that is kept, or a proposal that is not empty, restores asking at every step. A
    sampled request's head drafts are never skipped for proposing nothing (``idle_skips``
    False): which positions are drafted decides its tokens.
    Where the budget grants drafts (a GPU, a copy), nothing is skipped."""

    def __init__(self, policy: DraftLengthPolicy, idle_skips: bool = True) -> None:
        self.policy = policy
        #: False: never skipped for proposing nothing (a CPU's planner, a sampled request's
        #: head drafts: :meth:`DraftPlanner.policy`).
        self._idle_skips = idle_skips
        self._cut = 0    # drafts cut to nothing in a row
        self._idle = 0   # empty proposals in a row
        self._skip = 0   # steps left without asking the drafter
        self._asked = False  # the last width() asked the drafter

    def width(self) -> int:
        if self._skip:
            self._skip -= 1
            self._asked = False
            return 0
        self._asked = True
        return self.policy.width()

    def update(self, drafted: int, accepted: int) -> None:
        self.policy.update(drafted, accepted)

    def proposed(self, drafted: int) -> None:
        """The drafter proposed ``drafted`` tokens of its own this step (the grammar's forced
        run not counted); a step it was not asked in says nothing."""
        if not self._asked:
            return
        if drafted:
            self._idle = 0
            return
        self._idle = min(self._idle + 1, IDLE_AFTER + MAX_IDLE_SKIP.bit_length() - 1)
        if self._idle_skips and self._idle >= IDLE_AFTER:
            self._skip = max(self._skip, min(1 << (self._idle - IDLE_AFTER), MAX_IDLE_SKIP))

    def granted(self, asked: int, width: int) -> None:
        """The budget cut this slot's ``asked``-token draft to ``width`` tokens."""
        if not asked:
            return
        if width:
            self._cut = 0
            return
        self._cut = min(self._cut + 1, MAX_SKIP.bit_length())
        self._skip = min(1 << (self._cut - 1), MAX_SKIP)


def make_policy(draft_max: int, adaptive: bool, shape: list[int]) -> DraftLengthPolicy:
    """The width policy for one generation (``draft_max`` 0 = plain decoding)."""
    if adaptive and draft_max > 0:
        return AdaptiveWidth(draft_max, shape)
    return FixedWidth(draft_max)


#: How much more a draft must promise than a plain step, in tokens per second. The drafts
#: verified are the ones whose estimated chances came out highest, so those estimates err
#: high (the optimizer's curse), most where the evidence is thin: a request unlike the ones
#: that calibrated the cells bets on every draft that barely looks worth it and loses them
#: (Gemma 270M, CSV rows continued as bare text after a copy task: 5 drafts of 8-16 rows,
#: 4 of 43 tokens accepted, 0.8x plain). A margin gives up only gains as small as itself.
PLAIN_MARGIN = 0.1
#: The factor a draft's predicted rate must beat a plain step's by, before anything was
#: measured: the draft bar's floor (:class:`~worker.engine.drafting.bar.DraftBar`).
PLAIN_BAR = 1.0 + PLAIN_MARGIN


def best_draft_length(confidences: Sequence[float], row_seconds: Sequence[float],
                      bar: float = PLAIN_BAR) -> int:
    """How many of the drafted tokens to verify: the length with the most expected tokens per
    second of verify, if that beats a plain step's by the factor ``bar`` (at least
    :data:`PLAIN_MARGIN` more; the engine's :class:`~worker.engine.drafting.bar.DraftBar` raises
    it where drafted steps yield less than the costs promised).

    ``confidences[i]`` is the probability that draft token ``i`` is accepted given that all
    before it were; ``row_seconds[r]`` is what a verify of ``r`` rows costs (index 0 unused).
    Verifying ``m`` drafts decodes ``m + 1`` rows and yields ``1 + sum_{i<m} P(first i+1
    accepted)`` tokens (the bonus always comes); ``m = 0`` is a plain step. The longest
    length with a measured cost bounds ``m``; ties go to the shorter draft, which risks less.
    """
    chooser = DraftLength(row_seconds, bar)
    for p in confidences:
        if not chooser.add(p):
            break
    return chooser.best


class DraftLength:
    """:func:`best_draft_length` one confidence at a time, for a drafter that walks its draft
    token by token: :meth:`add` says when no longer draft could be chosen any more, so the
    walk stops there instead of walking the whole width and throwing the tail away (the
    suffix drafter walked ~26 tokens a step at one slot, most of its host time, where the
    bar let it keep none).

    ``floor_from[r]``: the least a verify of ``r`` or more rows costs (default: computed
    from ``row_seconds``); a longer draft's rate is bounded by every further token accepted
    for sure at that cost."""

    def __init__(self, row_seconds: Sequence[float], bar: float = PLAIN_BAR,
                 floor_from: Sequence[float] | None = None) -> None:
        self._seconds = row_seconds
        self._floor = floor_from if floor_from is not None else cheapest_from(row_seconds)
        #: The most drafts a measured cost covers (``m`` drafts decode ``m + 1`` rows).
        self._limit = len(row_seconds) - 2
        self.best = 0
        self._best_rate = bar / row_seconds[1]
        self._m = 0
        self._expected = 1.0
        self._reach = 1.0

    def add(self, p: float, left: int | None = None) -> bool:
        """The next draft token is accepted with probability ``p`` (given all before it
        were); ``left``: how many more tokens the walk could still add after it (None: up to
        the table's limit). False once neither this length nor any longer one can be
        :attr:`best`: the walk may stop."""
        m = self._m + 1
        if m > self._limit:
            return False
        self._m = m
        self._reach *= p
        self._expected += self._reach
        rate = self._expected / self._seconds[m + 1]
        if rate > self._best_rate:
            self.best, self._best_rate = m, rate
        more = self._limit - m if left is None else min(left, self._limit - m)
        # Every further token at most certain, at the cheapest width any of them reaches.
        return more > 0 and (self._expected + self._reach * more) / self._floor[m + 2] > \
            self._best_rate


def cheapest_from(row_seconds: Sequence[float]) -> list[float]:
    """``out[r]``: the cheapest verify of ``r`` or more rows (a learnt table need not rise
    with the rows everywhere: :class:`~worker.engine.drafting.costs.RowCosts` keeps a
    residual per width)."""
    return list(accumulate(reversed(row_seconds), min))[::-1]


def expected_tokens(confidences: Sequence[float]) -> float:
    """Tokens a verify of the whole draft is expected to commit: the bonus plus ``sum_i
    P(first i + 1 accepted)`` (what a draft promises; with a row cost, what two drafts of
    the same step are compared by)."""
    expected, reach = 1.0, 1.0
    for p in confidences:
        reach *= p
        expected += reach
    return expected
