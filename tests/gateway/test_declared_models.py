"""A fleet that scales from zero, with real processes: two ``specfleet serve`` gateways on a
deployment with no worker (one waits up to two minutes for a worker, one has API keys and
waits two seconds), the real ``openai`` client, and real workers on the tiny chat model,
started after the requests that wait for them.

A model is declared through the gateway's admin route; a batch created before any worker
completes every line once one starts, a streamed chat waits and completes, a model nobody
declared or served is refused at once, a wait past ``SPECFLEET_WAIT_FOR_WORKER_SECONDS`` is a
503 naming the model and the deadline, and a worker still loading makes its model awaited.
Each test has its own model, so none sees another's workers.
"""

from __future__ import annotations

import io
import json
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from helpers import wait_for
from prometheus_client.parser import text_string_to_metric_families
from redis import Redis

from coordinator.client import Coordinator
from shared.settings import Settings
from shared.starting import starting_workers

from .conftest import deployment_settings
from .gateway import Gateway

from service.conftest import _delete_namespace  # isort: skip
from service.workers import Fleet  # isort: skip

USER_KEY, ADMIN_KEY = "user-key-1", "admin-key-1"
LINES = 30


@dataclass
class Zero:
    settings: Settings
    fleet: Fleet
    patient: Gateway  # open, waits up to 120 s for a worker
    impatient: Gateway  # API keys, waits 2 s

    def client(self, gateway: Gateway | None = None, key: str = USER_KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=(gateway or self.patient).url + "/v1", api_key=key,
                             max_retries=0, timeout=120)

    def declare(self, name: str, gateway: Gateway | None = None,
                key: str = ADMIN_KEY, **fields: Any) -> httpx.Response:
        return httpx.post((gateway or self.patient).url + "/v1/specfleet/models",
                          json={"name": name, "model": str(self.fleet.model), **fields},
                          headers={"Authorization": f"Bearer {key}"}, timeout=30)

    def gauge(self, name: str, model: str) -> float:
        """A per-model gauge of the gateway's /metrics (0 when it has no such series)."""
        body = httpx.get(self.patient.url + "/metrics", timeout=30).text
        return next((s.value for f in text_string_to_metric_families(body) for s in f.samples
                     if s.name == f"specfleet:{name}" and s.labels.get("model") == model), 0.0)


@pytest.fixture(scope="module")
def zero(chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Zero]:
    settings = deployment_settings("z")
    logs = tmp_path_factory.mktemp("zero")
    quick = {"SPECFLEET_SSE_KEEPALIVE_SECONDS": "1"}
    patient = Gateway(settings, logs, env={**quick, "SPECFLEET_WAIT_FOR_WORKER_SECONDS": "120"})
    impatient = Gateway(settings, logs, env={
        **quick, "SPECFLEET_WAIT_FOR_WORKER_SECONDS": "2", "SPECFLEET_API_KEYS": USER_KEY,
        "SPECFLEET_ADMIN_API_KEYS": ADMIN_KEY})
    fleet = Fleet(settings, chat_model, logs)
    try:
        patient.start()
        impatient.start()
        yield Zero(settings, fleet, patient, impatient)
    finally:
        patient.stop()
        impatient.stop()
        fleet.stop_all()
        _delete_namespace(Redis.from_url(settings.redis_url), settings.prefix)


def test_a_batch_created_before_any_worker_completes_once_one_starts(zero: Zero) -> None:
    model = "tiny-batch"
    assert zero.declare(model, aliases=["batch-alias"]).status_code == 200
    client = zero.client()
    listed = {m.id: m.model_extra["specfleet"] for m in client.models.list().data}
    assert listed[model]["declared"] and listed[model]["live_workers"] == 0
    assert listed[model]["aliases"] == ["batch-alias"]
    lines = [json.dumps({"custom_id": f"line-{n}", "method": "POST", "url": "/v1/completions",
                         "body": {"model": model, "prompt": f"count {n}:", "max_tokens": 4}})
             for n in range(LINES)]
    upload = client.files.create(file=("in.jsonl", io.BytesIO("\n".join(lines).encode())),
                                 purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                  completion_window="24h")
    # its first line waits for a worker, and an autoscaler can see that it does
    wait_for(lambda: zero.gauge("model_waiting_requests", model) >= 1, what="a line waiting")
    assert zero.gauge("model_demand_slots", model) >= 1
    assert client.batches.retrieve(batch.id).request_counts.failed == 0
    zero.fleet.start("w-batch", model_name=model, wait=False)
    wait_for(lambda: client.batches.retrieve(batch.id).status in
             {"completed", "failed", "expired", "cancelled"}, what="the batch ended",
             timeout=120)
    batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed"
    assert (batch.request_counts.completed, batch.request_counts.failed) == (LINES, 0)
    assert zero.gauge("model_waiting_requests", model) == 0
    assert client.models.retrieve(model).model_extra["specfleet"]["live_workers"] == 1


def test_a_streamed_chat_waits_for_a_worker_and_completes(zero: Zero) -> None:
    model = "tiny-stream"
    assert zero.declare(model).status_code == 200
    chunks: list[Any] = []
    failed: list[BaseException] = []

    def read() -> None:
        try:
            stream = zero.client().chat.completions.create(
                model=model, messages=[{"role": "user", "content": "Say something"}],
                max_tokens=8, temperature=0, stream=True)
            chunks.extend(stream)
        except BaseException as exc:  # noqa: BLE001  the test thread reports it
            failed.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    wait_for(lambda: zero.gauge("model_waiting_requests", model) == 1,
             what="the stream waiting")
    assert not chunks and not failed  # nothing yet: it waits
    zero.fleet.start("w-stream", model_name=model, wait=False)
    reader.join(timeout=120)
    assert not reader.is_alive() and not failed, failed
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")


def test_an_undeclared_model_is_refused_at_once_naming_the_known(zero: Zero) -> None:
    assert zero.declare("tiny-known").status_code == 200
    with pytest.raises(openai.NotFoundError) as unknown:
        zero.client().completions.create(model="nobody", prompt="x", max_tokens=2)
    assert unknown.value.body["code"] == "model_not_found"
    assert "unknown model 'nobody'" in unknown.value.message
    assert "tiny-known" in unknown.value.message
    assert zero.gauge("model_waiting_requests", "nobody") == 0


def test_a_wait_past_the_deadline_is_a_503_naming_the_model_and_the_deadline(
        zero: Zero) -> None:
    model = "tiny-never"
    # declaring needs the admin key where the gateway has keys
    refused = zero.declare(model, gateway=zero.impatient, key=USER_KEY)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "admin_key_required"
    assert zero.declare(model, gateway=zero.impatient).status_code == 200
    client = zero.client(zero.impatient)
    with pytest.raises(openai.InternalServerError) as late:
        client.completions.create(model=model, prompt="x", max_tokens=2)
    assert late.value.status_code == 503
    assert late.value.body["code"] == "worker_wait_timeout"
    assert late.value.response.headers["retry-after"]
    assert f"no worker of model '{model}' became live within 2 s" in late.value.message
    # a stream says at once what it waits for, then ends with the same error
    with httpx.stream("POST", zero.impatient.url + "/v1/chat/completions", timeout=60,
                      headers={"Authorization": f"Bearer {USER_KEY}"},
                      json={"model": model, "stream": True,
                            "messages": [{"role": "user", "content": "hi"}]}) as response:
        lines = [line for line in response.iter_lines() if line]
    assert response.status_code == 200
    assert lines[0] == f": waiting for a worker of model '{model}'"
    errors = [json.loads(line[6:])["error"] for line in lines if line.startswith("data: {")]
    assert [e["code"] for e in errors] == ["worker_wait_timeout"]
    assert lines[-1] == "data: [DONE]"
    # the Responses API waits the same way, and its stream ends with its own error event
    with pytest.raises(openai.InternalServerError) as responses_late:
        client.responses.create(model=model, input="hi")
    assert responses_late.value.body["code"] == "worker_wait_timeout"
    with httpx.stream("POST", zero.impatient.url + "/v1/responses", timeout=60,
                      headers={"Authorization": f"Bearer {USER_KEY}"},
                      json={"model": model, "input": "hi", "stream": True}) as response:
        lines = [line for line in response.iter_lines() if line]
    assert lines[0] == f": waiting for a worker of model '{model}'"
    assert lines[-2:-1] == ["event: error"]
    assert json.loads(lines[-1][6:])["code"] == "worker_wait_timeout"
    assert zero.gauge("model_waiting_requests", model) == 0


def _stopped_while_loading(zero: Zero, model: str, coordinator: Coordinator) -> str:
    """Start a worker of ``model`` and SIGSTOP it as soon as its loading record shows, so
    it stays loading for as long as the test needs (its record's TTL is a minute); the
    tiny model loads in tens of milliseconds, so a worker that registered before the stop
    landed is stopped and another one tried. Returns the stopped worker's name."""
    keys = zero.settings.keys
    for attempt in range(5):
        name = f"w-loading-{attempt}"
        zero.fleet.start(name, model_name=model, wait=False,
                         extra_env={"SPECFLEET_WORKER_TTL_SECONDS": "60"})
        deadline = time.monotonic() + 60
        while model not in starting_workers(coordinator.connection, keys):
            assert time.monotonic() < deadline, "the worker never wrote its loading record"
            assert zero.fleet.alive(name), zero.fleet.log(name)[-2000:]
        zero.fleet.kill(name, signal.SIGSTOP)
        if not coordinator.registry.is_alive(name):
            return name
        zero.fleet.kill(name, signal.SIGCONT)
        zero.fleet.kill(name, signal.SIGKILL)
    raise AssertionError("every worker registered before it could be stopped loading")


def test_a_worker_still_loading_makes_its_undeclared_model_awaited(zero: Zero) -> None:
    model = "tiny-loading"  # never declared: only its loading worker announces it
    coordinator = Coordinator(zero.settings)
    name = _stopped_while_loading(zero, model, coordinator)
    completions: list[Any] = []
    failed: list[BaseException] = []

    def ask() -> None:
        try:
            completions.append(zero.client().completions.create(
                model=model, prompt="Once upon", max_tokens=4, temperature=0))
        except BaseException as exc:  # noqa: BLE001  the test thread reports it
            failed.append(exc)

    asking = threading.Thread(target=ask)
    asking.start()
    wait_for(lambda: zero.gauge("model_waiting_requests", model) == 1 or bool(failed),
             what="the request waiting")
    assert not failed, failed  # not refused as an unknown model: it waits
    assert zero.gauge("model_starting_workers", model) == 1
    zero.fleet.kill(name, signal.SIGCONT)  # it finishes loading, registers, serves
    asking.join(timeout=120)
    assert not asking.is_alive() and not failed, failed
    assert completions[0].choices[0].text and completions[0].model == model
