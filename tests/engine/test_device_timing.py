"""Decode timings wait for the device's work, not only its queueing.

On CUDA ``llama_decode`` returns once the work is queued (llama.cpp waits only when outputs
are read), so a cost timed around the decode alone is the kernel launches: the row costs the
draft length and the row budget are planned from were launch times on the H200 (docs/
benchmarks.md, "GPU check"). The CPU backend is synchronous, so these tests stand a queued
device in for one: the real context decodes, and the wait a GPU adds happens at
:meth:`~worker.llm.Context.synchronize`, where the timings must include it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from helpers import PROMPT

from shared.protocol import SpecMethod, SpecSettings
from worker.engine.engine import EngineConfig, SpeculativeEngine
from worker.engine.slot import SlotRequest
from worker.engine.verify_shape import measure_costs
from worker.launch import EngineCapacity
from worker.llm import Batch, Context, ContextSpec, Model, ModelSpec

#: Seconds a queued decode takes to finish on the stand-in device.
WAIT = 0.05


class QueuedDevice:
    """A context whose decodes finish only when waited for, as on a GPU."""

    def __init__(self, context: Context) -> None:
        self._context = context

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    def synchronize(self) -> None:
        time.sleep(WAIT)
        self._context.synchronize()


class SlowRows:
    """A context whose output rows take :data:`WAIT` seconds each to read: a GPU's host side,
    where every verify row's 262k logits are read and reduced while the device idles."""

    def __init__(self, context: Context) -> None:
        self._context = context

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    def logits_rows(self, row0: int, n: int) -> Any:
        time.sleep(WAIT * n)
        return self._context.logits_rows(row0, n)


def _observed_step_costs(engine: SpeculativeEngine) -> list[tuple[int, float]]:
    """Run two n-gram requests on ``engine`` together; every (rows, seconds) its step costs
    learned from."""
    assert engine.step_costs is not None
    seen: list[tuple[int, float]] = []
    learn = engine.step_costs.observe

    def observe(rows: int, seconds: float) -> None:
        seen.append((rows, seconds))
        learn(rows, seconds)

    engine.step_costs.observe = observe  # type: ignore[method-assign]
    spec = SpecSettings(method=SpecMethod.NGRAM, draft_max=4, adaptive=False)
    for _ in range(2):
        engine.admit(SlotRequest(PROMPT * 2, 12, spec))
    while engine.active:
        engine.step()
    return seen


def _ngram_engine(dense_model: Path) -> SpeculativeEngine:
    return SpeculativeEngine(EngineConfig(str(dense_model), n_ctx=512, slots=2, n_threads=1,
                                          capacity=EngineCapacity(SpecMethod.NGRAM, 4)))


def test_calibration_times_the_device_s_work(dense_model: Path) -> None:
    with Model(ModelSpec(str(dense_model))) as model, \
            Context(model, ContextSpec(n_ctx=256, n_batch=8, n_threads=1)) as context:
        costs = measure_costs(QueuedDevice(context), Batch(8), 4, reps=1)  # type: ignore[arg-type]
    assert min(costs[1:]) >= WAIT


def test_a_verify_s_decode_time_includes_the_device_s_work(dense_model: Path) -> None:
    """The step costs learn from each verify's time (the row budget's load line)."""
    with _ngram_engine(dense_model) as engine:
        engine.verifier.target = QueuedDevice(engine.verifier.target)  # type: ignore[assignment]
        seen = _observed_step_costs(engine)
    assert seen and min(seconds for _, seconds in seen) >= WAIT


def test_a_step_s_cost_includes_reading_its_rows(dense_model: Path) -> None:
    """What a row costs on the host (its logits read and reduced) is part of what a wider
    verify costs: on a GPU a one-row decode is ~1 ms and that host work a large share of a
    step, so step costs of the decode alone priced draft rows below what they ran."""
    with _ngram_engine(dense_model) as engine:
        engine.verifier.target = SlowRows(engine.verifier.target)  # type: ignore[assignment]
        seen = _observed_step_costs(engine)
    assert seen and all(seconds >= WAIT * rows for rows, seconds in seen)
