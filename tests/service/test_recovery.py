"""Crash recovery: kill -9 a worker mid-generation; its job finishes on another worker."""

from __future__ import annotations

import signal
import threading
import time

from redis import Redis
from rq.job import Job
from rq.queue import Queue
from rq.serializers import JSONSerializer

from coordinator.client import Coordinator
from shared.event_stream import EventWriter
from shared.protocol import (
    JOB_FUNCTION,
    FinalEvent,
    JobStatus,
    ProgressEvent,
    TokenEvent,
    WorkerInfo,
)
from shared.recovery import RecoveryMonitor
from shared.redis_client import connect
from shared.registry import FleetRegistry
from shared.settings import Settings

from .workers import MODEL_NAME, Fleet, wait_rq_ended

#: Plain decoding: a token a step, so STEP_DELAY spreads a job over 2 s. With the default
#: drafter a repeat of this request is drafted whole from the worker's cached answer and
#: finished in one step, before the kill could land (a flaky pass/fail on timing).
REQUEST = {"model": MODEL_NAME, "prompt_tokens": [3, 1, 4, 1, 5], "max_tokens": 48,
           "speculative": {"method": "none"}}
STEP_DELAY = 0.04  # test-only slowing, so that the kill lands mid-generation
REPETITIONS = 10


def test_kill_9_mid_generation_ten_times_loses_nothing(fleet: Fleet,
                                                        coordinator: Coordinator) -> None:
    undisturbed = None
    fleet.start("w0", step_delay=STEP_DELAY, wait=False)
    fleet.start("w1", step_delay=STEP_DELAY)
    fleet.wait_registered("w0")
    undisturbed = coordinator.submit(REQUEST).result(timeout=60)
    assert undisturbed.status is JobStatus.FINISHED
    next_name = 2
    for _ in range(REPETITIONS):
        handle = coordinator.submit(REQUEST)
        events = handle.stream(timeout=60)
        victim = fleet.kill_runner(events)  # once the first tokens of attempt 1 are out
        killed_at = time.time()
        fleet.start(f"w{next_name}", step_delay=STEP_DELAY, wait=False)
        next_name += 1
        rest = list(events)

        final = rest[-1]
        assert isinstance(final, FinalEvent) and final.status is JobStatus.FINISHED
        assert final.tokens == undisturbed.tokens
        assert final.worker != victim
        restarted = next(e for e in rest if isinstance(e, ProgressEvent)
                         and e.stage == "started" and e.attempt == 2)
        assert restarted.ts - killed_at < 10
        assert any(isinstance(e, ProgressEvent) and e.stage == "requeued" for e in rest)
        assert handle.result(timeout=5).attempts == 2
        # A reader replaying both attempts sees the text once, as if nothing had happened.
        assert "".join(coordinator.handle(handle.job_id).text_stream(timeout=5)) == final.text
        wait_rq_ended(coordinator, handle.job_id)  # rq's record follows the final event
    assert sum(coordinator.queue_depths(MODEL_NAME).values()) == 0
    # Nothing left for rq's own abandoned-job cleanup to fail later.
    for name in coordinator.queue_depths(MODEL_NAME):
        queue = Queue(name, connection=coordinator.connection, serializer=JSONSerializer)
        assert queue.started_job_registry.get_job_ids(cleanup=False) == []
        assert queue.failed_job_registry.get_job_ids(cleanup=False) == []


def _ghost_holds_a_job(settings: Settings) -> tuple[Redis, Queue, Job, FleetRegistry]:
    """A worker "ghost" took a job and died (listed, registration expired), with the fleet
    in contact with Redis for a TTL, so a sweep may declare it lost."""
    conn = connect(settings.redis_url)
    keys = settings.keys
    queue = Queue(keys.queue(MODEL_NAME), connection=conn, serializer=JSONSerializer)
    job = queue.enqueue(JOB_FUNCTION, REQUEST, job_id="lost-job-" + settings.prefix)
    conn.lmove(queue.key, keys.inflight("ghost"))  # a worker took it ...
    registry = FleetRegistry(conn, keys, settings.worker_ttl_seconds)
    conn.zadd(keys.workers(), {"ghost": 1.0})  # ... and died: listed, registration expired
    live = WorkerInfo(name="live", model_name=MODEL_NAME, model_path="/m.gguf", device="cpu",
                      n_ctx=256, version="test", pid=1, host="h", started_at=time.time(),
                      heartbeat_at=time.time())
    in_contact = time.monotonic() + settings.worker_ttl_seconds + 0.2
    while time.monotonic() < in_contact:  # the fleet in contact with Redis for a TTL
        registry.heartbeat(live)
        time.sleep(settings.heartbeat_seconds)
    registry.deregister("live")
    return conn, queue, job, registry


def test_concurrent_monitors_requeue_a_lost_workers_job_once(settings: Settings) -> None:
    """Many monitors sweeping at once: the lost worker's job is queued exactly once."""
    conn, queue, job, registry = _ghost_holds_a_job(settings)
    monitors = [RecoveryMonitor(conn, registry, settings) for _ in range(8)]
    results: list[list[str]] = []
    threads = [threading.Thread(target=lambda m=m: results.append(m.sweep())) for m in monitors]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert sorted(sum(results, [])) == [job.id]
    assert queue.get_job_ids() == [job.id]
    assert registry.registered_names() == []


def test_a_requeued_attempt_cannot_end_the_job(settings: Settings) -> None:
    """A stalled worker that wakes after recovery requeued its job and finishes the step it
    was in: its final (and error) event is refused in the append script itself, so the job
    ends once, by the attempt that re-ran it (the soak's "finished twice")."""
    conn, _, job, registry = _ghost_holds_a_job(settings)
    conn.set(settings.keys.attempts(job.id), 1)  # the ghost was running attempt 1
    assert RecoveryMonitor(conn, registry, settings).sweep() == [job.id]

    stale = EventWriter.for_job(conn, settings, job.id, 1)
    assert stale.final(status=JobStatus.FINISHED, tokens=[1], text="x").seq == 0
    assert stale.error("late", "error").seq == 0
    assert stale.progress("still running").seq > 0  # anything else is still written
    rerun = EventWriter.for_job(conn, settings, job.id, 2)
    assert rerun.final(status=JobStatus.FINISHED, tokens=[1, 2], text="xy").seq > 0

    finals = [e for e in Coordinator(settings).handle(job.id).stream(timeout=5)
              if isinstance(e, FinalEvent)]
    assert [(f.attempt, f.tokens) for f in finals] == [(2, [1, 2])]


def test_a_requeued_job_cancelled_in_its_queue_still_ends(settings: Settings) -> None:
    """The cancel's final is the attempt that will never run, not the superseded one (which
    the append script refuses): a reader still sees the job end."""
    conn, _, job, registry = _ghost_holds_a_job(settings)
    conn.set(settings.keys.attempts(job.id), 1)
    assert RecoveryMonitor(conn, registry, settings).sweep() == [job.id]
    coordinator = Coordinator(settings)
    assert coordinator.cancel(job.id)
    final = coordinator.handle(job.id).result(timeout=5)
    assert (final.status, final.attempts) == (JobStatus.CANCELLED, 2)


def test_a_job_taken_after_the_sweep_that_declared_its_worker_lost_is_handed_back(
        fleet: Fleet, coordinator: Coordinator) -> None:
    """A stalled worker, resumed, can take a job before its heartbeat learns it was declared
    lost; the sweep that claimed it took only what was in flight then, so the worker must hand
    this one back, not drop it with its stale runs (the soak's lost batch line)."""
    conn, keys = coordinator.connection, fleet.settings.keys
    fleet.start("w1", step_delay=0.1, extra_env={"SPECFLEET_HEARTBEAT_SECONDS": "3",
                                                 "SPECFLEET_WORKER_TTL_SECONDS": "30"})
    beat = conn.zscore(keys.workers(), "w1")
    while conn.zscore(keys.workers(), "w1") == beat:  # just after a beat: 3 s to the next
        time.sleep(0.02)
    conn.zrem(keys.workers(), "w1")  # a sweep claims it (its in-flight list is empty) ...
    assert FleetRegistry(conn, keys, 30).take_jobs("w1") == []
    queued = Coordinator(fleet.settings.model_copy(update={"require_live_worker": False}))
    handle = queued.submit({**REQUEST, "max_tokens": 60})  # ... and it takes a job: 6 s
    result = handle.result(timeout=60)
    assert result.status is JobStatus.FINISHED and result.attempts == 2
    log = fleet.log("w1")
    assert "worker.declared_lost" in log and '"reason": "lost"' in log


def test_a_stalled_worker_is_replaced_and_stands_down(fleet: Fleet,
                                                      coordinator: Coordinator) -> None:
    """SIGSTOP past the TTL: the job re-runs elsewhere; the stalled worker, once resumed,
    learns it was declared lost, stops its stale attempt without a final event, serves on."""
    request = {**REQUEST, "max_tokens": 60}
    fleet.start("w1", step_delay=0.05)
    handle = coordinator.submit(request)
    events = handle.stream(timeout=60)
    for event in events:
        if isinstance(event, TokenEvent):
            break
    fleet.kill("w1", signal.SIGSTOP)
    fleet.start("w2", step_delay=0.05)
    for event in events:
        if isinstance(event, ProgressEvent) and event.stage == "started":
            assert event.attempt == 2 and event.worker == "w2"
            break
    fleet.kill("w1", signal.SIGCONT)
    rest = list(events)

    finals = [e for e in rest if isinstance(e, FinalEvent)]
    assert [(f.attempt, f.worker, f.status) for f in finals] == [(2, "w2", JobStatus.FINISHED)]
    replay = list(coordinator.handle(handle.job_id).stream(timeout=5))
    assert [e for e in replay if isinstance(e, FinalEvent)] == finals
    fleet.wait_registered("w1")  # back in the fleet
    assert "worker.declared_lost" in fleet.log("w1")
    fleet.kill("w2", signal.SIGTERM)
    fleet.procs["w2"].wait(timeout=30)
    after = coordinator.submit({**REQUEST, "max_tokens": 4}).result(timeout=30)
    assert after.status is JobStatus.FINISHED and after.worker == "w1"


def test_a_worker_restarted_under_its_name_after_kill_9_takes_over_at_once(
        fleet: Fleet, coordinator: Coordinator) -> None:
    """The dead holder's registration would live for the whole TTL (30 s here); its host is
    ours and its pid is gone, so the new process registers at once and re-runs its job."""
    long_ttl = {"SPECFLEET_WORKER_TTL_SECONDS": "30"}
    fleet.start("w1", step_delay=STEP_DELAY, extra_env=long_ttl)
    handle = coordinator.submit(REQUEST)
    events = handle.stream(timeout=60)
    for event in events:
        if isinstance(event, TokenEvent):
            break
    fleet.kill("w1")
    fleet.procs["w1"].wait(timeout=10)
    killed_at = time.monotonic()
    fleet.start("w1", step_delay=STEP_DELAY, extra_env=long_ttl)
    registered_after = time.monotonic() - killed_at
    final = list(events)[-1]
    assert isinstance(final, FinalEvent) and final.status is JobStatus.FINISHED
    assert final.attempt == 2 and final.worker == "w1"
    assert registered_after < 15  # well inside the 30 s TTL the old registration had left
    assert '"event": "worker.takeover"' in fleet.log("w1")
