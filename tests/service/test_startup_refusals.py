"""Worker start-up: what must not serve exits with one line and registers nothing, and what
serves publishes the fit it really reserved, fixed ``--ctx`` or fitted alike.

Every test starts a real ``specfleet worker`` process on a tiny model against the test's own
Redis namespace, and reads the fleet back as an operator does (``specfleet fleet --json``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import specfleet

from coordinator.client import Coordinator
from shared.settings import Settings
from worker.llm.devices import has_local_gpu

from .workers import Fleet

#: A compact-rollback worker (D = 1 < N = 4) on the hybrid model: it holds a checkpoint.
COMPACT = ("--spec", "ngram", "--draft-max", "4", "--rollback-depth", "1")


def _refused(fleet: Fleet, coordinator: Coordinator, name: str, *args: str) -> str:
    """Start a worker that must refuse; returns its one-line message after checking that it
    exited non-zero and left nothing in the registry."""
    fleet.start(name, wait=False, args=args)
    proc = fleet.procs[name]
    assert proc.wait(timeout=120) == 2, fleet.log(name)
    lines = [line for line in fleet.log(name).splitlines() if line.startswith("specfleet:")]
    assert len(lines) == 1, fleet.log(name)
    assert not coordinator.registry.is_alive(name)
    assert coordinator.fleet() == []
    return lines[0]


def _fleet_json(settings: Settings) -> dict:
    env = {**os.environ, "REDIS_URL": settings.redis_url, "SPECFLEET_PREFIX": settings.prefix}
    proc = specfleet("fleet", "--json", env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.skipif(has_local_gpu(), reason="this llama.cpp has a GPU backend")
@pytest.mark.parametrize("args", [
    ("--device", "cuda:0", "--ctx", "512"),  # used to register as a GPU worker
    ("--device", "cuda:0", "--budget-mib", "64", "--fit-target-mib", "0", "--ctx-min", "256"),
], ids=["fixed-ctx", "fitted"])
def test_a_cuda_device_without_gpu_offload_is_refused(fleet: Fleet, coordinator: Coordinator,
                                                     args: tuple[str, ...]) -> None:
    line = _refused(fleet, coordinator, "gpu", *args)
    assert line.startswith("specfleet: error: cannot serve on cuda:0: this llama.cpp build has "
                           "no GPU offload")


def test_a_context_above_training_needs_the_flag(fleet: Fleet,
                                                 coordinator: Coordinator) -> None:
    line = _refused(fleet, coordinator, "long", "--ctx", "1000000000")
    assert line == ("specfleet: error: --ctx 1000000000 exceeds the model's training context "
                    "(4096 tokens); pass --allow-ctx-above-train to run beyond it anyway")


def test_a_context_beyond_memory_fails_fast_with_the_numbers(fleet: Fleet,
                                                            coordinator: Coordinator) -> None:
    line = _refused(fleet, coordinator, "huge", "--ctx", "1000000000", "--allow-ctx-above-train",
                    "--budget-mib", "64", "--fit-target-mib", "0")
    assert line.startswith("specfleet: error: --ctx 1000000000 does not fit: needs at least ")
    assert "64.00 MiB available on cpu (budget: free 64.00 MiB - margin 0.00 MiB)" in line


@pytest.fixture
def hybrid_fleet(settings: Settings, hybrid_model: Path, tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(settings, hybrid_model, tmp_path)
    yield f
    f.stop_all()


@pytest.mark.parametrize(("fail_device", "mode", "size_key"), [
    ("0", "device", "checkpoint_device_bytes_per_slot"),
    # The device allocation fails at reservation and the store falls back to the host: the
    # published fit must say host, with the host size, not the fit's device figures.
    ("1", "host", "checkpoint_host_bytes_per_slot"),
], ids=["device", "host-fallback"])
def test_a_fixed_ctx_worker_reserves_and_publishes_what_it_reserved(
        hybrid_fleet: Fleet, settings: Settings, fail_device: str, mode: str,
        size_key: str) -> None:
    hybrid_fleet.start("w", args=("--ctx", "512", *COMPACT),
                       extra_env={"SPECFLEET_FAIL_DEVICE_CHECKPOINT": fail_device})
    (worker,) = _fleet_json(settings)["workers"]
    fit = worker["fit"]
    assert fit is not None and fit["n_ctx"] == worker["n_ctx"] == 512
    assert fit["details"]["checkpoint_mode"] == mode
    size = fit["details"][size_key]
    assert size > 0 and fit["details"]["checkpoint_reserved_bytes"] == size
    assert fit["components"]["checkpoint_reservation"] == size  # a CPU worker: host memory
    assert fit["devices"][0]["components"] == fit["components"]
    assert fit["total_bytes"] == sum(fit["components"].values())
    reserve = [json.loads(line) for line in hybrid_fleet.log("w").splitlines()
               if '"fit.reserve"' in line]
    assert [(e["mode"], e["reserved_bytes"]) for e in reserve] == [(mode, size)]
