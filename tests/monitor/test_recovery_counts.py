"""A worker killed mid-generation: its job is recovered by another, and the monitor (over both
logs) and the rescuer's ``/metrics`` count the loss and the requeue where they happened."""

from __future__ import annotations

import json
import signal
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import specfleet
from redis import Redis
from service.conftest import _delete_namespace
from service.workers import MODEL_NAME, Fleet

from coordinator.client import Coordinator
from shared.protocol import ProgressEvent, TokenEvent

from .conftest import make_settings
from .scrape import total

ARGS = ("--ctx", "512", "--metrics-port", "0")


@pytest.fixture
def fleet(dense_model: Path, tmp_path: Path) -> Iterator[Fleet]:
    settings = make_settings()
    f = Fleet(settings, dense_model, tmp_path)
    try:
        yield f
    finally:
        f.stop_all()
        _delete_namespace(Redis.from_url(settings.redis_url), settings.prefix)


def test_a_lost_worker_and_its_recovered_job_are_counted(fleet: Fleet, tmp_path: Path) -> None:
    fleet.start("victim", step_delay=0.1, args=ARGS)
    coordinator = Coordinator(fleet.settings)
    handle = coordinator.submit({"model": MODEL_NAME, "prompt_tokens": [3, 1, 4, 1, 5],
                                 "max_tokens": 400})  # 40 s: outlasts a loaded start
    events = handle.stream(timeout=120)
    for event in events:  # attempt 1 is generating on the victim
        if isinstance(event, TokenEvent):
            break
    fleet.start("rescuer", args=ARGS)
    fleet.kill("victim")  # SIGKILL: no goodbye, its job sits in its in-flight list
    list(events)
    result = handle.result(timeout=30)
    assert result.worker == "rescuer" and result.attempts == 2
    assert any(isinstance(e, ProgressEvent) and e.stage == "requeued"
               for e in coordinator.handle(handle.job_id).stream(timeout=5))
    info = coordinator.registry.registration("rescuer")
    assert info is not None and info.metrics_port
    text = urllib.request.urlopen(f"http://127.0.0.1:{info.metrics_port}/metrics",
                                  timeout=10).read().decode()
    assert total(text, "specfleet:requeues_total", reason="lost") == 1
    assert total(text, "specfleet:jobs_total", outcome="finished") == 1
    fleet.kill("rescuer", signal.SIGTERM)
    fleet.procs["rescuer"].wait(timeout=30)

    proc = specfleet("monitor", "--json", "--fail-on", "lost>0", str(tmp_path / "*.log"),
                     timeout=60)
    assert proc.returncode == 1, proc.stderr
    out = json.loads(proc.stdout)
    victim, rescuer = out["workers"]["victim"], out["workers"]["rescuer"]
    # worker.lost and the recovery's job.requeued name the dead worker (the one to look at).
    assert victim["lost"] == 1 and victim["recoveries"] == 1
    assert victim["requeues_by_reason"] == {"lost": 1}
    assert victim["jobs_started"] == 1 and victim["generations"] == 0
    assert rescuer["jobs_finished"] == 1 and rescuer["generations"] == 1
    assert rescuer["generated_tokens"] == len(result.tokens)
    assert out["total"]["recoveries"] == 1
    job = out["jobs"][handle.job_id]
    assert job["attempts"] == 2 and job["workers"] == ["victim", "rescuer"]
    assert job["outcome"] == "finished"
    assert out["alerts"] == ["lost>0 holds for total, victim"]
