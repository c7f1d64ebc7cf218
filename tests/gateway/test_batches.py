"""Batches through the gateway (OpenAI's Batch API with the real client), and a gateway that
is killed mid-batch and mid-stream: after a restart every result is there."""

from __future__ import annotations

import contextlib
import io
import json
import threading
import time
from typing import Any

import httpx
import openai

from coordinator.client import Coordinator
from shared.settings import Settings

from .conftest import Deployment
from .gateway import Gateway

from service.workers import MODEL_NAME, Fleet  # isort: skip

BAD = {
    7: b"{not json",
    13: b'{"custom_id": "bad-utf8", "body": {"prompt": "\xff\xfe"}}',
    21: json.dumps({"custom_id": "n2", "body": {"model": MODEL_NAME, "prompt": "x",
                                                 "n": 2}}).encode(),
    33: json.dumps({"custom_id": "typed", "body": {"model": MODEL_NAME, "prompt": [1, 2],
                                                    "max_tokens": "9"}}).encode(),
    42: json.dumps({"custom_id": "wrong-url", "url": "/v1/chat/completions",
                    "body": {"model": MODEL_NAME, "prompt": "x"}}).encode(),
}


def _line(number: int, max_tokens: int = 4) -> bytes:
    return json.dumps({"custom_id": f"req-{number}", "method": "POST", "url": "/v1/completions",
                       "body": {"model": MODEL_NAME, "prompt": [number % 200 + 1, 7],
                                "max_tokens": max_tokens}}).encode()


def _upload(client: openai.OpenAI, lines: list[bytes]) -> str:
    return client.files.create(file=("batch.jsonl", io.BytesIO(b"\n".join(lines) + b"\n")),
                               purpose="batch").id


def _wait(client: openai.OpenAI, batch_id: str, timeout: float = 90) -> Any:
    deadline = time.monotonic() + timeout
    while (batch := client.batches.retrieve(batch_id)).status not in (
            "completed", "failed", "cancelled", "expired"):
        assert time.monotonic() < deadline, f"batch still {batch.status}"
        time.sleep(0.2)
    return batch


def _jsonl(content: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in content.decode().splitlines()]


def test_batch_round_trip_with_five_bad_lines_of_fifty(deployment: Deployment) -> None:
    client = deployment.client()
    lines = [BAD.get(n) or _line(n) for n in range(1, 51)]
    batch = client.batches.create(input_file_id=_upload(client, lines),
                                  endpoint="/v1/completions", completion_window="24h",
                                  metadata={"run": "test"})
    assert batch.status == "validating" and batch.metadata == {"run": "test"}
    batch = _wait(client, batch.id)
    assert batch.status == "completed"
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (50, 45, 5)
    output = _jsonl(client.files.content(batch.output_file_id).read())
    errors = _jsonl(client.files.content(batch.error_file_id).read())
    good = [n for n in range(1, 51) if n not in BAD]
    assert [o["custom_id"] for o in output] == [f"req-{n}" for n in good]  # input order
    for o in output:
        assert o["error"] is None and o["response"]["status_code"] == 200
        body = o["response"]["body"]
        assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] == 4
        assert o["response"]["request_id"] == body["specfleet"]["job_id"]
    assert [e["line"] for e in errors] == sorted(BAD)
    assert all(e["response"]["status_code"] == 400 for e in errors)
    messages = {e["line"]: e["error"]["message"] for e in errors}
    assert "not valid UTF-8" in messages[13]
    assert "a batch line is one job" in messages[21] and "max_tokens" in messages[33]
    assert "differs from the batch's endpoint" in messages[42]
    assert client.files.retrieve(batch.output_file_id).bytes == len(
        client.files.content(batch.output_file_id).read())
    assert batch.id in [b.id for b in client.batches.list()]
    # the same result from a direct request with the seed the line's job sampled with
    first = output[0]["response"]["body"]
    direct = Coordinator(deployment.settings).submit(
        {"model": MODEL_NAME, "prompt_tokens": [2, 7], "max_tokens": 4,
         "sampling": {"temperature": 1.0, "seed": first["specfleet"]["seed"]}}).result(timeout=30)
    assert first["choices"][0]["text"] == direct.text


def test_batch_refusals(deployment: Deployment) -> None:
    client = deployment.client()
    try:
        client.batches.create(input_file_id="file-nope", endpoint="/v1/completions",
                              completion_window="24h")
        raise AssertionError("an unknown file was accepted")
    except openai.NotFoundError as exc:
        assert "no such file" in exc.message
    empty = _upload(client, [b" "])
    try:
        client.batches.create(input_file_id=empty, endpoint="/v1/moderations",
                              completion_window="24h")
        raise AssertionError("an endpoint we do not serve was accepted")
    except openai.BadRequestError as exc:
        assert exc.body["param"] == "endpoint"


def test_listings_page_with_has_more_and_refuse_a_limit_out_of_range(
        settings: Settings, gateway: Gateway) -> None:
    """A page of ``limit`` says whether more follow (the SDK's auto-pagination reads it);
    a limit outside OpenAI's 1..100 is a 400 naming it, not clamped in silence."""
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    uploaded = {_upload(client, [_line(n)]) for n in range(3)}
    first = client.files.list(limit=2)
    assert len(first.data) == 2 and first.has_more
    rest = client.files.list(limit=2, after=first.data[-1].id)
    assert len(rest.data) == 1 and not rest.has_more
    assert {f.id for f in [*first.data, *rest.data]} == uploaded
    paged = [f.id for f in client.files.list(limit=1)]  # the SDK follows has_more
    assert len(paged) == 3 and set(paged) == uploaded
    for limit in (0, 101):
        for path in ("/v1/files", "/v1/batches"):
            r = httpx.get(f"{gateway.url}{path}?limit={limit}")
            assert r.status_code == 400 and r.json()["error"]["param"] == "limit", r.text


def test_gateway_killed_mid_batch_and_mid_stream_loses_nothing(
        fleet: Fleet, settings: Settings, tmp_path: Any) -> None:
    fleet.start("w1", step_delay=0.02)
    gateway = Gateway(settings, tmp_path).start()
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
    batch = client.batches.create(input_file_id=_upload(client, [_line(n, 24)
                                                                  for n in range(1, 9)]),
                                  endpoint="/v1/completions", completion_window="24h")
    received, last_id, completion_id = "", "0", None
    with httpx.stream("POST", gateway.url + "/v1/chat/completions", timeout=30, json={
            "model": MODEL_NAME, "max_tokens": 60, "stream": True,
            "messages": [{"role": "user", "content": "tell me"}]}) as r:
        assert r.status_code == 200, r.read()
        lines = r.iter_lines()
        while len(received) < 10:
            line = next(lines)
            if line.startswith("id: "):
                last_id = line[4:]
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                completion_id = chunk["id"]
                received += chunk["choices"][0]["delta"].get("content", "")
        gateway.kill()  # mid-stream and mid-batch: nothing cancels the jobs
    assert client.batches.retrieve  # the old gateway is gone; a new one takes over
    gateway = Gateway(settings, tmp_path).start()
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
    with httpx.stream("GET", f"{gateway.url}/v1/specfleet/streams/{completion_id}",
                      headers={"Last-Event-ID": last_id}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                received += chunk["choices"][0]["delta"].get("content", "") if chunk[
                    "choices"] else ""
    job_id = completion_id.removeprefix("chatcmpl-")
    final = Coordinator(settings).handle(job_id).result(timeout=60)
    assert received == final.text and len(final.tokens) == 60
    batch = _wait(client, batch.id)
    assert (batch.status, batch.request_counts.completed) == ("completed", 8)
    output = _jsonl(client.files.content(batch.output_file_id).read())
    assert [o["custom_id"] for o in output] == [f"req-{n}" for n in range(1, 9)]
    assert all(o["response"]["body"]["usage"]["completion_tokens"] == 24 for o in output)
    gateway.stop()


def test_a_gateway_killed_while_creating_a_batch_leaves_no_line_behind(
        fleet: Fleet, settings: Settings, tmp_path: Any) -> None:
    """The creator dies after queueing some lines: the next reader of the batch (another
    gateway answering a status poll) takes over its lease and queues the rest, once each."""
    fleet.start("w1")
    gateway = Gateway(settings, tmp_path).start()
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
    total = 60
    file_id = _upload(client, [_line(n, 2) for n in range(1, total + 1)])
    creating = threading.Thread(target=_create_quietly, args=(client, file_id), daemon=True)
    creating.start()
    conn = Coordinator(settings).connection
    deadline = time.monotonic() + 60
    while True:  # wait until the creator is part-way through the lines, then kill it
        ids = conn.zrange(settings.keys.batches(), 0, -1)
        queued = int(conn.hget(settings.keys.batch(ids[0].decode()), "queued") or 0) if ids else 0
        if queued >= 5:
            break
        assert time.monotonic() < deadline, "the batch was never being created"
        time.sleep(0.002)
    gateway.kill()
    batch_id = ids[0].decode()
    assert int(conn.hget(settings.keys.batch(batch_id), "queued")) < total
    gateway = Gateway(settings, tmp_path).start()
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
    batch = _wait(client, batch_id)
    assert (batch.status, batch.request_counts.completed, batch.request_counts.failed) == (
        "completed", total, 0)
    output = _jsonl(client.files.content(batch.output_file_id).read())
    assert [o["custom_id"] for o in output] == [f"req-{n}" for n in range(1, total + 1)]
    assert len({o["response"]["request_id"] for o in output}) == total  # one job a line
    gateway.stop()


def _create_quietly(client: openai.OpenAI, file_id: str) -> None:
    """Create a batch; the gateway is killed under the call, so its error is expected."""
    with contextlib.suppress(openai.APIError):
        client.batches.create(input_file_id=file_id, endpoint="/v1/completions",
                              completion_window="24h")


def test_cancelling_a_batch_stops_running_and_queued_lines(fleet: Fleet, gateway: Gateway,
                                                           client: openai.OpenAI) -> None:
    fleet.start("w1", step_delay=0.05)
    batch = client.batches.create(input_file_id=_upload(client, [_line(n, 200)
                                                                  for n in range(1, 7)]),
                                  endpoint="/v1/completions", completion_window="24h")
    time.sleep(0.5)  # the first line is running, the others wait in the queue
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    batch = _wait(client, batch.id)
    assert batch.status == "cancelled" and batch.request_counts.total == 6
    assert batch.request_counts.failed == 6 - batch.request_counts.completed
    errors = _jsonl(client.files.content(batch.error_file_id).read())
    assert {e["error"]["code"] for e in errors} == {"cancelled"}
    assert batch.request_counts.failed >= 5  # at most the running line could have finished
