"""Driving an engine of several slots the way a worker loop does, and the references its
outputs are checked against.

A schedule is a list of arrivals: a request and the engine step at which it is admitted (or as
soon after as a slot is free). :func:`run_schedule` steps the engine until every request has
finished and returns each request's result, what it streamed, and a per-step record of which
requests verified, so tests can check that slots really ran side by side.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from shared.protocol import SpecMethod
from worker.engine.engine import EngineConfig, SpeculativeEngine
from worker.engine.slot import GenerationResult, Phase, Slot, SlotRequest, SlotUpdate
from worker.launch import EngineCapacity

#: Steps after which a schedule is declared stuck (far more than any test needs).
STEP_LIMIT = 20_000


@dataclass(frozen=True)
class Arrival:
    step: int
    request: SlotRequest


@dataclass
class Run:
    results: list[GenerationResult]
    #: Concatenated streamed text per request.
    streamed: list[str]
    #: Per engine step: the requests (by arrival index) that verified in it.
    verified: list[set[int]] = field(default_factory=list)
    #: Per engine step: the requests that were still loading their prompt after it.
    loading: list[set[int]] = field(default_factory=list)


OnStep = Callable[[int, list[SlotUpdate], dict[int, Slot]], None]


def run_schedule(engine: SpeculativeEngine, arrivals: Sequence[Arrival],
                 on_step: OnStep | None = None) -> Run:
    """Admit every arrival at its step (or the first step after with a free slot) and step the
    engine until all have finished. ``on_step(step, updates, slots)`` runs after each step
    with the live slots by arrival index (tests cancel from there)."""
    order = sorted(range(len(arrivals)), key=lambda i: arrivals[i].step)
    results: dict[int, GenerationResult] = {}
    streamed = [""] * len(arrivals)
    live: dict[int, Slot] = {}
    run = Run([], streamed)
    step = 0
    while len(results) < len(arrivals):
        while order and arrivals[order[0]].step <= step and engine.free_slots:
            i = order.pop(0)
            live[i] = engine.admit(arrivals[i].request)
        index = {id(slot): i for i, slot in live.items()}
        updates = engine.step()
        run.verified.append(set())
        for u in updates:
            i = index[id(u.slot)]
            streamed[i] += u.text
            if u.verified:
                run.verified[-1].add(i)
            if u.result is not None:
                results[i] = u.result
                del live[i]
        run.loading.append({i for i, s in live.items() if s.phase is Phase.PREFILL})
        if on_step is not None:
            on_step(step, updates, live)
        step += 1
        assert step < STEP_LIMIT, "the schedule never finished"
    run.results = [results[i] for i in range(len(arrivals))]
    return run


@cache
def plain_greedy(model: Path, prompt: tuple[int, ...], n_tokens: int, n_ctx: int) -> list[int]:
    """The plain one-token-at-a-time greedy continuation on a one-slot engine: the reference
    every slot's output must equal, whatever runs beside it."""
    config = EngineConfig(str(model), n_ctx=n_ctx, n_threads=1,
                          capacity=EngineCapacity(method=SpecMethod.NONE))
    with SpeculativeEngine(config) as engine:
        return engine.generate(list(prompt), n_tokens).tokens
