"""The gateway under faults and load, with real processes: a private ``redis-server`` (AOF, so
it can restart), one worker (8 slots, slowed a little per step), ``specfleet serve``
processes.

Issue 23: streams across a Redis restart finish, or end with an error event once the
gateway's outage deadline passes, never cut silently; 1,000 concurrent streams with no failed
or empty response on a bounded number of Redis connections; a request past the in-flight
limit is a 503 with ``Retry-After``; batch lines wait for a worker within the window and
expire after it; create answers ``validating`` at once; duplicate ``custom_id``s and a PNG
are refused; trickled headers are dropped; SIGTERM drains an open stream and exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from coordinator.batch import BatchStore
from coordinator.client import Coordinator
from coordinator.openai_api.requests import COMPLETIONS
from shared.protocol import WorkerInfo
from shared.settings import Settings

from .gateway import Gateway

from service.private_redis import RedisServer  # isort: skip
from service.workers import MODEL_NAME, Fleet  # isort: skip

STEP_DELAY = 0.02
WORKER_ARGS = ("--ctx", "512", "--slots", "8")
STREAMS_ACROSS_OUTAGE = 8
OUTAGE_SECONDS = 10.0
CONCURRENT_STREAMS = 1000
#: Redis connections the whole deployment (gateway, worker, this test) may hold while the
#: gateway serves CONCURRENT_STREAMS: a connection per stream would be a thousand.
CONNECTION_BOUND = 150


@dataclass
class Stack:
    redis: RedisServer
    settings: Settings
    fleet: Fleet
    patient: Gateway  # waits a Redis outage out for a minute
    impatient: Gateway  # gives up after 3 s
    logs: Path

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.patient.url + "/v1", api_key="x", max_retries=0,
                             timeout=60)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("reliability")
    redis = RedisServer(logs / "redis", "--save", "", "--appendonly", "yes",
                        "--appendfsync", "everysec", "--maxclients", "4000")
    redis.start()
    settings = Settings(redis_url=redis.url, prefix=f"r{uuid.uuid4().hex[:10]}",
                        heartbeat_seconds=0.25, worker_ttl_seconds=3.0, token_chunk=4,
                        token_flush_seconds=0.0, redis_outage_seconds=60)
    quick = {"SPECFLEET_SSE_KEEPALIVE_SECONDS": "1"}
    patient = Gateway(settings, logs, env={**quick, "SPECFLEET_REDIS_OUTAGE_SECONDS": "60"})
    impatient = Gateway(settings, logs, env={**quick, "SPECFLEET_REDIS_OUTAGE_SECONDS": "3"})
    fleet = Fleet(settings, Path(), logs)  # the model is set by the first test that starts one
    try:
        patient.start()
        impatient.start()
        yield Stack(redis, settings, fleet, patient, impatient, logs)
    finally:
        patient.stop()
        impatient.stop()
        fleet.stop_all()
        redis.kill()


def _start_worker(stack: Stack, chat_model: Path) -> None:
    if "w1" not in stack.fleet.procs:
        stack.fleet.model = chat_model
        stack.fleet.start("w1", step_delay=STEP_DELAY, args=WORKER_ARGS,
                          extra_env={"SPECFLEET_REDIS_OUTAGE_SECONDS": "60"})


def _line(number: int, model: str = MODEL_NAME, custom_id: str | None = None) -> bytes:
    return json.dumps({"custom_id": custom_id or f"req-{number}", "method": "POST",
                       "url": "/v1/completions",
                       "body": {"model": model, "prompt": [number % 200 + 1, 7],
                                "max_tokens": 3}}).encode()


def _upload(client: openai.OpenAI, lines: list[bytes]) -> str:
    return client.files.create(file=("in.jsonl", io.BytesIO(b"\n".join(lines) + b"\n")),
                               purpose="batch").id


def _known_model_without_worker(settings: Settings, model: str) -> None:
    """A model the fleet has served (it is known) whose workers have all left: a rolling
    restart's moment."""
    registry = Coordinator(settings).registry
    now = time.time()
    registry.register(WorkerInfo(name=f"gone-{model}", model_name=model, model_path="/m.gguf",
                                 device="cpu", n_ctx=512, version="test", pid=1, host="h",
                                 started_at=now, heartbeat_at=now))
    registry.deregister(f"gone-{model}")


def _wait_status(client: openai.OpenAI, batch_id: str, statuses: set[str],
                 timeout: float = 120) -> Any:
    deadline = time.monotonic() + timeout
    while (batch := client.batches.retrieve(batch_id)).status not in statuses:
        assert time.monotonic() < deadline, f"batch still {batch.status}"
        time.sleep(0.2)
    return batch


def test_a_png_and_duplicate_custom_ids_are_refused(stack: Stack) -> None:
    client = stack.client()
    png = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x01" + bytes(64)
    with pytest.raises(openai.BadRequestError) as refused:
        client.files.create(file=("cat.png", io.BytesIO(png)), purpose="batch")
    assert "not JSONL" in refused.value.message and refused.value.body["param"] == "file"
    file_id = _upload(client, [_line(1, custom_id="a"), _line(2, custom_id="b"),
                               _line(3, custom_id="a")])
    with pytest.raises(openai.BadRequestError) as duplicate:
        client.batches.create(input_file_id=file_id, endpoint="/v1/completions",
                              completion_window="24h")
    assert "custom_id 'a' is on lines 1 and 3" in duplicate.value.message
    assert client.batches.list().data == []  # nothing was created


def test_create_answers_validating_at_once_and_queues_in_the_background(
        stack: Stack) -> None:
    client = stack.client()
    _known_model_without_worker(stack.settings, "parked")
    lines = [_line(n, model="parked") for n in range(1, 2001)]
    batch = client.batches.create(input_file_id=_upload(client, lines),
                                  endpoint="/v1/completions", completion_window="24h")
    assert batch.status == "validating"  # before a single line was queued
    assert batch.request_counts.total == 2000
    batch = _wait_status(client, batch.id, {"in_progress"})  # the gateway's pump took it
    assert batch.in_progress_at is not None and batch.request_counts.failed == 0
    batch = client.batches.cancel(batch.id)  # nobody serves "parked": withdraw it
    batch = _wait_status(client, batch.id, {"cancelled"})
    assert batch.request_counts.failed == 2000


def test_a_batch_created_with_no_worker_waits_and_completes_when_one_starts(
        stack: Stack, chat_model: Path) -> None:
    client = stack.client()
    _known_model_without_worker(stack.settings, MODEL_NAME)
    batch = client.batches.create(input_file_id=_upload(client, [_line(n) for n in range(6)]),
                                  endpoint="/v1/completions", completion_window="24h")
    batch = _wait_status(client, batch.id, {"in_progress"})
    time.sleep(2.0)  # lines that failed "no live worker" would show by now
    waiting = client.batches.retrieve(batch.id)
    assert waiting.status == "in_progress" and waiting.request_counts.failed == 0
    _start_worker(stack, chat_model)
    batch = _wait_status(client, batch.id, {"completed", "failed", "expired", "cancelled"})
    assert batch.status == "completed"
    assert (batch.request_counts.completed, batch.request_counts.failed) == (6, 0)
    assert "batch.waiting_for_worker" in stack.patient.log() + stack.impatient.log()


def test_a_batch_expires_after_its_window(stack: Stack) -> None:
    settings = stack.settings.model_copy(update={"batch_window_seconds": 2})
    store = BatchStore(Coordinator(settings))
    _known_model_without_worker(settings, "ghost")
    upload = store.files.upload(b"\n".join(_line(n, model="ghost") for n in range(1, 5)),
                                "in.jsonl")
    batch = store.create(upload["id"], COMPLETIONS)
    deadline = time.monotonic() + 60
    while (batch := store.get(batch["id"]))["status"] != "expired" or \
            batch["request_counts"]["failed"] < 4:
        store.advance(batch["id"])  # this process, or a gateway's pump, expires it
        assert time.monotonic() < deadline, f"batch still {batch['status']}: {batch}"
        time.sleep(0.2)
    assert batch["expired_at"] is not None
    assert batch["request_counts"] == {"total": 4, "completed": 0, "failed": 4}
    errors = list(store.result_lines(batch["id"], "errors"))
    assert [e["error"]["code"] for e in errors] == ["batch_expired"] * 4
    assert sum(store.coordinator.queue_depths("ghost").values()) == 0


def test_a_stopping_process_lets_go_of_a_batch_waiting_for_a_worker(stack: Stack) -> None:
    """A gateway told to stop (SIGTERM, after its drain) must not hang on a batch whose lines
    wait for a worker: its advance lets go, and the lease lapses for another process."""
    alone = stack.settings.model_copy(update={"prefix": f"s{uuid.uuid4().hex[:10]}"})
    store = BatchStore(Coordinator(alone))  # no gateway pumps this prefix: this process holds it
    _known_model_without_worker(alone, "later")
    upload = store.files.upload(b"\n".join(_line(n, model="later") for n in range(1, 3)),
                                "in.jsonl")
    batch = store.create(upload["id"], COMPLETIONS)
    outcome: list[bool] = []
    advancing = threading.Thread(target=lambda: outcome.append(store.advance(batch["id"])))
    advancing.start()
    time.sleep(1.0)
    assert advancing.is_alive()  # waiting for a worker
    store.stop()
    advancing.join(timeout=30)
    assert not advancing.is_alive(), "advance did not let go after stop()"
    assert outcome == [False]
    batch = store.get(batch["id"])
    assert batch["status"] == "in_progress" and batch["request_counts"]["failed"] == 0


@dataclass
class StreamRecord:
    text: str = ""
    comments: list[str] | None = None
    error: dict[str, Any] | None = None
    finished: bool = False
    done: bool = False
    status: int = 0


def _read_stream(url: str, body: dict[str, Any], record: StreamRecord,
                 started: threading.Event) -> None:
    record.comments = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
        record.status = response.status_code
        for line in response.iter_lines():
            if line.startswith(":"):
                record.comments.append(line)
            elif line == "data: [DONE]":
                record.done = True
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                if "error" in data:
                    record.error = data["error"]
                    continue
                choice = data["choices"][0]
                record.text += choice["text"]
                record.finished = record.finished or choice["finish_reason"] is not None
                if record.text:
                    started.set()


#: One token a step (no drafts), so a stream lasts seconds and is open when a fault lands.
NO_DRAFTS = {"speculative": {"method": "none"}}
STREAM_BODY = {"model": MODEL_NAME, "prompt": [3, 1, 4], "max_tokens": 400,
               "temperature": 0, "stream": True, "specfleet": NO_DRAFTS}


def test_streams_across_a_redis_restart_finish_or_end_with_an_error_event(
        stack: Stack, chat_model: Path) -> None:
    _start_worker(stack, chat_model)
    reference = stack.client().completions.create(
        model=MODEL_NAME, prompt=[3, 1, 4], max_tokens=400, temperature=0,
        extra_body={"specfleet": NO_DRAFTS}).choices[0].text
    records = [StreamRecord() for _ in range(STREAMS_ACROSS_OUTAGE)]
    started = [threading.Event() for _ in records]
    gateways = [stack.patient, stack.impatient] * (STREAMS_ACROSS_OUTAGE // 2)
    threads = [threading.Thread(target=_read_stream, args=(g.url, STREAM_BODY, r, s))
               for g, r, s in zip(gateways, records, started, strict=True)]
    for thread in threads:
        thread.start()
    for event in started:
        assert event.wait(60), "a stream never started"
    assert not any(r.done for r in records), "a stream ended before the outage"
    stack.redis.stop()
    time.sleep(OUTAGE_SECONDS)
    stack.redis.start()
    for thread in threads:
        thread.join(timeout=180)
        assert not thread.is_alive()
    for gateway, record in zip(gateways, records, strict=True):
        assert record.status == 200 and record.done, "a stream was cut without [DONE]"
        assert record.comments and any("waiting for redis" in c for c in record.comments)
        if gateway is stack.patient:  # rode the outage out: the whole text, once
            assert record.error is None and record.finished and record.text == reference
        else:  # gave up after 3 s of outage: an error event the SDKs raise, then [DONE]
            assert record.error is not None and record.error["code"] == "redis_unavailable"
            assert reference.startswith(record.text)
    assert stack.fleet.alive("w1")


async def _many_streams(url: str, n: int) -> list[tuple[int, str, bool, dict | None]]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=300) as client:
        async def one(i: int) -> tuple[int, str, bool, dict | None]:
            text, done, error = "", False, None
            body = {"model": MODEL_NAME, "prompt": [i % 200 + 1, 5], "max_tokens": 2,
                    "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        data = json.loads(line[6:])
                        if "error" in data:
                            error = data["error"]
                        else:
                            text += data["choices"][0]["text"] or ""
                return response.status_code, text, done, error
        return await asyncio.gather(*(one(i) for i in range(n)))


def test_a_thousand_concurrent_streams_on_bounded_redis_connections(
        stack: Stack, chat_model: Path) -> None:
    _start_worker(stack, chat_model)
    probe = stack.redis.client()
    clients: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            with contextlib.suppress(Exception):
                clients.append(int(probe.info("clients")["connected_clients"]))
            time.sleep(0.2)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        results = asyncio.run(_many_streams(stack.patient.url, CONCURRENT_STREAMS))
    finally:
        stop.set()
        sampler.join()
    failed = [r for r in results if r[0] != 200 or not r[2] or r[3] is not None]
    empty = [r for r in results if r[0] == 200 and r[1] == ""]
    assert not failed, f"{len(failed)} failed, e.g. {failed[:3]}"
    assert not empty, f"{len(empty)} empty"
    print(f"{CONCURRENT_STREAMS} streams: 0 failed, 0 empty; Redis clients peaked at "
          f"{max(clients)}")
    assert max(clients) <= CONNECTION_BOUND
    assert "MaxConnectionsError" not in stack.patient.log()
    assert "stream.gap" not in stack.patient.log()  # the shared read handed out every entry


async def _trickle_headers(port: int, sockets: int, seconds: float) -> int:
    """Open ``sockets`` connections that send a request's headers a byte every 0.25 s;
    how many the server closed within ``seconds``."""
    async def one() -> bool:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"y" * 4096
        deadline = time.monotonic() + seconds
        try:
            for byte in head:
                if time.monotonic() > deadline:
                    return False
                writer.write(bytes([byte]))
                with contextlib.suppress(TimeoutError):
                    if await asyncio.wait_for(reader.read(1), 0.25) == b"":
                        return True
            return False
        except (ConnectionError, OSError):
            return True
        finally:
            writer.close()
    return sum(await asyncio.gather(*(one() for _ in range(sockets))))


def test_overload_header_trickle_and_a_sigterm_that_drains(stack: Stack,
                                                         chat_model: Path) -> None:
    _start_worker(stack, chat_model)
    gateway = Gateway(stack.settings, stack.logs, env={
        "SPECFLEET_MAX_CONCURRENT_REQUESTS": "1", "SPECFLEET_HEADER_TIMEOUT_SECONDS": "1",
        "SPECFLEET_DRAIN_SECONDS": "120", "SPECFLEET_SSE_KEEPALIVE_SECONDS": "1"}).start()
    try:
        assert asyncio.run(_trickle_headers(gateway.port, 200, seconds=60)) == 200
        record, started = StreamRecord(), threading.Event()
        reader = threading.Thread(target=_read_stream,
                                  args=(gateway.url, STREAM_BODY, record, started))
        reader.start()
        assert started.wait(60)
        busy = httpx.post(gateway.url + "/v1/completions", timeout=30, json={
            "model": MODEL_NAME, "prompt": [1, 2], "max_tokens": 2})
        assert busy.status_code == 503 and busy.headers["Retry-After"].isdigit()
        assert busy.json()["error"]["code"] == "overloaded"
        assert gateway.proc is not None
        gateway.proc.send_signal(signal.SIGTERM)  # mid-stream
        reader.join(timeout=120)
        assert record.done and record.finished and record.error is None
        assert gateway.proc.wait(timeout=60) == 0
        assert '"gateway.draining"' in gateway.log() and "Traceback" not in gateway.log()
    finally:
        gateway.stop()
