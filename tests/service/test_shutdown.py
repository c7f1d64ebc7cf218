"""SIGTERM: a worker finishes its job (or, on a second signal, requeues it) and deregisters."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

from rq.command import send_shutdown_command, send_stop_job_command
from rq.serializers import JSONSerializer

from coordinator.client import Coordinator, JobHandle
from shared.protocol import JobStatus, ProgressEvent, TokenEvent
from shared.settings import Settings

from .conftest import _delete_namespace
from .workers import MODEL_NAME, Fleet

REQUEST = {"model": MODEL_NAME, "prompt_tokens": [9, 8, 7], "max_tokens": 60,
           "speculative": {"method": "none"}}


def _wait_exit(fleet: Fleet, name: str, timeout: float = 30) -> int:
    proc = fleet.procs[name]
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        assert time.monotonic() < deadline, f"{name} did not exit"
        time.sleep(0.05)
    return proc.returncode


def _sigterm_mid_generation(fleet: Fleet, coordinator: Coordinator,
                            step_delay: float) -> JobHandle:
    """Start w1, submit, and send SIGTERM once the first tokens are out."""
    fleet.start("w1", step_delay=step_delay)
    handle = coordinator.submit(REQUEST)
    for event in handle.stream(timeout=30):
        if isinstance(event, TokenEvent):
            break
    fleet.kill("w1", signal.SIGTERM)
    return handle


def test_sigterm_finishes_the_current_job_then_deregisters(fleet: Fleet,
                                                           coordinator: Coordinator) -> None:
    handle = _sigterm_mid_generation(fleet, coordinator, step_delay=0.03)
    result = handle.result(timeout=30)
    assert result.status is JobStatus.FINISHED and len(result.tokens) == 60
    assert result.attempts == 1
    assert _wait_exit(fleet, "w1") == 0
    assert coordinator.registry.registered_names() == []
    assert "worker.deregistered" in fleet.log("w1")


def test_second_sigterm_requeues_the_job_for_another_worker(fleet: Fleet,
                                                            coordinator: Coordinator) -> None:
    handle = _sigterm_mid_generation(fleet, coordinator, step_delay=0.05)
    time.sleep(0.2)
    fleet.kill("w1", signal.SIGTERM)
    assert _wait_exit(fleet, "w1") == 0
    fleet.start("w2")
    result = handle.result(timeout=30)
    events = list(coordinator.handle(handle.job_id).stream(timeout=5))
    assert result.status is JobStatus.FINISHED and len(result.tokens) == 60
    assert result.worker == "w2" and result.attempts == 2
    assert any(isinstance(e, ProgressEvent) and e.stage == "interrupted" for e in events)
    [requeued] = [json.loads(line) for line in fleet.log("w1").splitlines()
                  if '"job.requeued"' in line]
    assert requeued["job_id"] == handle.job_id and requeued["worker"] == "w1"
    assert requeued["attempt"] == 1 and requeued["next_attempt"] == 2
    assert requeued["reason"] == "shutdown" and requeued["model"]


def test_rq_commands_reach_the_worker(fleet: Fleet, coordinator: Coordinator) -> None:
    """rq's own tools still work on a specfleet worker: ``send_stop_job_command`` cancels the
    running job, ``send_shutdown_command`` stops the worker cleanly (exit 0, deregistered)."""
    fleet.start("w1", step_delay=0.05)
    handle = coordinator.submit({**REQUEST, "max_tokens": 200})
    for event in handle.stream(timeout=60):
        if isinstance(event, TokenEvent):
            break
    send_stop_job_command(coordinator.connection, handle.job_id, serializer=JSONSerializer)
    assert handle.result(timeout=30).status is JobStatus.CANCELLED
    send_shutdown_command(coordinator.connection, coordinator.keys.rq_worker("w1"))
    assert _wait_exit(fleet, "w1") == 0
    assert not coordinator.registry.is_alive("w1")


def test_rq_commands_reach_only_their_own_deployments_worker(
        fleet: Fleet, coordinator: Coordinator, settings: Settings, dense_model: Path,
        tmp_path: Path) -> None:
    """Two deployments (prefixes) on one Redis, each with a worker named w1: rq's records
    carry no prefix, so each worker is known to rq by its deployment's name for it. An rq
    ``shutdown`` for one stops that one; the other keeps its rq record and serves on (with
    bare names the command stopped both, and each start retired the other's record)."""
    other_settings = settings.model_copy(update={"prefix": f"{settings.prefix}x"})
    other = Fleet(other_settings, dense_model, tmp_path / "other")
    (tmp_path / "other").mkdir()
    try:
        fleet.start("w1")
        other.start("w1")
        conn = coordinator.connection
        mine, theirs = (f"rq:worker:{s.keys.rq_worker('w1')}" for s in (settings, other_settings))
        assert conn.exists(mine) and conn.exists(theirs)
        send_shutdown_command(conn, coordinator.keys.rq_worker("w1"))
        assert _wait_exit(fleet, "w1") == 0
        time.sleep(1.0)  # a command that reached the other worker too has stopped it by now
        assert other.alive("w1") and conn.exists(theirs)
        result = Coordinator(other_settings).submit(REQUEST).result(timeout=30)
        assert result.status is JobStatus.FINISHED and result.worker == "w1"
    finally:
        other.stop_all()
        _delete_namespace(conn, other_settings.prefix)


def test_sigusr1_writes_every_threads_stack_and_the_worker_serves_on(
        fleet: Fleet, coordinator: Coordinator) -> None:
    """``kill -USR1`` shows where a worker waits (its serving loop, its heartbeat and its
    listeners) without stopping it: the next job still finishes. A worker registers before
    its startup recovery and its heartbeat start, so the signal waits for a first job to
    finish: then it is serving (signalled at registration, a clean-clone CI run dumped the
    recovery's stack, with no serving loop in it)."""
    fleet.start("w1")
    assert coordinator.submit(REQUEST).result(timeout=30).status is JobStatus.FINISHED
    fleet.kill("w1", signal.SIGUSR1)
    deadline = time.monotonic() + 10
    while "loop.py" not in fleet.log("w1") or "heartbeat.py" not in fleet.log("w1"):
        assert time.monotonic() < deadline, f"no stack dump in the log: {fleet.log('w1')[-2000:]}"
        time.sleep(0.05)
    assert "channels.py" in fleet.log("w1")  # the rq-command and cancel listeners
    assert fleet.alive("w1")
    assert coordinator.submit(REQUEST).result(timeout=30).status is JobStatus.FINISHED
