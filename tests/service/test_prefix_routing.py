"""Prefix-affinity routing: a request goes to the worker whose slots hold its prefix while it
has room, and the queues keep every guarantee they had (stealing, recovery, priorities).

Digests are checked alone (prefix property, stable across processes); routing with real
``specfleet worker`` processes on the tiny dense model and a real Redis. Where a test needs a
routed job to wait (a holder that turned busy between a submit's look and its enqueue), it
makes the load figure the router reads stale (``busy`` in the holder's published hash): the
worker rewrites that figure only when a slot admits or ends a job.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

from rq.job import Job
from rq.queue import Queue
from rq.serializers import JSONSerializer

from coordinator.client import Coordinator, JobHandle
from coordinator.routing import choose_holder
from shared.prefix_digest import BUSY_FIELD, request_digests
from shared.protocol import (
    MAX_EMBEDDING_INPUTS,
    EmbeddingRequest,
    GenerationRequest,
    JobStatus,
    Priority,
    ProgressEvent,
    TokenEvent,
    WorkerInfo,
)
from shared.redis_client import connect
from shared.settings import Settings

from .workers import MODEL_NAME, Fleet

#: 100 two-digit ids: "tokens\n" + 300 characters, two whole digest blocks.
PREFIX = [10 + (7 * i) % 90 for i in range(100)]
OTHER = [10 + (11 * i + 3) % 90 for i in range(100)]
STEP_DELAY = 0.05  # test-only slowing: a long job keeps its worker busy for seconds


def _request(prompt: list[int], max_tokens: int = 12, **extra: object) -> dict[str, object]:
    return {"model": MODEL_NAME, "prompt_tokens": prompt, "max_tokens": max_tokens,
            "speculative": {"method": "none"}, **extra}


def _origin(coordinator: Coordinator, job_id: str) -> str:
    """The queue a job was last enqueued on (rq keeps it in the job's hash)."""
    return Job.fetch(job_id, connection=coordinator.connection, serializer=JSONSerializer).origin


def _started(handle: JobHandle, timeout: float = 60) -> ProgressEvent:
    for event in handle.stream(timeout=timeout):
        if isinstance(event, ProgressEvent) and event.stage == "started":
            return event
    raise AssertionError(f"job {handle.job_id} never started")


def _busy_until_first_token(handle: JobHandle) -> None:
    for event in handle.stream(timeout=60):
        if isinstance(event, TokenEvent):
            return


def _make_load_stale(coordinator: Coordinator, worker: str, busy: int) -> None:
    """What a submit would read in a race with the holder's own take."""
    coordinator.connection.hset(coordinator.keys.prefix_blocks(MODEL_NAME, worker),
                                BUSY_FIELD, busy)


def test_digests_share_exactly_the_common_prefix_and_agree_across_processes() -> None:
    system = {"role": "system", "content": "You answer questions about the report. " * 12}
    turn1 = [system, {"role": "user", "content": "What is in section 2? " * 4}]
    answer = {"role": "assistant", "content": "Section 2 describes the method in detail. " * 4}
    turn2 = [*turn1, answer, {"role": "user", "content": "And in section 3? " * 5}]
    first = request_digests(GenerationRequest(messages=turn1))
    second = request_digests(GenerationRequest(messages=turn2))
    assert len(first) >= 3 and second[:len(first)] == first and len(second) > len(first)
    # one letter apart, at the start: every later block's text is the same, its digest not
    other_system = [{"role": "system", "content": "W" + system["content"][1:]}, *turn1[1:]]
    assert not set(request_digests(GenerationRequest(messages=other_system))) & set(first)
    # a text prompt of the same letters is another prompt (it tokenizes differently)
    as_text = GenerationRequest(prompt="".join(m["content"] for m in turn1))
    assert not set(request_digests(as_text)) & set(first)
    code = ("from shared.prefix_digest import request_digests as d; "
            "from shared.protocol import GenerationRequest as G; import json, sys; "
            "print(json.dumps(d(G(messages=json.loads(sys.argv[1])))))")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(turn2)], capture_output=True,
                         text=True, check=True, env={"PYTHONHASHSEED": "12345"})
    assert json.loads(out.stdout) == second


def _registered(name: str, n_ctx: int = 512, slots: int = 1,
                prefix_cache: bool = True) -> WorkerInfo:
    return WorkerInfo(name=name, model_name=MODEL_NAME, model_path="m.gguf", device="cpu",
                      n_ctx=n_ctx, slots=slots, version="0", pid=1, host="h", started_at=0.0,
                      heartbeat_at=0.0, prefix_cache=prefix_cache)


def test_submit_scores_holders_by_depth_then_free_slots(settings: Settings) -> None:
    """The choice itself, against hashes as workers publish them (no worker needed)."""
    conn, keys = connect(settings.redis_url), settings.keys
    request = GenerationRequest(model=MODEL_NAME, prompt_tokens=PREFIX + OTHER)
    digests = request_digests(request)
    assert len(digests) == 4

    def publish(name: str, blocks: int, busy: int) -> None:
        key = keys.prefix_blocks(MODEL_NAME, name)
        conn.delete(key)
        conn.hset(key, mapping={BUSY_FIELD: busy, **dict.fromkeys(digests[:blocks], 1)})

    def chosen(workers: list[WorkerInfo], req: GenerationRequest = request,
               tier: int | None = 512) -> str | None:
        route = choose_holder(conn, keys, req, workers, tier)
        return route.worker if route else None

    deep, wide = _registered("deep"), _registered("wide", slots=4)
    publish("deep", 4, busy=0)
    publish("wide", 2, busy=0)
    assert chosen([deep, wide]) == "deep"  # the deepest prefix wins
    publish("deep", 4, busy=1)
    assert chosen([deep, wide]) == "wide"  # ... while it has a free slot
    publish("deep", 2, busy=0)
    assert chosen([deep, wide]) == "wide"  # equal depth: the most free slots
    own = Queue(keys.own_queue(MODEL_NAME, "wide"), connection=conn).key
    conn.rpush(own, "a", "b", "c", "d")  # jobs already routed to it count as its load
    assert chosen([deep, wide]) == "deep"
    publish("deep", 0, busy=0)
    assert chosen([deep, wide]) is None  # nobody free holds a whole block: shared queues
    publish("deep", 4, busy=0)
    assert chosen([_registered("deep", n_ctx=256), wide]) is None  # its context is too small
    assert chosen([_registered("deep", prefix_cache=False), wide]) is None  # cache off
    opted_out = request.model_copy(update={"prefix_cache": False})
    assert chosen([deep, wide], opted_out) is None
    assert chosen([deep, wide]) == "deep"


def test_a_request_goes_to_the_holder_of_its_prefix_and_elsewhere_when_it_is_busy(
        fleet: Fleet, coordinator: Coordinator) -> None:
    fleet.start("w0", step_delay=STEP_DELAY, wait=False)
    fleet.start("w1", step_delay=STEP_DELAY)
    fleet.wait_registered("w0")
    keys = coordinator.keys
    first = coordinator.submit(_request(PREFIX)).result(timeout=60)
    assert first.status is JobStatus.FINISHED
    holder = first.worker
    assert holder is not None
    other = "w1" if holder == "w0" else "w0"
    conversation = PREFIX + first.tokens
    for turn in range(4):  # each turn extends the last one, as a chat does
        conversation += [20 + turn] * 5
        handle = coordinator.submit(_request(conversation))
        result = handle.result(timeout=60)
        assert result.worker == holder, f"turn {turn} ran on {result.worker}, not {holder}"
        assert _origin(coordinator, handle.job_id) == keys.own_queue(MODEL_NAME, holder)
        conversation += result.tokens
    # The holder busy with a long job: its prefix's next request runs on the other worker.
    long = coordinator.submit(_request(conversation, max_tokens=150))
    _busy_until_first_token(long)
    assert _started(long).worker == holder
    meanwhile = coordinator.submit(_request(conversation + [33] * 5))
    assert meanwhile.result(timeout=60).worker == other
    assert ":w:" not in _origin(coordinator, meanwhile.job_id)
    assert coordinator.handle(long.job_id).result(timeout=60).status is JobStatus.FINISHED
    # A prompt nobody holds goes to the shared queues.
    unheld = coordinator.submit(_request(OTHER))
    assert unheld.result(timeout=60).status is JobStatus.FINISHED
    assert _origin(coordinator, unheld.job_id).startswith(keys.queue(MODEL_NAME))
    assert ":w:" not in _origin(coordinator, unheld.job_id)
    routing = coordinator.connection.hgetall(keys.routing(MODEL_NAME))
    assert int(routing[b"holder"]) == 5 and int(routing[b"shared"]) == 3


def test_a_job_routed_to_a_holder_that_turned_busy_is_stolen_by_an_idle_worker(
        fleet: Fleet, coordinator: Coordinator) -> None:
    fleet.start("w0", step_delay=STEP_DELAY)
    first = coordinator.submit(_request(PREFIX)).result(timeout=60)
    assert first.worker == "w0"
    fleet.start("w1", step_delay=STEP_DELAY)
    long = coordinator.submit(_request(PREFIX, max_tokens=200))  # ~10 s on w0
    _busy_until_first_token(long)
    _make_load_stale(coordinator, "w0", 0)
    routed = coordinator.submit(_request(PREFIX + first.tokens))
    assert _origin(coordinator, routed.job_id) == coordinator.keys.own_queue(MODEL_NAME, "w0")
    submitted = time.monotonic()
    result = routed.result(timeout=60)
    assert result.worker == "w1"  # it did not wait behind the busy holder
    assert time.monotonic() - submitted < 5
    assert "intake.stolen" in fleet.log("w1")
    assert coordinator.handle(long.job_id).result(timeout=60).worker == "w0"


def test_a_killed_holders_waiting_job_runs_elsewhere_and_its_prefixes_vanish(
        fleet: Fleet, coordinator: Coordinator) -> None:
    keys = coordinator.keys
    fleet.start("w0", step_delay=STEP_DELAY)
    first = coordinator.submit(_request(PREFIX)).result(timeout=60)
    assert first.worker == "w0"
    assert coordinator.connection.exists(keys.prefix_blocks(MODEL_NAME, "w0"))
    long = coordinator.submit(_request(PREFIX, max_tokens=200))
    _busy_until_first_token(long)
    _make_load_stale(coordinator, "w0", 0)
    routed = coordinator.submit(_request(PREFIX + first.tokens))
    own = keys.own_queue(MODEL_NAME, "w0")
    assert _origin(coordinator, routed.job_id) == own
    fleet.kill("w0")
    deadline = time.monotonic() + 30
    while ":w:" in _origin(coordinator, routed.job_id):  # recovery hands it back
        assert time.monotonic() < deadline, "the dead holder's own queue was never recovered"
        coordinator.recover()
        time.sleep(0.1)
    assert not coordinator.connection.exists(keys.prefix_blocks(MODEL_NAME, "w0"))
    assert coordinator.connection.zscore(keys.holders(MODEL_NAME), "w0") is None
    assert Queue(own, connection=coordinator.connection).count == 0
    fleet.start("w1")
    for handle, attempts in ((routed, 1), (long, 2)):
        result = coordinator.handle(handle.job_id).result(timeout=60)
        assert result.status is JobStatus.FINISHED and result.worker == "w1"
        assert result.attempts == attempts
    assert sum(coordinator.queue_depths(MODEL_NAME).values()) == 0


def test_a_leaving_holder_hands_its_waiting_jobs_back(fleet: Fleet,
                                                      coordinator: Coordinator) -> None:
    """SIGTERM: the running job finishes there, the routed one waiting goes to the shared
    queue (before another worker even exists) and runs there once."""
    fleet.start("w0", step_delay=STEP_DELAY)
    first = coordinator.submit(_request(PREFIX)).result(timeout=60)
    long = coordinator.submit(_request(PREFIX, max_tokens=60))
    _busy_until_first_token(long)
    _make_load_stale(coordinator, "w0", 0)
    routed = coordinator.submit(_request(PREFIX + first.tokens))
    assert ":w:w0" in _origin(coordinator, routed.job_id)
    fleet.kill("w0", signal.SIGTERM)
    assert fleet.procs["w0"].wait(timeout=60) == 0
    assert coordinator.handle(long.job_id).result(timeout=5).worker == "w0"
    assert ":w:" not in _origin(coordinator, routed.job_id)
    assert "job.handed_back" in fleet.log("w0")
    assert not coordinator.connection.exists(
        coordinator.keys.prefix_blocks(MODEL_NAME, "w0"))
    fleet.start("w1")
    result = routed.result(timeout=60)
    assert (result.status, result.worker, result.attempts) == (JobStatus.FINISHED, "w1", 1)


def test_own_queues_keep_priorities(fleet: Fleet, coordinator: Coordinator) -> None:
    """Taken in the order own high, shared high, own normal, once the holder is free."""
    fleet.start("w0", step_delay=STEP_DELAY)
    first = coordinator.submit(_request(PREFIX)).result(timeout=60)
    long = coordinator.submit(_request(PREFIX, max_tokens=80))
    _busy_until_first_token(long)
    _make_load_stale(coordinator, "w0", -3)  # room for three routed jobs
    held = PREFIX + first.tokens
    own_normal = coordinator.submit(_request(held))
    shared_high = coordinator.submit(_request(OTHER, priority="high"))
    own_high = coordinator.submit(_request(held + [44] * 5, priority="high"))
    keys = coordinator.keys
    assert _origin(coordinator, own_normal.job_id) == keys.own_queue(MODEL_NAME, "w0")
    assert _origin(coordinator, own_high.job_id) == keys.own_queue(MODEL_NAME, "w0",
                                                                    Priority.HIGH)
    assert _origin(coordinator, shared_high.job_id) == keys.queue(MODEL_NAME, Priority.HIGH,
                                                                   coordinator.context_tiers(
                                                                       MODEL_NAME)[0])
    starts = {name: _started(h).ts for name, h in
              (("own_high", own_high), ("shared_high", shared_high), ("own_normal", own_normal))}
    assert sorted(starts, key=starts.__getitem__) == ["own_high", "shared_high", "own_normal"]
    for h in (own_normal, shared_high, own_high, long):
        assert coordinator.handle(h.job_id).result(timeout=60).status is JobStatus.FINISHED


def test_a_slot_held_by_an_embedding_job_counts_as_taken(fleet: Fleet,
                                                         coordinator: Coordinator) -> None:
    """An embedding job holds a slot outside the engine: the published load counts it, so a
    generation whose prefix the worker holds is not routed there to wait behind it, and is
    routed there again once the embedding job ended."""
    fleet.start("w0", step_delay=STEP_DELAY,
                args=("--ctx", "512", "--slots", "2", "--embeddings", "64"))
    first = coordinator.submit(_request(PREFIX)).result(timeout=60)
    long = coordinator.submit(_request(PREFIX, max_tokens=200))  # ~10 s in one slot
    _busy_until_first_token(long)
    # 32 two-token inputs a decode, a decode a pass, a pass >= STEP_DELAY: seconds held
    inputs = [[a, b] for a in range(10, 100) for b in range(10, 33)][:MAX_EMBEDDING_INPUTS]
    embedding = coordinator.submit_task(EmbeddingRequest(model=MODEL_NAME, input=inputs))
    conn, keys = coordinator.connection, coordinator.keys
    follow = GenerationRequest(model=MODEL_NAME, prompt_tokens=PREFIX + first.tokens)
    workers = coordinator.registry.live_workers(MODEL_NAME)

    def busy() -> int:
        return int(conn.hget(keys.prefix_blocks(MODEL_NAME, "w0"), BUSY_FIELD) or 0)

    deadline = time.monotonic() + 30
    while busy() < 2:
        assert time.monotonic() < deadline, "the embedding job's slot was never counted"
        time.sleep(0.01)
    assert choose_holder(conn, keys, follow, workers, None) is None
    assert embedding.result(timeout=60).status is JobStatus.FINISHED
    while busy() > 1:  # published just after the final event
        assert time.monotonic() < deadline, "the embedding job's slot stayed counted"
        time.sleep(0.01)
    route = choose_holder(conn, keys, follow, workers, None)
    assert route is not None and route.worker == "w0"
    assert coordinator.handle(long.job_id).result(timeout=60).status is JobStatus.FINISHED
