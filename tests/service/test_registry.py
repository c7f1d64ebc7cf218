"""The fleet registry on a real Redis: TTL liveness, claims, and being declared lost."""

from __future__ import annotations

import time

from redis import Redis

from shared.protocol import WorkerInfo
from shared.recovery import RecoveryMonitor
from shared.registry import FleetRegistry
from shared.settings import Settings


def _info(name: str) -> WorkerInfo:
    now = time.time()
    return WorkerInfo(name=name, model_name="m", model_path="/m.gguf", device="cpu", n_ctx=256,
                      version="test", pid=1, host="h", started_at=now, heartbeat_at=now)


def test_registration_expires_without_heartbeats_and_is_claimed_once(settings: Settings) -> None:
    registry = FleetRegistry(Redis.from_url(settings.redis_url), settings.keys, ttl_seconds=1.0)
    registry.register(_info("a"))
    registry.register(_info("b"))
    assert {w.name for w in registry.live_workers()} == {"a", "b"}
    time.sleep(0.5)
    assert registry.heartbeat(_info("a")) is True
    time.sleep(0.7)
    assert [w.name for w in registry.live_workers("m")] == ["a"]  # b's TTL ran out
    assert sorted(registry.registered_names()) == ["a", "b"]  # ... but b awaits recovery
    assert registry.claim_lost("b") is True
    assert registry.claim_lost("b") is False


def test_a_worker_declared_lost_learns_it_on_its_next_heartbeat(settings: Settings) -> None:
    conn = Redis.from_url(settings.redis_url)
    registry = FleetRegistry(conn, settings.keys, ttl_seconds=0.2)
    registry.register(_info("slow"))
    conn.rpush(settings.keys.inflight("slow"), "job-1")  # it holds a job ...
    time.sleep(0.3)  # ... and stalls past its TTL
    RecoveryMonitor(conn, registry, settings).sweep()  # job-1 no longer exists: skipped
    assert registry.take_jobs("slow") == []  # the sweep emptied its in-flight list
    assert registry.heartbeat(_info("slow")) is False  # it had been declared lost
    assert registry.heartbeat(_info("slow")) is True  # and is back in the fleet
    registry.deregister("slow")
    assert registry.registered_names() == [] and registry.live_workers() == []
