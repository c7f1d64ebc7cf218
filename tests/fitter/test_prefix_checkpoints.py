"""The fit counts prefix checkpoints at what llama.cpp really saves: a recurrent state's one
size, or a full sliding window of SWA cells, measured on a small context before the engine
exists, and the engine reserves exactly that."""

from __future__ import annotations

from pathlib import Path

import llama_cpp
import pytest

from worker.fitter import fit_worker
from worker.launch import DEFAULT_CHECKPOINTS
from worker.llm import Batch
from worker.testmodels import TinyModels


@pytest.mark.parametrize("which", ["swa", "hybrid", "dense"])
def test_the_fit_counts_the_checkpoints_llama_cpp_saves(tiny_models: TinyModels, allocate,
                                                        which: str) -> None:
    path: Path = getattr(tiny_models, which)
    fit = fit_worker(str(path), budget_mib=64, fit_target_mib=0, ctx_min=1024, slots=2)
    size = fit.report.details["prefix_checkpoint_bytes"]
    engine = allocate(fit).engine
    if which == "dense":  # attention trims to any prefix: nothing to checkpoint
        assert size == 0 and fit.report.components["prefix_checkpoints"] == 0
        assert fit.report.details["prefix_checkpoint_mode"] is None
        return
    assert fit.report.components["prefix_checkpoints"] == 2 * DEFAULT_CHECKPOINTS * size
    assert fit.report.details["prefix_checkpoint_mode"] == "host"
    # A sequence well past the window: what a save at its end really takes.
    n = 3 * max(engine.model.n_swa, 32)
    with Batch(n) as batch:
        engine.target.decode(batch.set([(5 * i) % 256 for i in range(n)], 0, seq=1))
    saved = engine.target.state_size(llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY, 1)
    engine.target.seq_clear(1)
    assert saved == size
