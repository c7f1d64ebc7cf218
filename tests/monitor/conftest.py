"""One live run shared by the monitor tests: a real worker on the tiny hybrid model with MTP,
rollback depth D=1 < N=5 (so deep rejections replay) and the device checkpoint forced to fail
(``SPECFLEET_FAIL_DEVICE_CHECKPOINT=1``: the reservation falls back to the host), serving its
metrics on a free port. The run happens once per module; each test reads another view of it
(the scraped ``/metrics``, the registration, the JSON log) and compares it with the per-job
telemetry of the same run.
"""

from __future__ import annotations

import os
import signal
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest
from helpers import wait_for
from redis import Redis
from service.conftest import _delete_namespace
from service.workers import MODEL_NAME, Fleet

from coordinator.client import Coordinator
from coordinator.redis_local import DEFAULT_URL, answers
from shared.protocol import Telemetry, WorkerInfo
from shared.redact import redact
from shared.results import JobResult
from shared.settings import Settings

PROMPTS = [[5, 17, 42, 99, 3, 250, 8, 61], [7, 7, 31, 2, 99, 64], [120, 3, 3, 45, 9, 17, 200]]
MAX_TOKENS = 80
WORKER = "m1"
SPEC = {"method": "mtp", "draft_max": 5, "rollback_depth": 1}
T = TypeVar("T")
REJECTED_PROMPT = " ".join(f"word{i} and more" for i in range(40))


@dataclass
class LiveRun:
    settings: Settings
    results: list[JobResult]
    info: WorkerInfo
    metrics_text: str
    log: Path

    def telemetries(self) -> list[Telemetry]:
        return [r.telemetry for r in self.results if r.telemetry is not None]


def make_settings() -> Settings:
    url = os.environ.get("REDIS_URL", DEFAULT_URL)
    if not answers(url):
        pytest.skip(f"no Redis at {redact(url)} (make test starts one)")
    return Settings(redis_url=url, prefix=f"t{uuid.uuid4().hex[:12]}", heartbeat_seconds=0.25,
                    worker_ttl_seconds=1.5, token_chunk=4, token_flush_seconds=0.0)


@pytest.fixture(scope="module")
def live_run(hybrid_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveRun]:
    settings = make_settings()
    logs = tmp_path_factory.mktemp("worker-logs")
    fleet = Fleet(settings, hybrid_model, logs)
    try:
        fleet.start(WORKER, extra_env={"SPECFLEET_FAIL_DEVICE_CHECKPOINT": "1"},
                    args=("--ctx", "512", "--spec", "mtp", "--draft-max", "5",
                          "--rollback-depth", "1", "--metrics-port", "0"))
        coordinator = Coordinator(settings)
        handles = [coordinator.submit({"model": MODEL_NAME, "prompt_tokens": p,
                                       "max_tokens": MAX_TOKENS, "speculative": SPEC})
                   for p in PROMPTS]
        results = [h.result(timeout=120) for h in handles]
        # Fits at submit (a text prompt is at least one token) but not on the worker, which
        # counts its tokens exactly: a rejected job (a ``context`` failure, no telemetry).
        rejected = coordinator.submit({"model": MODEL_NAME, "prompt": REJECTED_PROMPT,
                                       "max_tokens": 500}).result(timeout=60)
        assert rejected.status == "failed" and "context" in (rejected.error or ""), rejected
        results.append(rejected)
        generated = sum(r.telemetry.generated_tokens for r in results if r.telemetry)

        def registration() -> WorkerInfo | None:
            info = coordinator.registry.registration(WORKER)
            t = info.telemetry if info else None
            return info if t is not None and t.generated_tokens == generated else None

        info = wait_for(registration, what="a heartbeat with the run's telemetry")
        assert info.metrics_port, "the worker published no metrics port"
        url = f"http://127.0.0.1:{info.metrics_port}/metrics"
        metrics_text = urllib.request.urlopen(url, timeout=10).read().decode()
        fleet.kill(WORKER, signal.SIGTERM)
        fleet.procs[WORKER].wait(timeout=30)
        yield LiveRun(settings, results, info, metrics_text, logs / f"{WORKER}.log")
    finally:
        fleet.stop_all()
        _delete_namespace(Redis.from_url(settings.redis_url), settings.prefix)
