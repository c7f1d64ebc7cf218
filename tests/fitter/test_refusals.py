"""What cannot fit is refused before anything is allocated, naming what does not fit."""

from __future__ import annotations

import pytest

from shared.protocol import SpecMethod
from worker.fitter import FitError, fit_worker
from worker.launch import EngineCapacity
from worker.testmodels import TinyModels

NGRAM = EngineCapacity(method=SpecMethod.NGRAM)


def test_weights_larger_than_budget_minus_margin(tiny_models: TinyModels) -> None:
    with pytest.raises(FitError, match=r"the weights do not fit: 0\.41 MiB of weights, "
                                       r"0\.10 MiB available on cpu \(budget: free 3\.00 MiB "
                                       r"- margin 2\.90 MiB\)"):
        fit_worker(str(tiny_models.dense), budget_mib=3, fit_target_mib=2.9, capacity=NGRAM)


def test_ctx_min_that_does_not_fit_shows_the_breakdown(tiny_models: TinyModels) -> None:
    with pytest.raises(FitError) as err:
        fit_worker(str(tiny_models.hybrid), budget_mib=3, fit_target_mib=0, ctx_min=2000,
                   capacity=EngineCapacity(method=SpecMethod.MTP, draft_max=4, rollback_depth=1))
    message = str(err.value)
    assert message.startswith("context 2048 (--ctx-min 2000) does not fit")
    for part in ("weights", "kv", "recurrent", "snapshots", "compute", "draft",
                 "checkpoint_reservation"):
        assert f"{part} " in message


def test_ctx_min_beyond_the_training_context(tiny_models: TinyModels) -> None:
    with pytest.raises(FitError, match="exceeds the model's training context"):
        fit_worker(str(tiny_models.dense), budget_mib=64, ctx_min=1_000_000, capacity=NGRAM)


@pytest.mark.parametrize(("kwargs", "reason"), [
    ({"slots": 0}, "slots must be at least 1"),
    ({"fit_target_mib": -1}, "must not be negative"),
    ({"device": "tpu:0"}, "unknown device"),
])
def test_bad_input_is_refused_at_the_edge(tiny_models: TinyModels, kwargs: dict[str, object],
                                          reason: str) -> None:
    with pytest.raises(FitError, match=reason):
        fit_worker(str(tiny_models.dense), budget_mib=64, **kwargs)  # type: ignore[arg-type]


def test_mtp_on_a_model_without_a_head(tiny_models: TinyModels) -> None:
    with pytest.raises(FitError, match="has no MTP"):
        fit_worker(str(tiny_models.headless), budget_mib=64,
                   capacity=EngineCapacity(method=SpecMethod.MTP))


def test_missing_model_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(FitError, match="model file not found"):
        fit_worker(str(tmp_path / "nope.gguf"), budget_mib=64)
