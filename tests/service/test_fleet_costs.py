"""What the fleet costs Redis per heartbeat must not grow with the fleet: counted exactly with
``INFO commandstats`` on a private Redis (``CONFIG RESETSTAT`` would disturb a shared one).
docs/scale.md has the measured figures."""

from __future__ import annotations

import time
from pathlib import Path

from redis import Redis
from rq.queue import Queue

from shared.keys import Keys
from shared.protocol import WorkerInfo
from shared.registry import FleetRegistry
from worker.service.intake import JobIntake

from .private_redis import private_redis

FLEET = 40


def _info(name: str) -> WorkerInfo:
    now = time.time()
    return WorkerInfo(name=name, model_name="m", model_path="/m.gguf", device="cpu", n_ctx=256,
                      version="test", pid=1, host="h", started_at=now, heartbeat_at=now)


def _calls(conn: Redis, command: str) -> int:
    stats = conn.info("commandstats").get(f"cmdstat_{command}")
    return int(stats["calls"]) if stats else 0


def test_a_sweep_looks_only_at_names_not_beaten_lately(tmp_path: Path) -> None:
    """Every worker sweeps on every heartbeat, so a sweep that looked up each registered
    name would cost the fleet N x N lookups per interval. A sweep over FLEET live workers
    and one whose registration was dropped (``forget``) looks that one up and finds it
    lost: one EXISTS, not FLEET + 1."""
    with private_redis(tmp_path) as port:
        conn = Redis(host="127.0.0.1", port=port)
        registry = FleetRegistry(conn, Keys("costs"), ttl_seconds=1.0)
        names = [f"w{i}" for i in range(FLEET)]
        deadline = time.monotonic() + 1.2  # contact must hold one TTL before anyone is lost
        while time.monotonic() < deadline:
            for name in [*names, "gone"]:
                registry.heartbeat(_info(name))
            time.sleep(0.1)
        registry.forget("gone")
        conn.config_resetstat()
        sweep = registry.claim_lapsed()
        assert sweep.lost == {"gone": "m"}
        assert _calls(conn, "exists") == 1
        assert sorted(registry.registered_names()) == sorted(names)


def test_an_idle_take_looks_only_at_own_queues_a_job_was_routed_to(tmp_path: Path) -> None:
    """An idle worker takes over jobs waiting in other holders' own queues. Looking at every
    holder's two queues on each idle poll would cost the fleet N x N lookups a poll; only the
    queues a routed job went to (``Keys.waiting_own_queues``) are looked at, and a taken-over
    job is still taken once it has waited a poll."""
    with private_redis(tmp_path) as port:
        conn = Redis(host="127.0.0.1", port=port)
        keys = Keys("costs")
        prefix = Queue.redis_queue_namespace_prefix
        conn.zadd(keys.holders("m"), {f"w{i}": 256 for i in range(FLEET)})
        routed = prefix + keys.own_queue("m", "w7")
        conn.rpush(routed, "job-1")  # as the coordinator routes one (coordinator/client.py)
        conn.sadd(keys.waiting_own_queues("m"), routed)
        intake = JobIntake(conn, keys, "idle", "m", [keys.queue("m")], 256, idle_poll=0.05)
        conn.config_resetstat()
        assert intake.take(block=False) is None  # seen at the head: taken after a poll
        assert _calls(conn, "type") == 2  # its shared queue and the one routed-to queue
        time.sleep(0.06)
        taken = intake.take(block=False)
        assert taken is not None and (taken.job_id, taken.queue_key) == ("job-1", routed)
        assert intake.take(block=False) is None  # finds the routed queue gone: drops it
        assert conn.smembers(keys.waiting_own_queues("m")) == set()
        conn.config_resetstat()
        assert intake.take(block=False) is None
        assert _calls(conn, "type") == 1  # its shared queue only
