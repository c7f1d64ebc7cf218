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

from helpers import PROMPT, ReplaysRepeats

from shared.protocol import SpecMethod, SpecSettings
from worker.engine.drafting.costs import RowCosts
from worker.engine.drafting.curve import measure_curve
from worker.engine.engine import EngineConfig, SpeculativeEngine
from worker.engine.slot import SlotRequest
from worker.launch import EngineCapacity
from worker.llm import Batch, Context, ContextSpec, Model, ModelSpec
from worker.llm.devices import has_local_gpu

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


def test_plain_widths_are_timed_steady_where_the_device_replays_them(dense_model: Path) -> None:
    """Where a repeated shape replays a graph (a GPU), the widths plain decoding runs step
    after step are priced as it runs them, a verify's after another shape: else the plain
    row looks as dear as a verify and a losing draft like a gain. Elsewhere every width is
    timed after another shape."""
    with Model(ModelSpec(str(dense_model))) as model, \
            Context(model, ContextSpec(n_ctx=256, n_batch=16, n_threads=1)) as context:
        device = ReplaysRepeats(context, WAIT)
        replayed = measure_curve(device, Batch(16), 8, replays=True)  # type: ignore[arg-type]
        unreplayed_curve = measure_curve(device, Batch(16), 8)  # type: ignore[arg-type]
    one_slot = RowCosts.for_one_slot(replayed, 3, replays=True)
    two_slots = RowCosts.for_steps(replayed, 2, 3, replays=True)
    unreplayed = RowCosts.for_one_slot(unreplayed_curve, 3)
    assert one_slot.seconds[1] < WAIT <= min(one_slot.seconds[2:])
    assert max(two_slots.seconds[1:3]) < WAIT <= min(two_slots.seconds[3:])
    assert min(unreplayed.seconds[1:]) >= WAIT


def test_only_layers_on_a_gpu_replay(dense_model: Path) -> None:
    """Layers asked for the GPU are there only when the build has a GPU backend (a CPU
    build keeps them on the CPU, which replays nothing); none asked for, none are."""
    with Model(ModelSpec(str(dense_model), n_gpu_layers=-1)) as model:
        assert model.offloaded is has_local_gpu()
    with Model(ModelSpec(str(dense_model))) as model:
        assert not model.offloaded


def test_calibration_times_the_device_s_work(dense_model: Path) -> None:
    with Model(ModelSpec(str(dense_model))) as model, \
            Context(model, ContextSpec(n_ctx=256, n_batch=8, n_threads=1)) as context:
        curve = measure_curve(QueuedDevice(context), Batch(8), 4)  # type: ignore[arg-type]
    assert min(curve.timed.values()) >= WAIT


def test_a_verify_s_decode_time_includes_the_device_s_work(dense_model: Path) -> None:
    """The step costs learn from each verify's decode time (the row budget's load line)."""
    spec = SpecSettings(method=SpecMethod.NGRAM, draft_max=4, adaptive=False)
    with SpeculativeEngine(EngineConfig(str(dense_model), n_ctx=512, slots=2, n_threads=1,
                                        capacity=EngineCapacity(SpecMethod.NGRAM, 4))) as engine:
        assert engine.planner.steps is not None
        engine.verifier.target = QueuedDevice(engine.verifier.target)  # type: ignore[assignment]
        seen: list[float] = []
        learn = engine.planner.steps.observe

        def observe(rows: int, seconds: float) -> None:
            seen.append(seconds)
            learn(rows, seconds)

        engine.planner.steps.observe = observe  # type: ignore[method-assign]
        for _ in range(2):
            engine.admit(SlotRequest(PROMPT * 2, 12, spec))
        while engine.active:
            engine.step()
    assert seen and min(seen) >= WAIT
