"""Batches that cannot poison the processes that carry them: a cancel accounts the lines left
unparsed, a line pumps keep dying on is failed after ``MAX_LINE_ATTEMPTS`` deaths, an
exception fails its line (or, outside any line, the batch), a line nested past any parser's
depth is a failed line, and two gateways on one Redis both stay up through a batch holding a
schema that crashed llguidance in-process, one of them killed mid-batch losing no line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

import coordinator.batch as batch_module
from coordinator.batch import MAX_BATCH_FAILURES, MAX_LINE_ATTEMPTS, TERMINAL, BatchStore
from coordinator.client import Coordinator
from shared.replies import text
from shared.settings import Settings

from .conftest import Deployment
from .gateway import Gateway
from .test_batches import _jsonl, _line, _upload, _wait

from service.workers import MODEL_NAME, Fleet  # isort: skip

#: Lines every pump refuses without a worker (not JSON, two choices, another endpoint's url).
REFUSED = [b"{not json",
           json.dumps({"custom_id": "n2", "body": {"model": MODEL_NAME, "prompt": "x",
                                                   "n": 2}}).encode(),
           json.dumps({"custom_id": "wrong-url", "url": "/v1/chat/completions",
                       "body": {"model": MODEL_NAME, "prompt": "x"}}).encode()]
#: A line 100,000 objects deep: ``json.loads`` raises RecursionError on it, not ValueError.
DEEP = b'{"custom_id": "deep", "body": ' + b'{"a": ' * 100_000 + b"1" + b"}" * 100_001
#: A schema of 1,200 chained ``$ref``/``anyOf`` definitions: compiling it in-process
#: overflowed llguidance's stack and killed the process (every gateway that took the line).
POISON_SCHEMA: dict[str, Any] = {
    "type": "object", "properties": {"a": {"$ref": "#/$defs/d0"}},
    "$defs": {**{f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}]} for i in range(1200)},
              "d1200": {"type": "string"}}}
#: A pump whose parser dies on one line as a crash in native code would: SIGKILL, no clean-up.
DYING_PUMP = """
import os, signal, sys
import coordinator.batch as batch
from coordinator.client import Coordinator
from shared.replies import text
from shared.settings import Settings

parse = batch._parse_line

def dying(endpoint, number, raw, model, aliases):
    if number == int(sys.argv[2]):
        os.kill(os.getpid(), signal.SIGKILL)
    return parse(endpoint, number, raw, model, aliases)

batch._parse_line = dying
sys.exit(0 if batch.BatchStore(Coordinator(Settings())).advance(sys.argv[1]) else 1)
"""


def _body(custom_id: str, **fields: Any) -> bytes:
    """A line whose body is a completion request with ``fields`` added."""
    return json.dumps({"custom_id": custom_id, "body": {
        "model": MODEL_NAME, "prompt": "x", **fields}}).encode()


def _create(store: BatchStore, lines: list[bytes], endpoint: str = "/v1/completions") -> str:
    file_id = store.files.upload(b"\n".join(lines) + b"\n", "batch.jsonl")["id"]
    return str(store.create(file_id, endpoint)["id"])


def _ended(store: BatchStore, batch_id: str, timeout: float = 90) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while (batch := store.get(batch_id))["status"] not in TERMINAL:
        assert time.monotonic() < deadline, f"batch still {batch['status']}"
        time.sleep(0.1)
    return batch


def _errors(store: BatchStore, batch_id: str) -> dict[int, dict[str, Any]]:
    return {e["line"]: e for e in store.result_lines(batch_id, "errors")}


def test_a_cancel_accounts_the_lines_left_without_parsing_them(
        settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cancel arrives while the pump is on line 3: lines 4-10, which would each be
    refused (or crash a parser), end ``cancelled`` and are never parsed."""
    store = BatchStore(Coordinator(settings))
    later = [b"{not json either", _body("later-5", n=2), DEEP,
             _body("later-7", model="nobody-serves-this"), b"\xff\xfe", _body("later-9", n=2),
             _body("later-10", stream=True)]
    batch_id = _create(store, [*REFUSED, *later])
    parsed: list[int] = []
    parse = batch_module._parse_line

    def parsing(endpoint: str, number: int, raw: bytes, model: str | None,
                aliases: dict[str, str]) -> Any:
        parsed.append(number)
        if number == 3:
            store.cancel(batch_id)
        return parse(endpoint, number, raw, model, aliases)

    monkeypatch.setattr(batch_module, "_parse_line", parsing)
    assert store.advance(batch_id)
    assert parsed == [1, 2, 3]
    batch = _ended(store, batch_id)
    assert batch["status"] == "cancelled"
    assert batch["request_counts"] == {"total": 10, "completed": 0, "failed": 10}
    assert batch["specfleet"]["invalid"] == 3
    errors = _errors(store, batch_id)
    assert {n: e["error"]["code"] for n, e in errors.items()} == {
        **dict.fromkeys(range(1, 4), "invalid_request"), **dict.fromkeys(range(4, 11), "cancelled")}
    # read plainly where plain JSON can (the deep line's cannot)
    assert [errors[n]["custom_id"] for n in range(4, 11)] == [
        None, "later-5", None, "later-7", None, "later-9", "later-10"]


def test_a_line_the_pumps_die_on_is_failed_after_three_deaths(
        fleet: Fleet, settings: Settings, tmp_path: Path) -> None:
    """Real pumps (processes running ``BatchStore.advance``) die on line 3 as a crashing
    parser would; the fourth fails the line without parsing it and the batch completes."""
    fleet.start("w1")
    store = BatchStore(Coordinator(settings))
    batch_id = _create(store, [_line(n) for n in range(1, 6)])
    script = tmp_path / "dying_pump.py"
    script.write_text(DYING_PUMP)
    env = {**os.environ, "REDIS_URL": settings.redis_url, "SPECFLEET_PREFIX": settings.prefix}
    key = settings.keys.batch(batch_id)
    for death in range(1, MAX_LINE_ATTEMPTS + 1):
        pump = subprocess.run([sys.executable, str(script), batch_id, "3"], env=env,
                              timeout=120, capture_output=True)
        assert pump.returncode == -signal.SIGKILL, pump.stderr.decode()[-2000:]
        assert store.conn.hmget(key, "queued", "attempt_line", "attempts") == [
            b"2", b"3", str(death).encode()]
        store.conn.delete(settings.keys.batch_creator(batch_id))  # the dead pump's lease lapses
    pump = subprocess.run([sys.executable, str(script), batch_id, "3"], env=env, timeout=120,
                          capture_output=True)
    assert pump.returncode == 0, pump.stderr.decode()[-2000:]  # line 3 was not parsed again
    batch = _ended(store, batch_id)
    assert (batch["status"], batch["request_counts"]) == (
        "completed", {"total": 5, "completed": 4, "failed": 1})
    errors = _errors(store, batch_id)
    assert list(errors) == [3] and errors[3]["custom_id"] == "req-3"
    assert errors[3]["error"]["message"] == (
        "line 3: the batch pump died 3 times on this line; it is failed and the batch "
        "carries on")
    assert [o["custom_id"] for o in store.result_lines(batch_id, "output")] == [
        "req-1", "req-2", "req-4", "req-5"]
    assert store.conn.hmget(key, "attempt_line", "attempts") == [None, None]


def test_pumps_that_let_go_of_a_line_alive_are_no_deaths(settings: Settings) -> None:
    """Gateways stopped (``BatchStore.stop``) while a line waits for a worker, more times
    than a line may kill pumps: each books its attempt off, the line is not failed."""
    store = BatchStore(Coordinator(settings))
    store.conn.sadd(settings.keys.models(), MODEL_NAME)  # served before: the line waits
    batch_id = _create(store, [_line(1)])
    key = settings.keys.batch(batch_id)
    for _ in range(MAX_LINE_ATTEMPTS + 1):
        pump = BatchStore(Coordinator(settings))
        advancing = threading.Thread(target=pump.advance, args=(batch_id,))
        advancing.start()
        deadline = time.monotonic() + 30
        while store.conn.hget(key, "attempts") != b"1":
            assert time.monotonic() < deadline, "the pump never took line 1"
            time.sleep(0.01)
        pump.stop()
        advancing.join(timeout=30)
        assert store.conn.hmget(key, "attempt_line", "attempts") == [b"1", b"0"]
    assert store.get(batch_id)["request_counts"]["failed"] == 0
    assert not store.conn.exists(settings.keys.batch_results(batch_id))


def test_an_exception_on_a_line_fails_the_line_and_the_batch_carries_on(
        settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    store = BatchStore(Coordinator(settings))
    batch_id = _create(store, REFUSED)
    parse = batch_module._parse_line

    def failing(endpoint: str, number: int, raw: bytes, model: str | None,
                aliases: dict[str, str]) -> Any:
        if number == 2:
            raise ZeroDivisionError("a bug in a parser")
        return parse(endpoint, number, raw, model, aliases)

    monkeypatch.setattr(batch_module, "_parse_line", failing)
    assert store.advance(batch_id)
    batch = _ended(store, batch_id)
    assert (batch["status"], batch["request_counts"]["failed"]) == ("completed", 3)
    errors = _errors(store, batch_id)
    assert errors[2]["custom_id"] == "n2" and errors[2]["error"]["message"] == (
        "line 2: the batch pump failed on this line (ZeroDivisionError); it is failed and the "
        "batch carries on")
    assert "differs from the batch's endpoint" in errors[3]["error"]["message"]


def test_a_batch_that_fails_outside_any_line_is_failed_not_retried_for_ever(
        settings: Settings) -> None:
    store = BatchStore(Coordinator(settings))
    batch_id = _create(store, REFUSED)
    store.conn.hset(settings.keys.batch(batch_id), "queued", "garbage")  # corrupt batch data
    assert store.needing_care() == [batch_id]
    for _ in range(MAX_BATCH_FAILURES - 1):
        assert not store.advance(batch_id)
        assert store.get(batch_id)["status"] == "validating"
    assert store.advance(batch_id)
    batch = store.get(batch_id)
    assert batch["status"] == "failed" and batch["failed_at"] is not None
    assert batch["errors"] == {"object": "list", "data": [{
        "code": "batch_pump_failed", "line": None, "param": None,
        "message": f"the batch pump failed {MAX_BATCH_FAILURES} times outside any line "
                   "(ValueError); the batch is failed"}]}
    assert store.needing_care() == []


def test_lines_nested_past_any_parsers_depth_are_refused_or_failed(
        deployment: Deployment) -> None:
    client = deployment.client()
    try:
        _upload(client, [b"[" * 100_000, DEEP])
        raise AssertionError("a file with no JSON object line was taken")
    except openai.BadRequestError as exc:
        assert exc.body["param"] == "file" and "no line is a JSON object" in exc.message
    batch = client.batches.create(input_file_id=_upload(client, [_line(1), DEEP, _line(3)]),
                                  endpoint="/v1/completions", completion_window="24h")
    batch = _wait(client, batch.id)
    assert (batch.status, batch.request_counts.completed, batch.request_counts.failed) == (
        "completed", 2, 1)
    [error] = _jsonl(client.files.content(batch.error_file_id).read())
    assert error["line"] == 2 and error["response"]["status_code"] == 400


def _chat_line(number: int, schema: dict[str, Any] | None = None) -> bytes:
    body: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 4,
                            "messages": [{"role": "user", "content": f"say {number}"}]}
    if schema is not None:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "poison", "schema": schema}}
    return json.dumps({"custom_id": f"req-{number}", "method": "POST",
                       "url": "/v1/chat/completions", "body": body}).encode()


def _serving(gateway: Gateway) -> None:
    """The gateway answers its health check, and refuses the poisoned schema with a 400."""
    assert gateway.proc is not None and gateway.proc.poll() is None, gateway.log()[-2000:]
    assert httpx.get(gateway.url + "/health", timeout=10).status_code == 200
    reply = httpx.post(gateway.url + "/v1/chat/completions", timeout=60, json=json.loads(
        _chat_line(0, POISON_SCHEMA))["body"])
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "response_format"


@pytest.fixture
def gateways(settings: Settings, tmp_path: Path) -> Iterator[list[Gateway]]:
    """Two gateways on the test's Redis and prefix (a killed one is stopped all the same)."""
    started = [Gateway(settings, tmp_path)]
    try:
        started[0].start()
        started.append(Gateway(settings, tmp_path).start())
        yield started
    finally:
        for gateway in started:
            gateway.stop()


def test_two_gateways_carry_a_poisoned_batch_and_one_killed_mid_batch_loses_nothing(
        fleet: Fleet, settings: Settings, gateways: list[Gateway]) -> None:
    """Line 1 holds the schema that crashed llguidance in-process; the model has no live
    worker yet, so the pump holding the batch fails line 1 and waits at line 2. Both gateways
    answer meanwhile; the holder is killed (SIGKILL), the other takes the batch over, and
    once a worker is up it completes with every line accounted once."""
    conn = Coordinator(settings).connection
    conn.sadd(settings.keys.models(), MODEL_NAME)  # served before: its lines wait for a worker
    client = openai.OpenAI(base_url=gateways[0].url + "/v1", api_key="x", max_retries=0)
    total = 12
    lines = [_chat_line(1, POISON_SCHEMA), *(_chat_line(n) for n in range(2, total + 1))]
    batch_id = client.batches.create(input_file_id=_upload(client, lines),
                                     endpoint="/v1/chat/completions",
                                     completion_window="24h").id
    deadline = time.monotonic() + 60
    while not conn.hexists(settings.keys.batch_results(batch_id), "1"):
        assert time.monotonic() < deadline, "line 1 was never accounted"
        assert all(g.proc is not None and g.proc.poll() is None for g in gateways)
        time.sleep(0.1)
    holder = int(text(conn.get(settings.keys.batch_creator(batch_id))).split(":")[-2])
    for gateway in gateways:
        _serving(gateway)
    [victim] = [g for g in gateways if g.proc is not None and g.proc.pid == holder]
    [survivor] = [g for g in gateways if g is not victim]
    assert text(conn.hget(settings.keys.batch(batch_id), "queued")) == "1"  # waiting at line 2
    victim.kill()
    fleet.start("w1")
    client = openai.OpenAI(base_url=survivor.url + "/v1", api_key="x", max_retries=0)
    batch = _wait(client, batch_id, timeout=120)
    assert (batch.status, batch.request_counts.total, batch.request_counts.completed,
            batch.request_counts.failed) == ("completed", total, total - 1, 1)
    [error] = _jsonl(client.files.content(batch.error_file_id).read())
    assert (error["line"], error["custom_id"], error["response"]["status_code"]) == (
        1, "req-1", 400)
    assert error["error"]["message"].startswith("line 1: response_format")
    output = _jsonl(client.files.content(batch.output_file_id).read())
    assert [o["custom_id"] for o in output] == [f"req-{n}" for n in range(2, total + 1)]
    assert len({o["response"]["request_id"] for o in output}) == total - 1  # one job a line
    _serving(survivor)
    reply = client.chat.completions.create(model=MODEL_NAME, max_tokens=4,
                                           messages=[{"role": "user", "content": "hi"}])
    assert reply.choices[0].finish_reason in ("stop", "length")
