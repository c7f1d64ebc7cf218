"""The fitted context really loads, fills, and matches llama.cpp's own reports.

For each model and budget: the fit leaves the budget unexceeded while one more step of 256
tokens would exceed it; the engine built from the fit allocates what the fit predicted
(within 2% of the buffer sizes llama.cpp logs while allocating: model, KV, recurrent,
output, compute and checkpoint buffers; the output buffer's later growth, which llama.cpp
does not log, is left out of both sides); and a prompt filling the whole context is
processed.
"""

from __future__ import annotations

import pytest

from shared.protocol import FinishReason, SpecMethod
from worker.fitter import fit_worker
from worker.launch import EngineCapacity

MIB = 1024 * 1024

CASES = [
    # model, budget MiB, what the engine loads for
    ("dense", 2.5, EngineCapacity(method=SpecMethod.NGRAM)),
    ("dense", 3.5, EngineCapacity(method=SpecMethod.NGRAM)),
    ("hybrid", 3.0, EngineCapacity(method=SpecMethod.NGRAM, draft_max=3)),
    ("hybrid", 3.0, EngineCapacity(method=SpecMethod.MTP, draft_max=5, rollback_depth=1)),
    ("hybrid", 3.5, EngineCapacity(method=SpecMethod.MTP, draft_max=5, rollback_depth=1)),
    # Gemma's budgets are MiB above its weights, which depend on the CPU: llama.cpp keeps
    # a repacked copy of the quantised weights beside the mapped file where it has kernels
    # for them (AMX: +214 MiB). Small, so filling the context is a short prefill on 2 cores.
    ("gemma", 57.0, EngineCapacity(method=SpecMethod.NGRAM, draft_max=8)),
    ("gemma", 60.0, EngineCapacity(method=SpecMethod.NGRAM, draft_max=8)),
]


def weights_mib(path: str, capacity: EngineCapacity) -> float:
    """What this machine's llama.cpp holds for the model's weights (a small fixed fit)."""
    fit = fit_worker(path, budget_mib=8192, fit_target_mib=0, capacity=capacity, n_ctx=256)
    return fit.report.components["weights"] / MIB


@pytest.mark.parametrize(("which", "budget_mib", "capacity"), [
    pytest.param(*case, id=f"{case[0]}-{case[1]}MiB-{case[2].method}",
                 marks=[pytest.mark.gemma] if case[0] == "gemma" else [])
    for case in CASES
])
def test_fitted_context_loads_fills_and_matches_llama_cpp(
        request: pytest.FixtureRequest, allocate, which: str, budget_mib: float,
        capacity: EngineCapacity) -> None:
    path = str(request.getfixturevalue("gemma_path") if which == "gemma"
               else getattr(request.getfixturevalue("tiny_models"), which))
    if which == "gemma":
        budget_mib += weights_mib(path, capacity)
    fit = fit_worker(path, budget_mib=budget_mib, fit_target_mib=0, capacity=capacity,
                     ctx_min=256)
    report = fit.report
    budget = round(budget_mib * MIB)

    assert report.n_ctx % 256 == 0 and 256 <= report.n_ctx < report.n_ctx_train
    assert report.total_bytes == sum(report.components.values()) <= budget
    assert report.details["next_step_total_bytes"] > budget

    built = allocate(fit)
    # The prefix checkpoints are the engine's own host buffers, not llama.cpp's: exact.
    assert report.components["prefix_checkpoints"] == built.engine.prefix.reserved_bytes
    predicted_at_load = report.total_bytes - report.details["runtime_growth_bytes"]
    assert abs(predicted_at_load - built.reported_bytes) <= 0.02 * built.reported_bytes, (
        report.components, built.buffers.sizes)

    engine = built.engine
    vocab = engine.model.n_vocab
    prompt = [(7 * i + 3) % vocab for i in range(fit.n_ctx - 1)]
    result = engine.generate(prompt, max_tokens=1)
    assert result.telemetry.prompt_tokens == fit.n_ctx - 1
    assert len(result.tokens) == 1 or result.finish_reason is FinishReason.EOS
