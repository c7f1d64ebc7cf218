"""A worker over a device group: the host plus two RPC device processes, as one worker.

It fits every device, registers one worker whose fit lists them all in the model's order,
and serves a job through Redis with the output a one-device engine computes. Submitters see
nothing else: routing and capacity read the fitted context as for any worker.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from monitor.scrape import by_label
from multidevice.devices import needs_rpc, rpc_devices

from coordinator.client import Coordinator
from coordinator.monitor import LogSummary
from shared.fleet_events import decode
from shared.protocol import JobStatus, SpecMethod, SpecSettings
from shared.settings import Settings
from worker.engine.engine import EngineConfig, SpeculativeEngine

from .workers import CTX, MODEL_NAME, Fleet

pytestmark = needs_rpc

PROMPT = [1, 2, 3, 4, 5]


@pytest.fixture
def devices(tmp_path: Path) -> Iterator[list[str]]:
    with rpc_devices(2, tmp_path) as endpoints:
        yield endpoints


def test_a_worker_over_rpc_devices_serves_what_one_device_does(
        fleet: Fleet, coordinator: Coordinator, dense_model: Path, devices: list[str]) -> None:
    fleet.start("group", args=("--ctx", str(CTX), "--rpc", ",".join(devices),
                               "--budget-mib", "64", "--fit-target-mib", "0", "--spec", "ngram"))
    info = coordinator.registry.registration("group")
    assert info is not None and info.fit is not None
    assert info.device == f"cpu,RPC[{devices[0]}],RPC[{devices[1]}]"
    assert [d.device for d in info.fit.devices] == ["cpu", *(f"RPC0[{e}]" for e in devices)]
    assert all(d.components["weights"] > 0 for d in info.fit.devices)
    assert info.fit.details["device_layers"]["cpu"] == 0

    result = coordinator.submit({"model": MODEL_NAME, "prompt_tokens": PROMPT,
                                 "max_tokens": 24}).result(timeout=60)
    with SpeculativeEngine(EngineConfig(model_path=str(dense_model), n_ctx=CTX,
                                        n_threads=1)) as engine:
        expected = engine.generate(PROMPT, 24, SpecSettings()).tokens
    assert result.status is JobStatus.FINISHED and result.worker == "group"
    assert result.tokens == expected


def test_a_group_that_overlaps_a_live_workers_devices_is_refused(
        fleet: Fleet, devices: list[str]) -> None:
    """Two workers on one RPC server would each fit the model to the memory the other then
    takes: the second is refused at start, naming the first and the device."""
    fleet.start("first", args=("--ctx", str(CTX), "--rpc", devices[0], "--budget-mib", "64",
                               "--fit-target-mib", "0", "--spec", "none"))
    with pytest.raises(AssertionError, match=r"exited") as refused:
        fleet.start("second", args=("--ctx", str(CTX), "--rpc", f"{devices[1]},{devices[0]}",
                                    "--budget-mib", "64", "--fit-target-mib", "0",
                                    "--spec", "none"))
    said = str(refused.value)
    assert f"RPC[{devices[0]}]" in said and "'first'" in said and f"RPC[{devices[1]}]" not in (
        said.split("already serve")[0])


def test_a_start_up_fallback_names_the_group_device_that_held_the_checkpoints(
        settings: Settings, coordinator: Coordinator, hybrid_model: Path, devices: list[str],
        tmp_path: Path) -> None:
    """The hybrid over the host and two RPC devices, compact rollback (D = 1 < N = 3), two
    slots, device checkpoints failing for real from the start: both slots' reservations fall
    back to the host, and the registration, the ``/metrics`` counter per device, the
    ``checkpoint.fallback`` log events (and ``specfleet monitor``'s tally of them) and the
    fleet's event stream all name the first RPC device, the one holding the recurrent
    layers, and nothing else. The worker then serves with host checkpoints."""
    fleet = Fleet(settings, hybrid_model, tmp_path)
    holder = f"RPC0[{devices[0]}]"
    try:
        fleet.start("group", extra_env={"SPECFLEET_FAIL_DEVICE_CHECKPOINT": "1"},
                    args=("--ctx", str(CTX), "--rpc", ",".join(devices), "--budget-mib", "64",
                          "--fit-target-mib", "0", "--spec", "mtp", "--draft-max", "3",
                          "--rollback-depth", "1", "--slots", "2", "--metrics-port", "0"))
        info = coordinator.registry.registration("group")
        assert info is not None and info.fit is not None and info.metrics_port
        details = info.fit.details
        assert details["checkpoint_mode"] == "host"
        assert details["checkpoint_fallback"] == "fault_injection"
        assert details["checkpoint_fallback_devices"] == [holder]
        url = f"http://127.0.0.1:{info.metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        assert by_label(text, "specfleet:checkpoint_device_host_fallbacks_total",
                        "checkpoint_device") == {holder: 2.0}
        result = coordinator.submit({"model": MODEL_NAME, "prompt_tokens": PROMPT,
                                     "max_tokens": 24, "speculative": {
                                         "method": "mtp", "draft_max": 3,
                                         "rollback_depth": 1}}).result(timeout=60)
        log = fleet.log("group")
        stream = coordinator.connection.xrange(coordinator.keys.fleet_events())
    finally:
        fleet.stop_all()
    events = [json.loads(line) for line in log.splitlines() if "checkpoint.fallback" in line]
    assert [(e["phase"], e["devices"]) for e in events] == [("reserve", [holder])] * 2
    summary = LogSummary()
    for line in log.splitlines():
        summary.feed(line)
    assert summary.total.to_json()["host_fallbacks_by_device"] == {holder: 2}
    records = [r for _, fields in stream or () if (r := decode(fields))]
    [fallback] = [r for r in records if r["event"] == "worker.host_fallback"]
    assert fallback["devices"] == [holder] and fallback["count"] == 2
    assert result.status is JobStatus.FINISHED and result.telemetry is not None
    assert result.telemetry.checkpoint_mode == "host" and result.telemetry.checkpoint_saves > 0
    with SpeculativeEngine(EngineConfig(model_path=str(hybrid_model), n_ctx=CTX,
                                        n_threads=1)) as engine:
        expected = engine.generate(PROMPT, 24, SpecSettings(method=SpecMethod.NONE)).tokens
    assert result.tokens == expected
