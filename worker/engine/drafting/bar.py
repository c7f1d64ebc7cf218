"""How much more than a plain step a draft must promise, learned from what drafted steps
really yielded against plain ones on this engine.

The draft decisions (:func:`~worker.engine.drafting.width.best_draft_length` for one
slot, :func:`~worker.engine.drafting.budget.plan_widths` for several) weigh a draft's expected
tokens against modelled row costs, and verify it when its predicted rate beats a plain step's
by a bar. The model misses what it cannot see, and on a GPU that is most of a step: one NVIDIA
H200, Gemma 270M Q4_K_M, a one-row decode replays a CUDA graph at 1.16 ms while a decode of
any other shape (every verify, and the plain step after one) launches its kernels one by one
at 2.3 ms and up; every verify row's 262k logits are read and reduced on the host; the
drafter's own bookkeeping runs in every step. There the default drafter ran at 0.68x plain
with one slot (acceptance 0.22) and 0.72-0.76x with four and eight, whatever the cost
tables said (docs/benchmarks.md, "GPU, second run").

So the bar is not a constant but a measured correction (:class:`DraftBar`): each step is
timed whole (drafting, verify, acceptance, commit) and classed as *plain* when neither it nor
the step before it verified a draft (what plain decoding runs at: on a GPU the graphed step)
or as *drafted* otherwise (the step after a verify is charged to it: the graph it broke). Per
number of decoding slots, plain steps give the plain rate; every drafted step is compared
with the plain rate at its occupancy, as the tokens it committed against the tokens plain
steps commit in the same seconds. While drafted steps yield less, the bar rises (only the
drafts that promise the most still pass); while they yield more, it falls back to the floor
(:data:`~worker.engine.drafting.width.PLAIN_BAR`). Where drafting pays (a CPU, a copy),
the bar stays at the floor and nothing changes.

A rate needs plain steps to compare with: when every step of an occupancy drafts (eight busy
slots), :meth:`DraftBar.probe` asks the row budget for two plain steps in a row now and then
(the first clears the graph the drafts broke, the second is measured). A probe cuts greedy
drafts only, which never changes output. One slot is not probed: its suffix drafter declines
the drafts that do not pay, and its plain steps come by themselves; where it drafts every
step (a verbatim copy, 25 tokens a step) there is nothing to correct.
"""

from __future__ import annotations

import math

from worker.engine.drafting.width import PLAIN_BAR

#: The bar's ceiling: past it only drafts of near-certain long repeats pass (a verbatim copy
#: promises ~4x a plain step on the H200 and ~3-4x on a CPU).
CEILING = 8.0
#: How far one drafted step moves the bar, per unit of log(plain / drafted) yield: a drafted
#: step that yields half of plain raises it ~3.5 %, so a lasting loss doubles it within ~20.
GAIN = 0.05
#: Weight of the newest observation in the plain step times and the drafted yield.
RATE = 0.1
#: A probe is asked after this many steps of one occupancy without a plain sample; each probe
#: doubles the wait for the next, up to :data:`PROBE_MAX` (a plain step's time moves slowly,
#: and where drafts run at 25 tokens a step two plain steps every 32 would cost 6 %).
PROBE_AFTER = 32
PROBE_MAX = 1024


class DraftBar:
    """The factor a draft's predicted rate must beat a plain step's by (:attr:`level`), for
    an engine of ``slots`` slots, corrected by realised step rates (see the module)."""

    def __init__(self, slots: int) -> None:
        self.level = PLAIN_BAR
        #: Seconds of a plain step with n decoding slots (None: not measured yet), and the
        #: steps of that occupancy since one was measured.
        self._plain: list[float | None] = [None] * (slots + 1)
        self._since: list[int] = [0] * (slots + 1)
        self._wait: list[int] = [PROBE_AFTER] * (slots + 1)
        #: Decayed tokens committed by drafted steps, and what plain steps would have
        #: committed in their seconds.
        self._tokens = 0.0
        self._plain_tokens = 0.0
        self._drafted_before = False
        self._probing = 0

    def probe(self, slots: int) -> bool:
        """Whether this step, of ``slots`` decoding slots, should verify no (greedy) draft so
        a plain rate is measured."""
        if self._probing == 0 and self._since[slots] >= self._wait[slots]:
            self._probing = 2
            self._wait[slots] = min(PROBE_MAX, 2 * self._wait[slots])
        return self._probing > 0

    def record(self, slots: int, tokens: int, seconds: float, drafted: bool) -> None:
        """A decode step of ``slots`` slots (no prompt chunk in it) committed ``tokens`` in
        ``seconds``; ``drafted``: it verified at least one drafted token."""
        if self._probing:
            self._probing -= 1
        after_draft, self._drafted_before = self._drafted_before, drafted
        if not 0 < slots < len(self._plain) or seconds <= 0.0:
            return
        plain = self._plain[slots]
        if not drafted and not after_draft:
            self._plain[slots] = seconds if plain is None else plain + RATE * (seconds - plain)
            self._since[slots] = 0
            return
        self._since[slots] += 1
        if plain is None:
            return
        self._tokens += RATE * (tokens - self._tokens)
        self._plain_tokens += RATE * (slots * seconds / plain - self._plain_tokens)
        if self._tokens > 0.0 and self._plain_tokens > 0.0:
            step = math.exp(GAIN * math.log(self._plain_tokens / self._tokens))
            self.level = min(CEILING, max(PLAIN_BAR, self.level * step))

    @property
    def yield_ratio(self) -> float:
        """Drafted steps' tokens over what plain steps would have committed in their time
        (decayed; 0 before both were measured): above 1, drafting pays here."""
        return self._tokens / self._plain_tokens if self._plain_tokens else 0.0
