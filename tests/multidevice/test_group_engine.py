"""An engine built from a group fit, in this process: what llama.cpp allocates on each device
is what the fit said, its checkpoints are reserved on the device of the recurrent layers,
and it decodes what the host alone decodes.

This process connects to its devices itself and keeps the connections until it exits (a
device serves one client at a time), so these devices are this file's alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import PROMPT, greedy
from structlog.testing import capture_logs

from shared.protocol import CheckpointMode, SpecMethod, SpecSettings
from worker.engine.engine import EngineConfig, SpeculativeEngine
from worker.engine.rollback.compact import CompactRollback
from worker.fitter import fit_worker, reserve_checkpoints
from worker.fitter.buffers import HOST, parse_buffers
from worker.fitter.devices import device_map
from worker.launch import EngineCapacity, parse_device_group
from worker.llm import capture_llama_log
from worker.llm.placement import placed
from worker.testmodels import TinyModels

from .devices import needs_rpc, rpc_devices

pytestmark = needs_rpc

MIB = 1024 * 1024
#: llama.cpp's log lines carry 0.01 MiB: the most one buffer's figure can be off by.
RESOLUTION = 0.005 * MIB
#: Every kind of buffer llama.cpp logs when it really allocates one.
ALLOCATED = ("model", "kv_buffer", "recurrent", "output", "compute", "checkpoint")


@pytest.fixture(scope="module")
def devices(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with rpc_devices(2, tmp_path_factory.mktemp("rpc")) as endpoints:
        yield ",".join(endpoints)


def _load(model: Path, rpc: str, capacity: EngineCapacity,
          tensor_split: str | None = None) -> Iterator[tuple]:
    """Fit on the host plus the devices, build the engine under the same placement and
    reserve its checkpoints, reading what llama.cpp allocated per device."""
    group = parse_device_group("cpu", rpc, tensor_split=tensor_split)
    with placed(group) as placement:
        fit = fit_worker(str(model), device=group, budget_mib=24, fit_target_mib=0,
                         capacity=capacity, ctx_min=256, n_threads=1)
        with capture_llama_log() as lines:
            engine = SpeculativeEngine(fit.config)
            report = reserve_checkpoints(engine, fit)
        try:
            found = parse_buffers(lines)
            where = device_map(group, placement)
            allocated = {kind: found.by_device(kind, where) for kind in ALLOCATED}
            yield engine, report, allocated
        finally:
            engine.close()


def test_each_device_holds_what_the_fit_said(tiny_models: TinyModels, devices: str) -> None:
    """The dense model, no draft context: every component of every device is one of
    llama.cpp's buffers, so each device's fit is its allocation (within 2%, the log's
    rounding in practice)."""
    for _engine, report, allocated in _load(tiny_models.dense, devices,
                                            EngineCapacity(method=SpecMethod.NGRAM)):
        assert HOST not in allocated["model"]  # a CPU worker's host is its cpu device
        for device in report.devices:
            name, fitted = device.device, device.components
            assert fitted["weights"] == allocated["model"][name]
            assert abs(fitted["kv"] - allocated["kv_buffer"][name]) <= RESOLUTION
            assert abs(fitted["compute"] - allocated["compute"][name]) <= RESOLUTION
            at_load = sum(fitted.values()) - (report.details["runtime_growth_bytes"]
                                              if name == "cpu" else 0)
            real = sum(allocated[kind][name] for kind in ALLOCATED)
            assert abs(at_load - real) <= 0.02 * real, (name, fitted, allocated)


def test_checkpoints_are_reserved_where_the_recurrent_layers_are(tiny_models: TinyModels,
                                                                 devices: str) -> None:
    """The hybrid with MTP and compact rollback (D = 1 < N = 3): its recurrent state and
    its checkpoint are on the first RPC device, as llama.cpp allocated them, and every
    device holds what the fit said, within 2%: the second RPC device too, where llama.cpp's
    no_alloc estimate of the target's compute is 0.50 MiB (5.6%) above its allocation and
    the fit therefore settles on real contexts (docs/fitter.md, "Device groups")."""
    capacity = EngineCapacity(method=SpecMethod.MTP, draft_max=3, rollback_depth=1)
    for engine, report, allocated in _load(tiny_models.hybrid, devices, capacity):
        assert report.details["checkpoint_mode"] == CheckpointMode.DEVICE.value
        first, second = (d.device for d in report.devices[1:])
        group = report.details["snapshot_group_bytes"]
        assert allocated["checkpoint"][first] == pytest.approx(group, abs=0.0005 * MIB)
        assert allocated["checkpoint"][second] == allocated["checkpoint"]["cpu"] == 0
        for device in report.devices:
            name, fitted = device.device, device.components
            assert fitted["weights"] == allocated["model"][name]
            assert fitted["checkpoint_reservation"] == (group if name == first else 0)
            live_and_snapshots = fitted["recurrent"] + fitted["snapshots"]
            assert abs(live_and_snapshots - allocated["recurrent"][name]) <= RESOLUTION
            if name != "cpu":  # target and draft contexts: llama.cpp's three lines there
                contexts = fitted["kv"] + fitted["compute"] + fitted["draft"]
                got = allocated["kv_buffer"][name] + allocated["compute"][name]
                assert abs(contexts - got) <= 3 * RESOLUTION, (name, fitted, allocated)
            at_load = sum(fitted.values()) - (report.details["runtime_growth_bytes"]
                                              if name == "cpu" else 0)
            real = sum(allocated[kind][name] for kind in ALLOCATED)
            assert abs(at_load - real) <= 0.02 * real, (name, fitted, allocated)
        tokens = engine.generate(PROMPT, 24, SpecSettings(method=SpecMethod.MTP, draft_max=3,
                                                          rollback_depth=1)).tokens
        with SpeculativeEngine(EngineConfig(model_path=str(tiny_models.hybrid),
                                            n_ctx=engine.config.n_ctx, n_threads=1)) as alone:
            assert tokens == greedy(alone, 24)


@pytest.mark.parametrize(("tensor_split", "holders"), [(None, (0,)), ("1,2", (0, 1))],
                         ids=["recurrent-on-one", "recurrent-on-both"])
def test_a_device_checkpoint_fallback_names_the_devices_it_left(
        tiny_models: TinyModels, devices: str, tensor_split: str | None,
        holders: tuple[int, ...]) -> None:
    """A slot's device checkpoint lives on the devices of the recurrent layers (the first
    RPC device by default; both with ``--tensor-split 1,2``), and one llama.cpp save covers
    them all. A save that fails for real there moves the slot to the host, and its event and
    telemetry name exactly those devices of the group: not the host, not a device that held
    none of it. The output stays the host's."""
    capacity = EngineCapacity(method=SpecMethod.MTP, draft_max=3, rollback_depth=1)
    settings = SpecSettings(method=SpecMethod.MTP, draft_max=3, rollback_depth=1)
    for engine, report, allocated in _load(tiny_models.hybrid, devices, capacity, tensor_split):
        rpc = [d.device for d in report.devices[1:]]
        held = [rpc[i] for i in holders]
        assert [name for name, n in allocated["checkpoint"].items() if n] == held
        rollback = engine.rollback
        assert isinstance(rollback, CompactRollback)
        store = rollback.stores[0]
        assert store.devices == tuple(held)
        store.fail_device = True  # llama.cpp's real device save now fails
        with capture_logs() as logs:
            result = engine.generate(PROMPT, 24, settings)
        t = result.telemetry
        assert t.host_fallbacks == 1 and t.host_fallback_reason == "fault_injection"
        assert t.host_fallback_devices == held
        assert t.checkpoint_mode == CheckpointMode.HOST and t.checkpoint_saves > 0
        [event] = [e for e in logs if e["event"] == "checkpoint.fallback"]
        assert event["devices"] == held and event["phase"] == "save"
        with SpeculativeEngine(EngineConfig(model_path=str(tiny_models.hybrid),
                                            n_ctx=engine.config.n_ctx, n_threads=1)) as alone:
            assert result.tokens == greedy(alone, 24)
