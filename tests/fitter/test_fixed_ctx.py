"""A fixed context (a worker's ``--ctx``) is checked like a fit: against the model's training
context and against the memory measured at that size, failing fast with the numbers."""

from __future__ import annotations

import pytest

from shared.protocol import SpecMethod
from worker.fitter import FitError, fit_worker
from worker.launch import EngineCapacity
from worker.testmodels import TinyModels

NGRAM = EngineCapacity(method=SpecMethod.NGRAM)
TRAIN = 4096  # the tiny models' training context


def test_a_fixed_context_is_measured_and_reported(tiny_models: TinyModels) -> None:
    fit = fit_worker(str(tiny_models.dense), budget_mib=64, fit_target_mib=0, capacity=NGRAM,
                     n_ctx=600)
    assert fit.config.n_ctx == fit.report.n_ctx == 600  # not rounded to the fit's steps
    assert fit.report.total_bytes == sum(fit.report.components.values())
    assert fit.report.components["kv"] > 0 and fit.report.n_ctx_train == TRAIN
    assert fit.report.details["n_ctx_source"] == "fixed"


def test_above_the_training_context_needs_the_flag(tiny_models: TinyModels) -> None:
    with pytest.raises(FitError, match=rf"^--ctx {TRAIN + 256} exceeds the model's training "
                                       rf"context \({TRAIN} tokens\); pass "
                                       r"--allow-ctx-above-train"):
        fit_worker(str(tiny_models.dense), budget_mib=64, fit_target_mib=0, capacity=NGRAM,
                   n_ctx=TRAIN + 256)
    fit = fit_worker(str(tiny_models.dense), budget_mib=64, fit_target_mib=0, capacity=NGRAM,
                     n_ctx=TRAIN + 256, allow_ctx_above_train=True)
    assert fit.report.n_ctx == TRAIN + 256


def test_a_context_beyond_memory_is_refused_with_the_numbers(tiny_models: TinyModels) -> None:
    with pytest.raises(FitError) as err:
        fit_worker(str(tiny_models.dense), budget_mib=3, fit_target_mib=0, capacity=NGRAM,
                   n_ctx=TRAIN)
    message = str(err.value)
    assert message.startswith(f"--ctx {TRAIN} does not fit: needs ")
    assert "3.00 MiB available on cpu (budget: free 3.00 MiB - margin 0.00 MiB)" in message
    assert "breakdown: weights " in message and " kv " in message


@pytest.mark.timeout(120)  # the old behaviour hung while memory grew
def test_a_huge_context_fails_fast_without_being_created(tiny_models: TinyModels) -> None:
    """``--ctx 1000000000`` is bounded from two small measurements (the training context
    and the KV bytes per token beyond it) instead of being created."""
    with pytest.raises(FitError, match=r"^--ctx 1000000000 does not fit: needs at least "
                                       r"[\d.]+ MiB \([\d.]+ MiB at 4096 tokens \+ 256\.0 B of "
                                       r"KV per token beyond\), 64\.00 MiB available"):
        fit_worker(str(tiny_models.dense), budget_mib=64, fit_target_mib=0, capacity=NGRAM,
                   n_ctx=1_000_000_000, allow_ctx_above_train=True)


def test_the_report_names_the_snapshots_really_kept(tiny_models: TinyModels) -> None:
    """A dense model keeps none whatever was asked (the fit table showed a depth for it);
    a recurrent one keeps D, or N when D is unset."""
    def depth(path: object, **spec: object) -> int | None:
        fit = fit_worker(str(path), budget_mib=64, fit_target_mib=0, n_ctx=512,
                         capacity=EngineCapacity(method=SpecMethod.NGRAM, **spec))
        return fit.report.rollback_depth

    assert depth(tiny_models.dense, draft_max=4, rollback_depth=2) is None
    assert depth(tiny_models.hybrid, draft_max=4, rollback_depth=1) == 1
    assert depth(tiny_models.hybrid, draft_max=4) == 4


def test_auto_slots_fit_the_fixed_context(tiny_models: TinyModels) -> None:
    """``--slots auto`` with ``--ctx`` counts the slots that hold that context, not
    ``--ctx-min``'s (which would leave slots unused at a smaller fixed context)."""
    def slots(**kw: object) -> int:
        return fit_worker(str(tiny_models.dense), budget_mib=8, fit_target_mib=0, capacity=NGRAM,
                          slots="auto", ctx_min=2048, **kw).report.slots

    assert slots(n_ctx=256) > slots(n_ctx=2048) >= 1
