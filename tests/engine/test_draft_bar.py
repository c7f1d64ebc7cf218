"""The draft bar: what drafted steps really yielded against plain ones moves what a draft must
promise (worker/engine/drafting/bar.py)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from helpers import PROMPT, ReplaysRepeats

from shared.protocol import SpecMethod, SpecSettings
from worker.engine.core.draft import Draft, VerifyOutcome
from worker.engine.drafting.bar import CEILING, PROBE_AFTER, DraftBar
from worker.engine.drafting.budget import plan_widths
from worker.engine.drafting.width import PLAIN_BAR, best_draft_length
from worker.engine.engine import EngineConfig, SpeculativeEngine
from worker.engine.slot import SlotRequest
from worker.launch import EngineCapacity

MS = 0.001


def _plain(bar: DraftBar, slots: int, seconds: float, steps: int = 3) -> None:
    for _ in range(steps):
        bar.record(slots, slots, seconds, drafted=False)


def test_drafted_steps_that_yield_less_than_plain_raise_the_bar_and_ones_that_yield_more_lower_it(
) -> None:
    bar = DraftBar(4)
    _plain(bar, 1, 1 * MS)
    assert bar.level == PLAIN_BAR
    for _ in range(40):  # 1.5 tokens in 3 ms: half of plain's 1 token a ms
        bar.record(1, 2, 3 * MS, drafted=True)
        bar.record(1, 1, 1 * MS, drafted=False)
    assert bar.yield_ratio < 1.0
    raised = bar.level
    assert raised > 1.5 * PLAIN_BAR
    for _ in range(200):  # 8 tokens in 2 ms: four times plain
        bar.record(1, 8, 2 * MS, drafted=True)
    assert bar.yield_ratio > 1.0
    assert bar.level == PLAIN_BAR
    for _ in range(2000):
        bar.record(1, 1, 10 * MS, drafted=True)
    assert bar.level == CEILING


def test_the_step_after_a_draft_is_charged_to_drafting_not_to_plain() -> None:
    """A verify breaks what plain steps reuse (a CUDA graph): the plain step after it is slow,
    and that is drafting's cost, not what plain decoding runs at."""
    bar = DraftBar(1)
    _plain(bar, 1, 1 * MS)
    for _ in range(30):
        bar.record(1, 3, 2 * MS, drafted=True)  # 1.5 tokens a ms...
        bar.record(1, 1, 3 * MS, drafted=False)  # ...and a slow plain step after each
    # Together 4 tokens in 5 ms, against plain's 5 in that time (had the slow steps been
    # plain ones, drafts would have looked 4.5 times as fast as plain).
    assert 0.7 < bar.yield_ratio < 0.9
    assert bar.level > PLAIN_BAR
    for _ in range(100):  # drafts in a row at 1.5 tokens a ms: plain steps still take 1 ms
        bar.record(1, 3, 2 * MS, drafted=True)
    assert bar.yield_ratio > 1.0
    assert bar.level == PLAIN_BAR


def test_a_drafted_step_is_compared_with_plain_steps_of_its_own_occupancy() -> None:
    bar = DraftBar(8)
    _plain(bar, 1, 1 * MS)
    for _ in range(50):  # nothing known of plain steps with 4 slots: nothing to compare
        bar.record(4, 4, 50 * MS, drafted=True)
    assert bar.level == PLAIN_BAR
    _plain(bar, 4, 2 * MS)
    for _ in range(50):
        bar.record(4, 4, 50 * MS, drafted=True)
    assert bar.level > PLAIN_BAR


def test_an_occupancy_that_always_drafts_is_probed_with_two_plain_steps_less_and_less_often(
) -> None:
    bar = DraftBar(8)
    asked = []
    for step in range(PROBE_AFTER * 8):
        probe = bar.probe(8)
        if probe:
            asked.append(step)
        bar.record(8, 8 if probe else 20, 3 * MS, drafted=not probe)
    assert asked[:2] == [PROBE_AFTER, PROBE_AFTER + 1]
    starts = [s for s in asked if s - 1 not in asked]
    assert all(asked.count(s) == 1 and s + 1 in asked for s in starts)
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    assert gaps == sorted(gaps) and gaps[-1] > gaps[0]


def test_the_decisions_take_the_bar() -> None:
    costs = [0.0, 1.0, 1.1, 1.2, 1.3, 1.4]
    confidences = [0.6, 0.6, 0.6]
    assert best_draft_length(confidences, costs) == 3
    assert best_draft_length(confidences, costs, bar=2.0) == 0
    assert sum(plan_widths([confidences, confidences], costs)) > 0
    assert plan_widths([confidences, confidences], costs, bar=2.0) == [0, 0]


class EveryOtherStep:
    """Drafts the known answer at every other step: a plain step follows every verify, and
    every decode changes shape (on :class:`ReplaysRepeats`, every step is slow)."""

    def __init__(self, answer: list[int]) -> None:
        self._answer = answer
        self._prompt = 0
        self._draft = False

    def start(self, prompt: Sequence[int]) -> None:
        self._prompt = len(prompt)

    def propose(self, history: Sequence[int], width: int, p_min: float) -> Draft:
        self._draft = not self._draft
        done = len(history) - self._prompt
        return Draft(self._answer[done:done + width] if self._draft else [])

    def observe(self, outcome: VerifyOutcome) -> None:
        """The answer is known: nothing to learn."""


def test_an_engine_whose_drafts_lose_stops_drafting(dense_model: Path) -> None:
    """Every draft is accepted and the row costs see verifies cost what plain steps cost
    (both slow), so they keep drafting; only the plain steps the probe runs show that plain
    decoding would be many times faster, and the bar then stops the drafts."""
    spec = SpecSettings(method=SpecMethod.NGRAM, draft_max=4, adaptive=False)
    with SpeculativeEngine(EngineConfig(str(dense_model), n_ctx=1024, slots=2, n_threads=1,
                                        capacity=EngineCapacity(SpecMethod.NGRAM, 4))) as engine:
        answer = engine.generate(PROMPT, 160, SpecSettings(method=SpecMethod.NONE)).tokens
        engine.verifier.target = ReplaysRepeats(engine.verifier.target, 20 * MS)  # type: ignore[assignment]
        slots = [engine.admit(SlotRequest(PROMPT, 160, spec, proposer=EveryOtherStep(answer)))
                 for _ in range(2)]
        drafted: list[int] = []
        while engine.active:
            before = sum(s.counters.drafted for s in slots)
            engine.step()
            drafted.append(sum(s.counters.drafted for s in slots) - before)
        level = engine.planner.bar.level
        assert all(s.generated == answer for s in slots)
    assert level > 2 * PLAIN_BAR
    third = len(drafted) // 3
    assert sum(drafted[-third:]) < 0.25 * sum(drafted[:third])
