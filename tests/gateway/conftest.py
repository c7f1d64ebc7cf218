"""Gateway fixtures: real Redis (own key prefix), real workers on the tiny chat model, a real
``specfleet serve`` subprocess, driven with the real ``openai`` client.

Most tests only read from the fleet, so they share one ``deployment`` (a worker and a gateway
for the package, under one prefix); tests that slow, kill or restart things get their own.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from redis import Redis
from rq.job import Job
from rq.serializers import JSONSerializer

from coordinator.client import Coordinator
from coordinator.redis_local import DEFAULT_URL, answers
from shared.redact import redact
from shared.settings import Settings
from worker.testmodels.tiny import write_dense_llama

from .gateway import Gateway

# tests/ is on sys.path (pytest's rootdir-relative import): the service tests' own fixtures.
from service.conftest import _delete_namespace, settings  # noqa: F401  isort: skip
from service.workers import Fleet  # isort: skip


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny dense model with a chat template and control-token turn markers."""
    return write_dense_llama(tmp_path_factory.mktemp("chat") / "tiny-chat.gguf", chat=True)


@dataclass
class Deployment:
    settings: Settings
    fleet: Fleet
    gateway: Gateway

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.gateway.url + "/v1", api_key="unused",
                             max_retries=0, timeout=60)


def deployment_settings(tag: str) -> Settings:
    """A new deployment's settings on the suite's Redis (its own key prefix, fast heartbeats
    and token chunks); skips without a Redis."""
    url = os.environ.get("REDIS_URL", DEFAULT_URL)
    if not answers(url):
        pytest.skip(f"no Redis at {redact(url)} (make test starts one)")
    return Settings(redis_url=url, prefix=f"{tag}{uuid.uuid4().hex[:12]}",
                    heartbeat_seconds=0.25, worker_ttl_seconds=1.5, token_chunk=4,
                    token_flush_seconds=0.0)


@contextmanager
def deployed(s: Settings, model: Path, logs: Path, worker: str = "w1",
             args: tuple[str, ...] | None = None, gateway_env: dict[str, str] | None = None,
             register_timeout: float = 60) -> Iterator[Deployment]:
    """One worker of ``model`` (``args`` as :meth:`Fleet.start` takes them) and one gateway,
    started side by side; both stopped and the deployment's keys deleted afterwards."""
    fleet = Fleet(s, model, logs)
    gateway = Gateway(s, logs, env=gateway_env)
    try:
        if args is None:
            fleet.start(worker, wait=False)
        else:
            fleet.start(worker, wait=False, args=args)
        gateway.start()
        fleet.wait_registered(worker, timeout=register_timeout)
        yield Deployment(s, fleet, gateway)
    finally:
        gateway.stop()
        fleet.stop_all()
        _delete_namespace(Redis.from_url(s.redis_url), s.prefix)


@pytest.fixture(scope="module")
def byte_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """One worker on the byte-level tiny model and one gateway: text round-trips, so the
    grammar of tool calls can be written, and with no template of its own the model gets
    ChatML and tools travel in the generic format (the tool tests' fleet)."""
    logs = tmp_path_factory.mktemp("byte-fleet")
    model = write_dense_llama(logs / "tiny-bytes.gguf", byte_vocab=True)
    with deployed(deployment_settings("rt"), model, logs,
                  args=("--ctx", "4096", "--slots", "2")) as d:
        yield d


def queued(fleet: Deployment, job_id: str) -> dict[str, Any]:
    """The request the gateway queued for a job (what the worker renders): the tests read a
    turn's messages here to see what the gateway made of a client's history."""
    job = Job.fetch(job_id, connection=Coordinator(fleet.settings).connection,
                    serializer=JSONSerializer)
    return dict(job.args[0])


@pytest.fixture(scope="package")
def deployment(chat_model: Path, tmp_path_factory: pytest.TempPathFactory,
               ) -> Iterator[Deployment]:
    """One worker (``w1``) and one gateway shared by the read-only tests."""
    with deployed(deployment_settings("g"), chat_model,
                  tmp_path_factory.mktemp("deployment")) as d:
        yield d


@pytest.fixture
def fleet(settings: Settings, chat_model: Path, tmp_path: Path) -> Iterator[Fleet]:  # noqa: F811
    f = Fleet(settings, chat_model, tmp_path)
    yield f
    f.stop_all()


@pytest.fixture
def gateway(settings: Settings, tmp_path: Path) -> Iterator[Gateway]:  # noqa: F811
    g = Gateway(settings, tmp_path).start()
    yield g
    g.stop()


@pytest.fixture
def client(gateway: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)
