"""API keys are tenants: a key sees and acts on its own files and batches only (another's are
404s, as missing ones), an admin key and the operator's CLI see everything, each key's stored
bytes and open batches are bounded, and a batch's result file is no batch's input."""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import openai
import pytest
from redis import Redis

from coordinator.batch import BatchStore
from coordinator.client import Coordinator
from coordinator.tenancy import Quota, StoreError, Tenant
from shared.settings import Settings

from .conftest import Deployment, deployed, deployment_settings
from .test_batches import _line, _upload, _wait

from helpers import specfleet  # isort: skip

KEYS = {name: f"{name}-{uuid.uuid4().hex}" for name in ("a", "b", "q", "admin")}
STORED_BYTES, OPEN_BATCHES = 64 * 1024, 2
#: A model that is known (a worker served it once) and has no live worker: a batch of its
#: lines stays open, waiting for one.
IDLE_MODEL = "idle"


@pytest.fixture(scope="module")
def keyed(chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """A worker and a gateway that takes keys a, b and q, and an admin key, with small
    per-key quotas."""
    s = deployment_settings("k")
    with deployed(s, chat_model, tmp_path_factory.mktemp("keyed"), gateway_env={
            "SPECFLEET_API_KEYS": ",".join(KEYS[k] for k in "abq"),
            "SPECFLEET_ADMIN_API_KEYS": KEYS["admin"],
            "SPECFLEET_MAX_STORED_BYTES_PER_KEY": str(STORED_BYTES),
            "SPECFLEET_MAX_OPEN_BATCHES_PER_KEY": str(OPEN_BATCHES)}) as d:
        Redis.from_url(s.redis_url).sadd(s.keys.models(), IDLE_MODEL)
        yield d


def _client(deployment: Deployment, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=deployment.gateway.url + "/v1", api_key=KEYS[key],
                         max_retries=0, timeout=60)


def _batch(client: openai.OpenAI, lines: list[bytes]) -> Any:
    return client.batches.create(input_file_id=_upload(client, lines),
                                 endpoint="/v1/completions", completion_window="24h")


def _idle_line(number: int) -> bytes:
    return json.dumps({"custom_id": f"idle-{number}", "body": {
        "model": IDLE_MODEL, "prompt": [1, 2], "max_tokens": 2}}).encode()


def _refused(call: Callable[[], Any], error: type[openai.APIStatusError]) -> Any:
    try:
        call()
    except error as exc:
        return exc
    raise AssertionError(f"no {error.__name__}")


def test_a_key_sees_and_touches_its_own_files_and_batches_only(keyed: Deployment) -> None:
    a, b = _client(keyed, "a"), _client(keyed, "b")
    batch = _wait(a, _batch(a, [_line(1), _line(2)]).id)
    file_id, output_id = batch.input_file_id, batch.output_file_id
    assert batch.status == "completed" and output_id is not None
    missing = f"file-{uuid.uuid4().hex}"
    exc = _refused(lambda: b.files.retrieve(missing), openai.NotFoundError)
    assert exc.body["message"] == f"no such file: {missing}"
    for other in (file_id, output_id):  # the same answer as for a file that is not there
        for attempt in (partial(b.files.retrieve, other), partial(b.files.content, other),
                        partial(b.files.delete, other)):
            exc = _refused(attempt, openai.NotFoundError)
            assert exc.body["message"] == f"no such file: {other}"
    for on_batch in (partial(b.batches.retrieve, batch.id), partial(b.batches.cancel, batch.id)):
        exc = _refused(on_batch, openai.NotFoundError)
        assert exc.body["message"] == f"no such batch: {batch.id}"
    exc = _refused(lambda: b.batches.create(input_file_id=file_id, endpoint="/v1/completions",
                                            completion_window="24h"), openai.NotFoundError)
    assert exc.body["param"] == "input_file_id"
    own = _upload(b, [_line(3)])
    listed = [f.id for f in b.files.list(limit=100)]
    assert own in listed and file_id not in listed
    assert batch.id not in [x.id for x in b.batches.list(limit=100)]
    assert file_id in [f.id for f in a.files.list(limit=100)]  # b's delete deleted nothing
    assert batch.id in [x.id for x in a.batches.list(limit=100)]
    assert b"req-1" in a.files.content(output_id).read()
    # objects are stored under a key id: no key is in Redis or in the gateway's log
    conn = Redis.from_url(keyed.settings.redis_url)
    stored = b"".join(conn.dump(k) or b"" for k in conn.scan_iter(f"{keyed.settings.prefix}:*"))
    assert batch.id.encode() in stored
    for key in KEYS.values():
        assert key.encode() not in stored and key not in keyed.gateway.log()


def test_an_admin_key_and_the_operators_cli_see_and_act_on_every_key(
        keyed: Deployment) -> None:
    a, b, admin = _client(keyed, "a"), _client(keyed, "b"), _client(keyed, "admin")
    done = _wait(a, _batch(a, [_line(4)]).id)
    waiting = _batch(b, [_idle_line(1)])
    files = [f.id for f in admin.files.list(limit=100)]
    assert done.input_file_id in files and waiting.input_file_id in files
    assert {done.id, waiting.id} <= {x.id for x in admin.batches.list(limit=100)}
    assert admin.batches.retrieve(done.id).status == "completed"
    assert b"req-4" in admin.files.content(done.output_file_id).read()
    assert admin.batches.cancel(waiting.id).status in ("cancelling", "cancelled")
    assert _wait(b, waiting.id).status == "cancelled"
    own = _upload(admin, [_line(5)])  # the admin's own files are no other key's
    _refused(lambda: a.files.retrieve(own), openai.NotFoundError)
    s = keyed.settings
    listed = specfleet("batch", "list", "--limit", "100", env={
        **os.environ, "REDIS_URL": s.redis_url, "SPECFLEET_PREFIX": s.prefix})
    assert listed.returncode == 0, listed.stderr
    assert {done.id, waiting.id} <= {json.loads(x)["id"] for x in listed.stdout.splitlines()}


def test_each_key_has_its_quotas(keyed: Deployment) -> None:
    q, a = _client(keyed, "q"), _client(keyed, "a")
    big = json.dumps({"custom_id": "pad", "pad": "x" * 40_000}).encode()
    first = _upload(q, [big])
    exc = _refused(lambda: _upload(q, [big]), openai.RateLimitError)
    assert exc.response.headers["x-should-retry"] == "false"  # the SDKs do not retry it
    assert (exc.body["code"], exc.body["param"]) == ("quota_exceeded", "file")
    message = exc.body["message"]
    assert "SPECFLEET_MAX_STORED_BYTES_PER_KEY" in message and f"({STORED_BYTES})" in message
    assert f"to {2 * (len(big) + 1)} bytes" in message
    q.files.delete(first)
    _upload(q, [big])  # deleted files leave the count
    opened = [_batch(q, [_idle_line(n)]) for n in range(OPEN_BATCHES)]
    input_id = _upload(q, [_idle_line(9)])
    exc = _refused(lambda: q.batches.create(input_file_id=input_id, endpoint="/v1/completions",
                                            completion_window="24h"), openai.RateLimitError)
    assert exc.body["code"] == "quota_exceeded"
    assert "SPECFLEET_MAX_OPEN_BATCHES_PER_KEY" in exc.body["message"]
    assert f"{OPEN_BATCHES} batches open" in exc.body["message"]
    _batch(a, [_line(6)])  # another key's quota is its own
    q.batches.cancel(opened[0].id)
    assert _wait(q, opened[0].id).status == "cancelled"
    extra = q.batches.create(input_file_id=input_id, endpoint="/v1/completions",
                             completion_window="24h")
    for batch in (*opened[1:], extra):
        q.batches.cancel(batch.id)


def test_a_batch_result_file_is_not_a_batch_input(keyed: Deployment) -> None:
    a = _client(keyed, "a")
    batch = _wait(a, _batch(a, [_line(7)]).id)
    exc = _refused(lambda: a.batches.create(input_file_id=batch.output_file_id,
                                            endpoint="/v1/completions",
                                            completion_window="24h"), openai.BadRequestError)
    assert exc.body["param"] == "input_file_id"
    assert exc.body["message"] == (f"{batch.output_file_id} is a batch's output or error file: "
                                   "a batch's input is a file uploaded with purpose 'batch'")


def test_expired_uploads_leave_the_stored_bytes_quota(settings: Settings) -> None:
    store = BatchStore(Coordinator(settings.model_copy(update={"result_ttl_seconds": 1})))
    tenant = Tenant("quota-test", quota=Quota(stored_bytes=100, open_batches=1))
    content = b'{"custom_id": "x"}\n' * 3  # 57 bytes
    store.files.upload(content, "one.jsonl", tenant=tenant)
    with pytest.raises(StoreError) as refused:
        store.files.upload(content, "two.jsonl", tenant=tenant)
    assert (refused.value.status, refused.value.code) == (429, "quota_exceeded")
    deadline = time.monotonic() + 30
    while True:  # the first upload's TTL runs out: it no longer counts
        try:
            store.files.upload(content, "two.jsonl", tenant=tenant)
            break
        except StoreError:
            assert time.monotonic() < deadline, "an expired upload still counted"
            time.sleep(0.2)
    assert [f["filename"] for f in store.files.uploads(tenant=tenant)] == ["two.jsonl"]

