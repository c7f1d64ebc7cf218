"""Recurrent-state reservation: flat in N at D = 1, one group per step of N at D = N; the
checkpoint reserved at start-up is the size the fit measured, on the device or the host."""

from __future__ import annotations

from dataclasses import replace

import pytest
from structlog.testing import capture_logs

from shared.protocol import CheckpointMode, SpecMethod
from worker.fitter import FitError, FitResult, fit_worker
from worker.launch import EngineCapacity
from worker.testmodels import TinyModels

RECURRENT_PARTS = ("recurrent", "snapshots", "checkpoint_reservation")


def _fit(tiny_models: TinyModels, n: int, d: int | None) -> FitResult:
    capacity = EngineCapacity(method=SpecMethod.NGRAM, draft_max=n, rollback_depth=d)
    return fit_worker(str(tiny_models.hybrid), budget_mib=3, fit_target_mib=0, capacity=capacity,
                      ctx_min=256)


def _reservation(fit: FitResult) -> int:
    return sum(fit.report.components[k] for k in RECURRENT_PARTS)


def test_depth_one_stays_flat_and_full_depth_grows_by_one_group(tiny_models: TinyModels) -> None:
    compact = {n: _fit(tiny_models, n, 1) for n in (2, 3, 5)}
    full = {n: _fit(tiny_models, n, None) for n in (1, 2, 3)}
    group = compact[2].report.details["snapshot_group_bytes"]
    assert group > 0
    # 1 live + 1 snapshot + 1 checkpoint, whatever the draft maximum.
    assert {_reservation(f) for f in compact.values()} == {3 * group}
    assert all(f.report.components["checkpoint_reservation"] == group for f in compact.values())
    # 1 live + N snapshots, no checkpoint.
    assert [_reservation(full[n]) for n in (1, 2, 3)] == [2 * group, 3 * group, 4 * group]
    assert all(f.report.components["checkpoint_reservation"] == 0 for f in full.values())
    # llama.cpp's own recurrent buffer agrees with the exact groups within its log resolution.
    for f in (*compact.values(), *full.values()):
        exact = f.report.components["recurrent"] + f.report.components["snapshots"]
        assert abs(f.report.details["recurrent_reported_bytes"] - exact) <= 0.01 * 2**20


@pytest.fixture
def compact_fit(tiny_models: TinyModels) -> FitResult:
    return _fit(tiny_models, 4, 1)


def test_device_checkpoint_reserved_as_measured(allocate, compact_fit: FitResult) -> None:
    built = allocate(compact_fit)
    group = compact_fit.report.details["checkpoint_device_bytes_per_slot"]
    assert built.reserved == group == compact_fit.report.components["checkpoint_reservation"]
    # llama.cpp's own line for the device checkpoint buffer (0.001 MiB resolution).
    assert abs(built.buffers.total("checkpoint") - group) <= 0.001 * 2**20


def test_failed_device_reservation_falls_back_to_host(allocate, compact_fit: FitResult) -> None:
    failing = FitResult(replace(compact_fit.config, fail_device_checkpoint=True),
                        compact_fit.report)
    with capture_logs() as logs:
        built = allocate(failing)
    assert built.engine.rollback.stores[0].mode is CheckpointMode.HOST
    host_size = compact_fit.report.details["checkpoint_host_bytes_per_slot"]
    assert built.reserved == host_size
    assert [e["event"] for e in logs].count("checkpoint.fallback") == 1
    # The report the worker publishes says what was really reserved, where: host storage,
    # of the host size (a CPU worker's host memory is its device), totals to match.
    report = built.report
    assert report.details["checkpoint_mode"] == "host"
    assert report.components["checkpoint_reservation"] == host_size
    assert report.devices[0].components == report.components
    assert report.total_bytes == sum(report.components.values())
    assert compact_fit.report.details["checkpoint_mode"] == "device"  # the fit's own record
    (reserve,) = [e for e in logs if e["event"] == "fit.reserve"]
    assert (reserve["mode"], reserve["reserved_bytes"]) == ("host", host_size)


def test_reservation_unlike_the_measurement_stops(allocate, compact_fit: FitResult) -> None:
    details = dict(compact_fit.report.details)
    details["checkpoint_device_bytes_per_slot"] += 1
    report = compact_fit.report.model_copy(update={"details": details})
    wrong = FitResult(compact_fit.config, report)
    with pytest.raises(FitError, match="is smaller than the fit measured.*fit breakdown: weights"):
        allocate(wrong)


def test_engines_without_checkpoints_reserve_nothing(allocate, tiny_models: TinyModels) -> None:
    with capture_logs() as logs:
        built = allocate(_fit(tiny_models, 3, None))
    assert built.reserved == 0 and built.report.details["checkpoint_mode"] is None
    # They still go through the reservation step, and say so.
    (reserve,) = [e for e in logs if e["event"] == "fit.reserve"]
    assert (reserve["mode"], reserve["reserved_bytes"]) == (None, 0)
