"""Fitting S slots: S sequences of the fitted per-slot context, S x (1 + D) recurrent groups,
S checkpoints, verify rows of every slot in the compute and output buffers; an engine built
from that fit really allocates it and reserves every slot's checkpoint; ``--slots auto``
picks the largest S that still fits ``--ctx-min`` per slot."""

from __future__ import annotations

import json
import subprocess

import llama_cpp
import pytest
from helpers import specfleet

from shared.protocol import SpecMethod
from worker.engine.slot import SlotRequest
from worker.fitter import FitError, fit_worker
from worker.launch import EngineCapacity
from worker.testmodels import TinyModels

MIB = 1024 * 1024
COMPACT = EngineCapacity(method=SpecMethod.MTP, draft_max=5, rollback_depth=1)


@pytest.mark.parametrize("slots", [1, 2, 4])
def test_slots_multiply_the_per_slot_state(tiny_models: TinyModels, slots: int) -> None:
    """At one fixed per-slot context, every per-sequence component scales with S."""
    one = fit_worker(str(tiny_models.hybrid), budget_mib=64, fit_target_mib=0, capacity=COMPACT,
                     n_ctx=512).report
    many = fit_worker(str(tiny_models.hybrid), budget_mib=64, fit_target_mib=0, capacity=COMPACT,
                      n_ctx=512, slots=slots).report
    group = many.details["snapshot_group_bytes"]
    assert many.slots == slots and many.n_ctx == 512
    assert many.components["recurrent"] == slots * group
    assert many.components["snapshots"] == slots * 1 * group
    assert many.components["checkpoint_reservation"] == slots * group
    # llama.cpp logs the KV size with 0.01 MiB resolution.
    assert abs(many.components["kv"] - slots * one.components["kv"]) <= slots * 0.01 * MIB
    assert many.components["output"] >= one.components["output"]
    assert many.components["weights"] == one.components["weights"]


def test_a_fixed_budget_fits_less_context_per_slot_with_more_slots(
        tiny_models: TinyModels) -> None:
    fits = [fit_worker(str(tiny_models.hybrid), budget_mib=5, fit_target_mib=0, capacity=COMPACT,
                       ctx_min=256, slots=s).report for s in (1, 2, 4)]
    contexts = [f.n_ctx for f in fits]
    assert contexts[0] > contexts[1] > contexts[2] >= 256, contexts
    for f in fits:
        assert f.total_bytes <= 5 * MIB
        assert f.details["next_step_total_bytes"] > 5 * MIB


def test_engine_from_a_slot_fit_allocates_it_and_reserves_every_checkpoint(
        tiny_models: TinyModels, allocate) -> None:
    fit = fit_worker(str(tiny_models.hybrid), budget_mib=4, fit_target_mib=0, capacity=COMPACT,
                     ctx_min=256, slots=3)
    built = allocate(fit)
    engine = built.engine
    assert engine.config.slots == 3 and engine.config.n_ctx == fit.n_ctx
    assert llama_cpp.llama_n_ctx(engine.target.ptr) >= 3 * fit.n_ctx
    per_slot = fit.report.details["checkpoint_device_bytes_per_slot"]
    assert [s.reserved_bytes() for s in engine.rollback.stores] == [per_slot] * 3
    assert built.reserved == 3 * per_slot
    predicted_at_load = fit.report.total_bytes - fit.report.details["runtime_growth_bytes"]
    assert abs(predicted_at_load - built.reported_bytes) <= 0.02 * built.reported_bytes, (
        fit.report.components, built.buffers.sizes)
    # Every slot can hold a prompt filling its whole per-slot context.
    vocab = engine.model.n_vocab
    prompt = [(7 * i + 3) % vocab for i in range(fit.n_ctx - 1)]
    slots = [engine.admit(SlotRequest(prompt, 1)) for _ in range(3)]
    while engine.active:
        engine.step()
    assert all(len(s.generated) == 1 for s in slots)


def test_auto_picks_the_most_slots_that_fit_ctx_min(tiny_models: TinyModels) -> None:
    path, budget, ctx_min = str(tiny_models.hybrid), 4.0, 512
    auto = fit_worker(path, budget_mib=budget, fit_target_mib=0, capacity=COMPACT, ctx_min=ctx_min,
                      slots="auto").report
    assert auto.slots > 1 and auto.n_ctx >= ctx_min
    with pytest.raises(FitError, match="does not fit"):
        fit_worker(path, budget_mib=budget, fit_target_mib=0, capacity=COMPACT, ctx_min=ctx_min,
                   slots=auto.slots + 1)


def test_cli_slots_auto_and_refusals(tiny_models: TinyModels) -> None:
    def fit(*args: str) -> subprocess.CompletedProcess[str]:
        return specfleet("fit", "--model", str(tiny_models.dense), "--budget-mib", "3",
                         "--fit-target-mib", "0", "--spec", "ngram", "--ctx-min", "256", *args)

    proc = fit("--slots", "auto", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["slots"] > 1 and report["n_ctx"] >= 256
    for bad in ("0", "many", "257"):
        proc = fit("--slots", bad)
        assert proc.returncode == 2
        assert "--slots must be 'auto' or a number 1..256" in proc.stderr
