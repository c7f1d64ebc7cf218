"""A worker with several slots: jobs run together, each exact, each ending on its own.

Real ``specfleet worker --slots 4`` processes on the tiny dense model: four jobs take the four
slots at once (the registration lists all four), every one equals its own request run alone,
one cancelled slot leaves the others running, kill -9 with four busy slots loses none of them,
and SIGTERM finishes all four (a second one requeues all four).
"""

from __future__ import annotations

import signal
import time

from rq.job import Job
from rq.serializers import JSONSerializer

from coordinator.client import Coordinator, JobHandle
from shared.protocol import JobStatus, ProgressEvent, TokenEvent

from .workers import CTX, MODEL_NAME, Fleet

SLOTS = ("--ctx", str(CTX), "--slots", "4")
PROMPTS = [[3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8], [1, 6, 1, 8], [9, 9, 8, 2, 4, 4, 3]]
STEP_DELAY = 0.03


def _requests(max_tokens: int = 40) -> list[dict[str, object]]:
    methods = ["ngram", "none", "ngram", "none"]
    return [{"model": MODEL_NAME, "prompt_tokens": p, "max_tokens": max_tokens + 5 * i,
             "speculative": {"method": m}} for i, (p, m) in enumerate(zip(PROMPTS, methods,
                                                                          strict=True))]


def _all_started(coordinator: Coordinator, handles: list[JobHandle], worker: str,
                 timeout: float = 60) -> None:
    """Wait until every job has streamed a token and the worker lists them all as running."""
    deadline = time.monotonic() + timeout
    for h in handles:
        for event in h.stream(timeout=timeout):
            if isinstance(event, TokenEvent):
                break
    while True:
        info = next((w for w in coordinator.registry.live_workers() if w.name == worker), None)
        if info is not None and sorted(info.current_jobs) == sorted(h.job_id for h in handles):
            return
        assert time.monotonic() < deadline, f"{worker} never listed all four jobs"
        time.sleep(0.05)


def test_four_slots_run_together_and_each_equals_its_request_alone(
        fleet: Fleet, coordinator: Coordinator) -> None:
    fleet.start("alone", args=("--ctx", str(CTX)))
    expected = [coordinator.submit(r).result(timeout=60).tokens for r in _requests()]
    fleet.kill("alone", signal.SIGTERM)
    fleet.procs["alone"].wait(timeout=30)

    fleet.start("w4", step_delay=STEP_DELAY, args=SLOTS)
    handles = [coordinator.submit(r) for r in _requests()]
    _all_started(coordinator, handles, "w4")
    info = next(w for w in coordinator.registry.live_workers() if w.name == "w4")
    assert info.slots == 4
    results = [h.result(timeout=120) for h in handles]
    assert [r.status for r in results] == [JobStatus.FINISHED] * 4
    assert [r.tokens for r in results] == expected


def test_cancelling_one_slot_leaves_the_others_running(fleet: Fleet,
                                                       coordinator: Coordinator) -> None:
    fleet.start("w4", step_delay=STEP_DELAY, args=SLOTS)
    handles = [coordinator.submit(r) for r in _requests(max_tokens=80)]
    _all_started(coordinator, handles, "w4")
    handles[1].cancel()
    results = [h.result(timeout=120) for h in handles]
    assert results[1].status is JobStatus.CANCELLED
    assert [r.status for i, r in enumerate(results) if i != 1] == [JobStatus.FINISHED] * 3
    assert fleet.alive("w4")


def test_kill_9_with_four_busy_slots_loses_none_of_them(fleet: Fleet,
                                                        coordinator: Coordinator) -> None:
    fleet.start("spare", step_delay=STEP_DELAY, args=SLOTS, wait=False)
    fleet.start("w4", step_delay=STEP_DELAY, args=SLOTS)
    fleet.wait_registered("spare")
    fleet.kill("spare", signal.SIGSTOP)  # out of the way until w4 holds all four
    handles = [coordinator.submit(r) for r in _requests(max_tokens=80)]
    _all_started(coordinator, handles, "w4")
    fleet.kill("w4")
    killed_at = time.time()
    fleet.kill("spare", signal.SIGCONT)
    results = [h.result(timeout=120) for h in handles]
    assert [r.status for r in results] == [JobStatus.FINISHED] * 4
    assert all(r.worker == "spare" and r.attempts == 2 for r in results), results
    restarted = [next(e.ts for e in h.stream(timeout=5) if isinstance(e, ProgressEvent)
                      and e.stage == "started" and e.attempt == 2) for h in handles]
    print(f"kill -9 with 4 busy slots: 4/4 jobs re-running after "
          f"{max(restarted) - killed_at:.1f} s, 0 lost")


def test_sigterm_finishes_every_slot_and_a_second_requeues_them_all(
        fleet: Fleet, coordinator: Coordinator) -> None:
    fleet.start("w4", step_delay=STEP_DELAY, args=SLOTS)
    handles = [coordinator.submit(r) for r in _requests()]
    _all_started(coordinator, handles, "w4")
    fleet.kill("w4", signal.SIGTERM)
    finished = [h.result(timeout=120) for h in handles]
    assert [r.status for r in finished] == [JobStatus.FINISHED] * 4, (finished, fleet.log("w4"))
    assert fleet.procs["w4"].wait(timeout=30) == 0

    fleet.start("w4b", step_delay=STEP_DELAY, args=SLOTS)
    handles = [coordinator.submit(r) for r in _requests(max_tokens=200)]
    _all_started(coordinator, handles, "w4b")
    fleet.kill("w4b", signal.SIGTERM)
    time.sleep(0.2)  # two signals sent back to back reach Python's handler as one
    fleet.kill("w4b", signal.SIGTERM)
    assert fleet.procs["w4b"].wait(timeout=30) == 0
    fleet.start("w4c", args=SLOTS)
    results = [h.result(timeout=120) for h in handles]
    assert [r.status for r in results] == [JobStatus.FINISHED] * 4
    assert all(r.worker == "w4c" and r.attempts == 2 for r in results), results


def test_jobs_route_to_the_context_tier_that_holds_them(fleet: Fleet,
                                                        coordinator: Coordinator) -> None:
    """Two workers of different per-slot context: eight requests that fit only the larger
    are queued on its tier, which the smaller one never takes from; all eight finish there.
    A request that fits both goes to the smaller (the smallest tier that holds it)."""
    fleet.start("small", args=("--ctx", "128"))
    fleet.start("large", args=("--ctx", "1024"))
    prompt = [(7 * i) % 50 + 3 for i in range(200)]
    big = {"model": MODEL_NAME, "prompt_tokens": prompt, "max_tokens": 16,
           "speculative": {"method": "none"}}
    results = [h.result(timeout=120) for h in [coordinator.submit(big) for _ in range(8)]]
    assert [(r.status, r.worker) for r in results] == [(JobStatus.FINISHED, "large")] * 8
    handle = coordinator.submit({**big, "prompt_tokens": prompt[:20]})
    assert handle.result(timeout=60).status is JobStatus.FINISHED  # either worker may take it
    job = Job.fetch(handle.job_id, connection=coordinator.connection, serializer=JSONSerializer)
    assert job.origin == coordinator.keys.queue(MODEL_NAME, ctx=128)  # the smallest that holds it
    assert coordinator.context_tiers(MODEL_NAME) == [128, 1024]
