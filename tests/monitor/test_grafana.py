"""Every metric the Grafana dashboard in docs/ queries is one a worker or the gateway exports.

The exported names are read from real expositions: a worker's registry after it has counted a
generation with speculation, replays and a host fallback (every labelled series exists), and
the fleet metrics rendered from a real Redis with one registered worker.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from prometheus_client import generate_latest
from redis import Redis
from service.conftest import _delete_namespace

from coordinator.client import Coordinator
from coordinator.metrics import render_fleet_metrics
from shared.protocol import CheckpointMode, Telemetry, WorkerInfo
from worker.service.metrics import WorkerMetrics

from .conftest import make_settings
from .scrape import samples

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-specfleet.json"
_METRIC = re.compile(r"specfleet:[A-Za-z0-9_:]+")


def _queried(dashboard: dict) -> set[str]:
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    assert exprs, "the dashboard queries nothing"
    return {m for e in exprs for m in _METRIC.findall(e)}


def _worker_exposition() -> str:
    metrics = WorkerMetrics("w", "m", "cpu")
    metrics.worker_loaded(64, None, "mtp", CheckpointMode.DEVICE)
    metrics.job_started("j")
    metrics.tokens("j", 1)
    metrics.tokens("j", 2)
    metrics.job_finished("j", Telemetry(
        spec_method="mtp", drafts=1, drafted=2, accepted=1, accepted_per_position=[1],
        drafted_per_position=[1, 1], target_decodes=2, generated_tokens=3, replay_events=1,
        replay_tokens=2, checkpoint_saves=1, host_fallbacks=1,
        host_fallback_reason="fault_injection", checkpoint_mode="host",
        checkpoint_reservation_bytes=64), "finished")
    metrics.job_requeued("shutdown")
    return generate_latest(metrics.registry).decode()


def _fleet_exposition() -> str:
    settings = make_settings()
    coordinator = Coordinator(settings)
    now = time.time()
    try:
        coordinator.registry.register(WorkerInfo(
            name="w", model_name="m", model_path="/m.gguf", device="cpu", n_ctx=64,
            version="test", pid=1, host="h", started_at=now, heartbeat_at=now))
        return render_fleet_metrics(coordinator).decode()
    finally:
        _delete_namespace(Redis.from_url(settings.redis_url), settings.prefix)


def test_every_metric_the_dashboard_queries_is_exported() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exported = {name for text in (_worker_exposition(), _fleet_exposition())
                for name, _, _ in samples(text)}
    missing = sorted(_queried(dashboard) - exported)
    assert not missing, f"the dashboard queries metrics nobody exports: {missing}"


def test_the_check_catches_a_misspelt_metric() -> None:
    typo = "rate(specfleet:spec_decode_num_draft_total[5m])"
    broken = {"panels": [{"targets": [{"expr": typo}]}]}
    exported = {name for name, _, _ in samples(_worker_exposition())}
    assert _queried(broken) - exported == {"specfleet:spec_decode_num_draft_total"}
