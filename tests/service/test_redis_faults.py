"""Redis refusing for a while, short of an outage: out of memory, busy with a script, stalled
past the worker TTL, loading its dataset after a restart, restarted under a submit or a batch
being waited for. Busy workers ride
each one out and lose, duplicate and re-run nothing; the CLIs ride them out too; and a worker
that really dies is on the fleet's event stream, which every ``top`` and ``monitor`` reads.

One private ``redis-server`` (AOF, so a restart keeps the queues; DEBUG enabled) and one
fleet of two two-slot workers on the tiny model serve the whole module. Every fault is a real
one: ``CONFIG SET maxmemory`` under ``noeviction``, a Lua busy loop past
``busy-reply-threshold``, ``DEBUG SLEEP``, a stopped and restarted server.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from itertools import accumulate
from pathlib import Path

import pytest
from helpers import SPECFLEET, specfleet
from monitor.scrape import total
from redis import Redis
from redis.backoff import NoBackoff
from redis.exceptions import BusyLoadingError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.retry import Retry

from coordinator.client import Coordinator, JobHandle
from shared.protocol import FinalEvent, JobStatus, TokenEvent
from shared.results import JobResult
from shared.settings import Settings

from .private_redis import RedisServer
from .workers import MODEL_NAME, Fleet

JOBS = 8
TTL = 3.0
REQUEST = {"model": MODEL_NAME, "prompt_tokens": [4, 2, 4, 2], "max_tokens": 48,
           "speculative": {"method": "none"}}
WORKER_ARGS = ("--ctx", "512", "--slots", "2", "--metrics-port", "0")
STEP_DELAY = 0.03
#: Keys a slow restart loads at 1 ms each (``key-load-delay``).
FILLERS = 8000


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    redis = RedisServer(tmp_path_factory.mktemp("redis"), "--save", "", "--appendonly", "yes",
                        "--appendfsync", "always", "--maxmemory-policy", "noeviction",
                        "--enable-debug-command", "yes", "--busy-reply-threshold", "200")
    redis.start()
    yield redis
    redis.kill()


@pytest.fixture(scope="module")
def faults_settings(server: RedisServer) -> Settings:
    return Settings(redis_url=server.url, prefix=f"t{uuid.uuid4().hex[:12]}",
                    heartbeat_seconds=0.25, worker_ttl_seconds=TTL, token_chunk=4,
                    token_flush_seconds=0.0, redis_outage_seconds=60)


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def fleet(faults_settings: Settings, dense_model: Path, logs: Path) -> Iterator[Fleet]:
    f = Fleet(faults_settings, dense_model, logs)
    try:
        f.start("w1", step_delay=STEP_DELAY, args=WORKER_ARGS, wait=False)
        f.start("w2", step_delay=STEP_DELAY, args=WORKER_ARGS)
        f.wait_registered("w1")
        yield f
    finally:
        f.stop_all()


@pytest.fixture(scope="module")
def reference(fleet: Fleet) -> JobResult:
    result = Coordinator(fleet.settings).submit(REQUEST).result(timeout=60)
    assert result.status is JobStatus.FINISHED
    return result


def _under_fault(fleet: Fleet, fault: Callable[[], None]) -> list[JobHandle]:
    """Submit JOBS jobs, start ``fault`` once the first tokens are out (busy workers, jobs
    queued behind them), and return once every job has ended."""
    coordinator = Coordinator(fleet.settings)
    handles = [coordinator.submit(REQUEST) for _ in range(JOBS)]
    for event in handles[0].stream(timeout=60):
        if isinstance(event, TokenEvent):
            break
    fault()
    over = time.monotonic()
    for h in handles:
        h.result(timeout=180)
    print(f"{JOBS} jobs done {time.monotonic() - over:.1f} s after the fault ended")
    return handles


def _exactly_once(handles: list[JobHandle], reference: JobResult) -> None:
    """Each job ran once (attempt 1) and finished with the reference tokens; every event of
    its stream is there once, numbered without a gap, and its token events cover the
    generation chunk after chunk, none twice and none missing."""
    for h in handles:
        events = list(h.stream(timeout=10))
        assert [e.seq for e in events] == list(range(1, len(events) + 1))
        assert {e.attempt for e in events} == {1}
        finals = [e for e in events if isinstance(e, FinalEvent)]
        assert [f.status for f in finals] == [JobStatus.FINISHED]
        assert finals[0].tokens == reference.tokens
        chunks = [e for e in events if isinstance(e, TokenEvent)]
        assert [e.index for e in chunks] == [0, *accumulate(len(e.tokens) for e in chunks[:-1])]
        assert [t for e in chunks for t in e.tokens] == reference.tokens


def _nobody_lost(fleet: Fleet) -> str:
    logs = fleet.log("w1") + fleet.log("w2")
    assert fleet.alive("w1") and fleet.alive("w2")
    assert '"event": "worker.lost"' not in logs and "worker.declared_lost" not in logs
    assert "worker.redis_gave_up" not in logs
    return logs


def _fault_counts(fleet: Fleet, kind: str) -> float:
    """``specfleet:redis_faults_total{kind}`` summed over the fleet's workers."""
    counted = 0.0
    for name in ("w1", "w2"):
        info = Coordinator(fleet.settings).registry.registration(name)
        assert info is not None and info.metrics_port
        text = urllib.request.urlopen(f"http://127.0.0.1:{info.metrics_port}/metrics",
                                      timeout=10).read().decode()
        counted += total(text, "specfleet:redis_faults_total", kind=kind)
    return counted


def _wait_registered(fleet: Fleet) -> None:
    fleet.wait_registered("w1")
    fleet.wait_registered("w2")


def test_ten_seconds_out_of_memory_lose_duplicate_and_rerun_nothing(
        fleet: Fleet, server: RedisServer, reference: JobResult) -> None:
    admin = server.client()

    def out_of_memory() -> None:
        admin.config_set("maxmemory", 1)  # noeviction: every write that may grow is refused
        try:
            with pytest.raises(ResponseError, match="maxmemory"):
                admin.set(f"{fleet.settings.prefix}:probe", 1)
            time.sleep(10)
        finally:
            admin.config_set("maxmemory", 0)

    handles = _under_fault(fleet, out_of_memory)
    _exactly_once(handles, reference)
    logs = _nobody_lost(fleet)
    assert '"fault": "oom"' in logs and "redis.recovered" in logs
    _wait_registered(fleet)
    assert _fault_counts(fleet, "oom") >= 2  # each worker's heartbeat, the busy ones' writes


def test_a_script_keeping_redis_busy_is_waited_out(fleet: Fleet, server: RedisServer,
                                                   reference: JobResult) -> None:
    """A Lua loop runs past busy-reply-threshold (every command is answered BUSY, reads
    too) for 5 s, past the worker TTL, until SCRIPT KILL."""
    def busy() -> None:
        loop = threading.Thread(target=lambda: pytest.raises(
            ResponseError, server.client().eval, "while true do end", 0))
        loop.start()
        time.sleep(5)
        server.client().script_kill()
        loop.join(timeout=10)

    handles = _under_fault(fleet, busy)
    _exactly_once(handles, reference)
    logs = _nobody_lost(fleet)
    assert '"fault": "busy"' in logs
    _wait_registered(fleet)
    assert _fault_counts(fleet, "busy") >= 2


def test_redis_stalled_past_the_ttl_three_times_reruns_nothing(
        fleet: Fleet, server: RedisServer, reference: JobResult) -> None:
    """``DEBUG SLEEP`` past the 3 s TTL, three times: every registration lapses during each
    stall, yet nobody is declared lost and no job runs twice.

    That the registrations lapsed is read on the sleeper's own connection, pipelined behind
    the stall: Redis runs a client's buffered commands before it serves the workers' queued
    heartbeats, so the reads see the state the stall left. (Whether a worker's sweep sees a
    lapse is a race between the two workers' queued heartbeats and sweeps: asserting its
    ``recovery.deferred`` event failed every time this module ran alone.)"""
    registrations = [fleet.settings.keys.worker(name) for name in ("w1", "w2")]
    lapsed: list[list[int]] = []

    def stalls() -> None:
        sleeper = Redis(host="127.0.0.1", port=server.port, socket_timeout=30)
        for _ in range(3):
            pipe = sleeper.pipeline(transaction=False)
            pipe.execute_command("DEBUG", "SLEEP", TTL + 0.5)
            for key in registrations:
                pipe.exists(key)
            lapsed.append(pipe.execute()[1:])
            time.sleep(0.5)

    handles = _under_fault(fleet, stalls)
    assert lapsed == [[0, 0]] * 3  # every registration had lapsed when each stall ended
    _exactly_once(handles, reference)
    _nobody_lost(fleet)


def test_a_restart_that_loads_its_dataset_slowly_is_waited_out(
        fleet: Fleet, server: RedisServer, reference: JobResult) -> None:
    """Redis restarts under busy workers and answers LOADING while it reads its AOF (8,000
    keys at 1 ms each: longer than redis-py's own retries): the workers wait, no job runs
    twice."""
    admin = server.client()
    with admin.pipeline(transaction=False) as pipe:
        for i in range(FILLERS):
            pipe.set(f"{fleet.settings.prefix}:filler:{i}", "x" * 100)
        pipe.execute()
    admin.bgrewriteaof()  # the fillers into the RDB base the restart loads key by key
    while int(admin.info("persistence")["aof_rewrite_in_progress"]):
        time.sleep(0.05)
    loading: list[BaseException] = []

    def slow_restart() -> None:
        server.stop()
        plain = server.config
        server.config = (*plain, "--key-load-delay", "1000",
                         "--loading-process-events-interval-bytes", "1024")
        started = threading.Event()
        probe = threading.Thread(target=_probe_loading, args=(server, started, loading))
        probe.start()
        try:
            server.start()
        finally:
            started.set()
            server.config = plain
            probe.join()

    handles = _under_fault(fleet, slow_restart)
    assert loading, "Redis never answered LOADING"
    for h in handles:
        result = h.result(timeout=10)
        assert result.status is JobStatus.FINISHED and result.tokens == reference.tokens
        assert result.attempts == 1
    logs = _nobody_lost(fleet)
    assert '"fault": "loading"' in logs
    server.client().delete(*[f"{fleet.settings.prefix}:filler:{i}" for i in range(FILLERS)])


def _probe_loading(server: RedisServer, started: threading.Event,
                   seen: list[BaseException]) -> None:
    """Until ``started``: what a client without retries hears (BusyLoadingError: LOADING)."""
    probe = Redis(host="127.0.0.1", port=server.port, socket_timeout=2,
                  retry=Retry(NoBackoff(), 0))
    while not started.is_set():
        try:
            probe.get("probe")
        except BusyLoadingError as exc:
            seen.append(exc)
        except RedisConnectionError:
            pass
        time.sleep(0.05)


def _cli_env(settings: Settings) -> dict[str, str]:
    return {**os.environ, "REDIS_URL": settings.redis_url, "SPECFLEET_PREFIX": settings.prefix,
            "SPECFLEET_WORKER_TTL_SECONDS": str(settings.worker_ttl_seconds),
            "SPECFLEET_HEARTBEAT_SECONDS": str(settings.heartbeat_seconds),
            "SPECFLEET_REDIS_OUTAGE_SECONDS": "60"}


def test_submit_rides_out_a_ten_second_restart(fleet: Fleet, server: RedisServer,
                                               reference: JobResult) -> None:
    """Redis goes away before ``specfleet submit`` starts and comes back 10 s later (every
    registration has lapsed by then): the submit waits, queues once and prints the result."""
    server.stop()
    proc = subprocess.Popen(
        [SPECFLEET, "submit", "--model", MODEL_NAME, "--prompt-tokens", "4,2,4,2",
         "--max-tokens", str(REQUEST["max_tokens"]), "--spec", "none", "--json"],
        env=_cli_env(fleet.settings), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    try:
        time.sleep(10)
        assert proc.poll() is None, proc.communicate()
    finally:
        server.start()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    result = json.loads(out)
    assert result["status"] == "finished" and result["tokens"] == reference.tokens
    assert result["attempts"] == 1
    assert '"operation": "submit.admit"' in err and "redis.recovered" in err
    _nobody_lost(fleet)


def test_batch_submit_wait_prints_the_id_first_and_rides_out_a_blip(
        fleet: Fleet, server: RedisServer, tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text("".join(
        json.dumps({"custom_id": f"r{i}", "body": {**REQUEST, "max_tokens": 128}}) + "\n"
        for i in range(6)))
    proc = subprocess.Popen([SPECFLEET, "batch", "submit", str(source), "--model", MODEL_NAME,
                             "--wait"], env=_cli_env(fleet.settings), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    batch_id = proc.stdout.readline().strip()
    assert batch_id.startswith("batch_")
    admin = server.client()
    status = admin.hget(fleet.settings.keys.batch(batch_id), "status")
    assert status is not None and status.decode() not in ("completed", "failed", "cancelled")
    deadline = time.monotonic() + 60
    while admin.hlen(fleet.settings.keys.batch_jobs(batch_id)) < 6:  # every line queued:
        assert time.monotonic() < deadline, "the batch's lines were never queued"
        time.sleep(0.05)  # the command is waiting for the batch now
    assert admin.hget(fleet.settings.keys.batch(batch_id), "status") == b"in_progress"
    time.sleep(1)  # past the queueing's last steps: the command polls the batch now
    server.stop()  # a blip while it waits
    time.sleep(5)
    assert proc.poll() is None, proc.communicate()
    server.start()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    batch = json.loads(out)
    assert batch["id"] == batch_id and batch["status"] == "completed"
    assert batch["request_counts"]["completed"] == 6
    _nobody_lost(fleet)


def test_a_lost_worker_is_on_the_fleet_stream_that_top_and_monitor_read(
        fleet: Fleet, logs: Path) -> None:
    """A worker of another model dies holding a job; one of the fleet's workers sweeps it.
    The victim's own log cannot say so (it died), but ``top`` and ``monitor
    --fleet-events`` over that log alone both show it, with its model and job."""
    settings = fleet.settings
    fleet.start("victim", step_delay=0.1,
                args=("--ctx", "512", "--model-name", "other"))
    coordinator = Coordinator(settings)
    handle = coordinator.submit({**REQUEST, "model": "other", "max_tokens": 400})
    for event in handle.stream(timeout=60):
        if isinstance(event, TokenEvent):
            break
    fleet.kill("victim")
    fleet.procs["victim"].wait(timeout=10)
    env = _cli_env(settings)
    deadline = time.monotonic() + 60
    while True:
        top = specfleet("top", "--once", "--json", env=env, timeout=60)
        assert top.returncode == 0, top.stderr
        lost = json.loads(top.stdout)["lost"]
        if lost:
            break
        assert time.monotonic() < deadline, "nobody declared the dead worker lost"
        time.sleep(0.5)
    (row,) = lost
    assert row["worker"] == "victim" and row["model"] == "other"
    assert row["jobs"] == [handle.job_id] and row["requeued"] == [handle.job_id]
    assert row["by"] in ("w1", "w2")
    victim_log = str(logs / "victim.log")
    assert '"event": "worker.lost"' not in fleet.log("victim")
    blind = json.loads(specfleet("monitor", "--json", victim_log, env=env).stdout)
    assert blind["workers"]["victim"]["lost"] == 0  # the log alone cannot tell
    seen = specfleet("monitor", "--json", "--fleet-events", "--fail-on", "lost>0", victim_log,
                     env=env)
    assert seen.returncode == 1, seen.stderr
    out = json.loads(seen.stdout)
    assert out["workers"]["victim"]["lost"] == 1 and out["models"]["other"]["lost"] == 1
    assert out["alerts"] == ["lost>0 holds for total, victim"]
    coordinator.cancel(handle.job_id)  # no worker of "other" is left to run it
