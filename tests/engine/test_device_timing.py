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


def test_calibration_times_the_device_s_work(dense_model: Path) -> None:
    with Model(ModelSpec(str(dense_model))) as model, \
            Context(model, ContextSpec(n_ctx=256, n_batch=8, n_threads=1)) as context:
        costs = measure_costs(QueuedDevice(context), Batch(8), 4, reps=1)  # type: ignore[arg-type]
    assert min(costs[1:]) >= WAIT


def test_a_verify_s_decode_time_includes_the_device_s_work(dense_model: Path) -> None:
    """The step costs learn from each verify's decode time (the row budget's load line)."""
    spec = SpecSettings(method=SpecMethod.NGRAM, draft_max=4, adaptive=False)
    with SpeculativeEngine(EngineConfig(str(dense_model), n_ctx=512, slots=2, n_threads=1,
                                        capacity=EngineCapacity(SpecMethod.NGRAM, 4))) as engine:
        assert engine.step_costs is not None
        engine.verifier.target = QueuedDevice(engine.verifier.target)  # type: ignore[assignment]
        seen: list[float] = []
        learn = engine.step_costs.observe

        def observe(rows: int, seconds: float) -> None:
            seen.append(seconds)
            learn(rows, seconds)

        engine.step_costs.observe = observe  # type: ignore[method-assign]
        for _ in range(2):
            engine.admit(SlotRequest(PROMPT * 2, 12, spec))
        while engine.active:
            engine.step()
    assert seen and min(seen) >= WAIT
