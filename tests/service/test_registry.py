"""The fleet registry on a real Redis: TTL liveness, claims, being declared lost, and a gap in
everyone's contact with Redis, which declares nobody lost until contact has held a TTL."""

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


def _beat(registry: FleetRegistry, name: str, seconds: float, every: float) -> None:
    """``name`` heartbeats every ``every`` seconds for ``seconds`` (a live worker)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        registry.heartbeat(_info(name))
        time.sleep(every)


def test_registration_expires_without_heartbeats_and_is_claimed_once(settings: Settings) -> None:
    registry = FleetRegistry(Redis.from_url(settings.redis_url), settings.keys, ttl_seconds=1.0)
    registry.register(_info("a"))
    registry.register(_info("b"))
    assert {w.name for w in registry.live_workers()} == {"a", "b"}
    _beat(registry, "a", 1.2, every=0.1)  # a beats, b does not
    assert [w.name for w in registry.live_workers("m")] == ["a"]  # b's TTL ran out
    assert sorted(registry.registered_names()) == ["a", "b"]  # ... but b awaits recovery
    assert registry.claim_lapsed().lost == {"b": "m"}
    assert registry.claim_lapsed().lost == {}
    assert registry.registered_names() == ["a"]


def test_a_gap_in_everyones_contact_declares_nobody_lost_until_contact_holds(
        settings: Settings) -> None:
    """Nobody reaches Redis for two TTLs (as in a stall or an outage, every registration
    lapses), then a comes back: its sweeps leave the lapsed b alone until a has been in
    contact for one TTL (b, alive, would have re-registered by then); after that b is lost."""
    registry = FleetRegistry(Redis.from_url(settings.redis_url), settings.keys, ttl_seconds=1.0)
    registry.register(_info("a"))
    registry.register(_info("b"))
    time.sleep(2.0)  # silence: both lapse
    registry.heartbeat(_info("a"))  # the first stamp after the gap: contact resumes
    early = registry.claim_lapsed()
    assert early.lost == {} and early.deferred == "settling" and early.waiting == 1
    _beat(registry, "a", 1.1, every=0.1)
    assert registry.claim_lapsed().lost == {"b": "m"}


def test_a_sweep_that_ends_a_gap_itself_declares_nobody(settings: Settings) -> None:
    """The first contact after a gap is a sweep (a client's, which beats no heartbeat): it
    cannot tell a stall from a death, so it claims nothing."""
    conn = Redis.from_url(settings.redis_url)
    worker = FleetRegistry(conn, settings.keys, ttl_seconds=1.0)
    worker.register(_info("b"))
    time.sleep(1.2)
    client = FleetRegistry(conn, settings.keys, ttl_seconds=1.0)
    first = client.claim_lapsed()
    assert first.lost == {} and first.deferred == "gap" and first.waiting == 1
    assert client.registered_names() == ["b"]


def test_a_worker_declared_lost_learns_it_on_its_next_heartbeat(settings: Settings) -> None:
    conn = Redis.from_url(settings.redis_url)
    registry = FleetRegistry(conn, settings.keys, ttl_seconds=0.2)
    registry.register(_info("slow"))
    conn.rpush(settings.keys.inflight("slow"), "job-1")  # it holds a job ...
    _beat(registry, "watcher", 0.3, every=0.04)  # ... and stalls past its TTL
    RecoveryMonitor(conn, registry, settings).sweep()  # job-1 no longer exists: skipped
    assert registry.take_jobs("slow") == []  # the sweep emptied its in-flight list
    assert registry.heartbeat(_info("slow")) is False  # it had been declared lost
    assert registry.heartbeat(_info("slow")) is True  # and is back in the fleet
    registry.deregister("slow")
    registry.deregister("watcher")
    assert registry.registered_names() == [] and registry.live_workers() == []
