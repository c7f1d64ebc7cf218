"""A worker over a device group: the host plus two RPC device processes, as one worker.

It fits every device, registers one worker whose fit lists them all in the model's order,
and serves a job through Redis with the output a one-device engine computes. Submitters see
nothing else: routing and capacity read the fitted context as for any worker.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from multidevice.devices import needs_rpc, rpc_devices

from coordinator.client import Coordinator
from shared.protocol import JobStatus, SpecSettings
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
