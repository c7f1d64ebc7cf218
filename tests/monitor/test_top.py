"""``specfleet top --once --json`` and the gateway's fleet metrics, against a live two-worker fleet.

Both workers are slowed (``SPECFLEET_STEP_DELAY_SECONDS``) so that, with three jobs for two
workers, both are busy and one job waits: the snapshot must show both workers busy, a queue
depth of one and a waiting time; once everything ran, it must show the lifetime telemetry the
workers published equal to the jobs' own.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from gateway.gateway import Gateway
from helpers import specfleet, wait_for
from redis import Redis
from service.conftest import _delete_namespace
from service.workers import MODEL_NAME, Fleet

from coordinator.client import Coordinator
from coordinator.metrics import fleet_snapshot

from .conftest import make_settings
from .scrape import total

NAMES = ("top-a", "top-b")


@pytest.fixture
def two_workers(dense_model: Path, tmp_path: Path) -> Iterator[tuple[Fleet, Gateway]]:
    """Two slowed workers and a gateway (``specfleet serve``) in front of them."""
    settings = make_settings()
    fleet = Fleet(settings, dense_model, tmp_path)
    gateway = Gateway(settings, tmp_path)
    try:
        for name in NAMES:
            fleet.start(name, step_delay=0.1)
        gateway.start()
        yield fleet, gateway
    finally:
        gateway.stop()
        fleet.stop_all()
        _delete_namespace(Redis.from_url(settings.redis_url), settings.prefix)


def gateway_metrics(gateway: Gateway) -> str:
    response = httpx.get(gateway.url + "/metrics", timeout=30)
    assert response.status_code == 200
    return response.text


def top_once(fleet: Fleet) -> dict:
    proc = specfleet("top", "--once", "--json", env=fleet.env(0.0, {}), timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_top_once_json_shows_workers_queues_and_published_telemetry(
        two_workers: tuple[Fleet, Gateway]) -> None:
    fleet, gateway = two_workers
    coordinator = Coordinator(fleet.settings)
    handles = [coordinator.submit({"model": MODEL_NAME, "prompt": f"count {i}:",
                                   "max_tokens": 250, "speculative": {"method": "none"}})
               for i in range(3)]

    def all_busy_one_waiting(snap: dict) -> bool:
        busy = [w for w in snap["workers"] if w["busy_slots"] == 1]
        waiting = sum(q["depth"] for q in snap["queues"] if q["model"] == MODEL_NAME)
        return len(busy) == 2 and waiting == 1

    # Polled in-process (a CLI start costs seconds); then the CLI must show the same state,
    # which lasts a whole job (250 steps of 0.1 s).
    wait_for(lambda: all_busy_one_waiting(fleet_snapshot(coordinator).to_json()), timeout=60,
             what="both workers busy, one job queued")
    busy = top_once(fleet)
    assert all_busy_one_waiting(busy), busy
    assert {w["name"] for w in busy["workers"]} == set(NAMES)
    for w in busy["workers"]:
        assert w["model"] == MODEL_NAME and w["device"] == "cpu"
        assert w["slots"] == 1 and w["n_ctx"] == 512
        assert len(w["current_jobs"]) == 1 and w["current_jobs"][0] in {h.job_id for h in handles}
        assert w["heartbeat_age_seconds"] >= 0
    # The waiting job's queue (whichever tier the coordinator chose) says how long it has
    # waited; every other queue, the high-priority ones among them, is empty and waits 0.
    (queued,) = [q for q in busy["queues"] if q["depth"]]
    assert queued["depth"] == 1 and queued["oldest_wait_seconds"] > 0
    assert not queued["tier"].endswith("high")
    others = [q for q in busy["queues"] if q is not queued]
    assert others and all(q["depth"] == 0 and q["oldest_wait_seconds"] == 0 for q in others)
    assert any(q["tier"].endswith("high") for q in others)
    fleet_metrics = gateway_metrics(gateway)
    assert total(fleet_metrics, "specfleet:queue_depth", model=MODEL_NAME) in (0, 1)
    assert total(fleet_metrics, "specfleet:workers_live", model=MODEL_NAME) == 2
    assert total(fleet_metrics, "specfleet:fleet_slots", model=MODEL_NAME) == 2

    results = [h.result(timeout=120) for h in handles]
    by_worker: dict[str, int] = {}
    for r in results:
        assert r.telemetry is not None and r.worker is not None
        by_worker[r.worker] = by_worker.get(r.worker, 0) + r.telemetry.generated_tokens

    def published(snap: dict) -> bool:
        got = {w["name"]: w["generated_tokens"] for w in snap["workers"]}
        return got == {n: by_worker.get(n, 0) for n in NAMES}

    wait_for(lambda: published(fleet_snapshot(coordinator).to_json()), timeout=30,
             what="heartbeats carrying the jobs' telemetry")
    done = top_once(fleet)
    assert published(done), done
    for w in done["workers"]:
        assert w["busy_slots"] == 0 and w["current_jobs"] == []
        assert w["tokens_per_second"] > 0 and w["replays_per_second"] == 0
        assert w["host_fallbacks"] == 0
        # Every job was placed with the prefix cache on: the hit rate is the jobs' own.
        mine = [r.telemetry for r in results if r.worker == w["name"] and r.telemetry]
        assert sum(t.prefix_hits + t.prefix_misses for t in mine) == len(mine)
        hits = sum(t.prefix_hits for t in mine)
        assert w["prefix_hit_rate"] == pytest.approx(hits / len(mine) if mine else 0.0)
        assert w["cached_tokens"] == sum(t.cached_tokens for t in mine)
    assert all(q["depth"] == 0 for q in done["queues"])
    text = specfleet("top", "--once", env=fleet.env(0.0, {}), timeout=60)
    assert text.returncode == 0 and all(name in text.stdout for name in NAMES), text.stderr
    assert "prefix hits" in text.stdout
    listed = specfleet("fleet", "--json", env=fleet.env(0.0, {}), timeout=60)
    assert listed.returncode == 0, listed.stderr
    published = {w["name"]: w["telemetry"]["generated_tokens"]
                 for w in json.loads(listed.stdout)["workers"]}
    assert published == {n: by_worker.get(n, 0) for n in NAMES}
    idle_metrics = gateway_metrics(gateway)
    assert total(idle_metrics, "specfleet:queue_depth", model=MODEL_NAME) == 0
    assert total(idle_metrics, "specfleet:fleet_busy_slots", model=MODEL_NAME) == 0
    for name in NAMES:  # the gateway re-exports what the workers published: the jobs' sums
        assert total(idle_metrics, "specfleet:worker_telemetry_generated_tokens_total",
                     worker=name) == by_worker.get(name, 0)
        assert total(idle_metrics, "specfleet:worker_telemetry_target_decodes_total",
                     worker=name) == sum(r.telemetry.target_decodes for r in results
                                         if r.telemetry and r.worker == name)
        # ... and each worker's fit, device by device, as top shows it
        info = coordinator.registry.registration(name)
        assert info is not None and info.fit is not None and info.fit.devices
        row = next(w for w in done["workers"] if w["name"] == name)
        assert [d["device"] for d in row["devices"]] == [d.device for d in info.fit.devices]
        for d, shown in zip(info.fit.devices, row["devices"], strict=True):
            fitted = sum(d.components.values())
            assert shown["fitted_bytes"] == fitted > 0
            assert total(idle_metrics, "specfleet:worker_device_fitted_bytes", worker=name,
                         device=d.device) == fitted
            assert total(idle_metrics, "specfleet:worker_device_free_bytes", worker=name,
                         device=d.device) == d.free_bytes
