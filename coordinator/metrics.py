"""The fleet as Redis sees it: live workers, their lifetime telemetry, queue depth and wait.

One snapshot feeds both views that read the fleet from outside a worker, so they can never
disagree: the gateway's ``GET /metrics`` (:func:`render_fleet_metrics`, Prometheus text) and
``specfleet top`` (:func:`fleet_snapshot`, rows and JSON). Reading is side-effect free: a
scrape never runs crash recovery (``Coordinator.fleet()`` does) and never writes to Redis.

Per-worker rates come from the telemetry each worker publishes with its heartbeat (its
engine's lifetime counters), so they are rates *while generating*: ``tokens_per_second`` is
generated tokens over decode-loop wall time and ``replays_per_second`` is replay events over
the same time, the same figures whether the view refreshes once or every second.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from datetime import UTC
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily
from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.queue import Queue
from rq.serializers import JSONSerializer

from coordinator.client import Coordinator
from shared.keys import STREAM_FIELD
from shared.protocol import Telemetry, WorkerInfo

#: Content type of :func:`render_fleet_metrics`'s body (Prometheus text exposition 0.0.4).
METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST
#: Every fleet metric's name starts with this (the worker's own metrics share it).
PREFIX = "specfleet:"
#: Lifetime telemetry fields each worker publishes with its heartbeat, re-exported by the
#: gateway as ``specfleet:worker_telemetry_<field>_total`` (a worker's own ``/metrics`` has the
#: same counts under its names, for a Prometheus that can reach the workers).
PUBLISHED_COUNTS = ("generated_tokens", "prompt_tokens", "drafts", "drafted", "accepted",
                    "target_decodes", "replay_events", "replay_tokens", "checkpoint_saves",
                    "host_fallbacks")


#: Lost workers a snapshot shows (the newest of the fleet's event stream).
LOST_SHOWN = 20


@dataclass(frozen=True)
class WorkerRow:
    """One live worker as the fleet views show it."""

    name: str
    model: str
    device: str
    slots: int
    busy_slots: int
    n_ctx: int
    current_jobs: list[str]
    heartbeat_age_seconds: float
    metrics_port: int | None
    generated_tokens: int
    tokens_per_second: float
    acceptance: float
    replay_events: int
    replays_per_second: float
    host_fallbacks: int
    checkpoint_mode: str | None
    #: Share of requests that reused a cached prefix (of those placed with the cache on), and
    #: the prompt tokens it served instead of prefilling them.
    prefix_hit_rate: float
    cached_tokens: int
    #: The whole lifetime telemetry the worker published (None before its first heartbeat
    #: with one).
    telemetry: dict[str, Any] | None


@dataclass(frozen=True)
class QueueRow:
    """One rq queue of a model: ``tier`` is the request priority it serves."""

    model: str
    tier: str
    depth: int
    oldest_wait_seconds: float


@dataclass(frozen=True)
class LostRow:
    """A worker declared lost, from the fleet's event stream (whoever swept it)."""

    worker: str
    model: str | None
    jobs: list[str]
    requeued: list[str]
    by: str | None
    timestamp: str


@dataclass(frozen=True)
class FleetSnapshot:
    """Everything one read of the fleet found."""

    taken_at: float
    workers: list[WorkerRow]
    queues: list[QueueRow]
    #: The newest workers declared lost (:data:`LOST_SHOWN` at most), newest first.
    lost: list[LostRow]

    def models(self) -> list[str]:
        return sorted({w.model for w in self.workers} | {q.model for q in self.queues})

    def to_json(self) -> dict[str, Any]:
        return {"taken_at": self.taken_at, "workers": [asdict(w) for w in self.workers],
                "queues": [asdict(q) for q in self.queues],
                "lost": [asdict(lost) for lost in self.lost]}


def worker_row(info: WorkerInfo, now: float) -> WorkerRow:
    """How a registration reads in the fleet views (rates from its lifetime telemetry)."""
    t = info.telemetry
    wall = t.wall_seconds if t else 0.0
    replays = t.replay_events if t else 0
    return WorkerRow(
        name=info.name, model=info.model_name, device=info.device, slots=info.slots,
        busy_slots=len(info.current_jobs), n_ctx=info.n_ctx, current_jobs=list(info.current_jobs),
        heartbeat_age_seconds=max(0.0, now - info.heartbeat_at), metrics_port=info.metrics_port,
        generated_tokens=t.generated_tokens if t else 0,
        tokens_per_second=t.effective_tokens_per_second if t else 0.0,
        acceptance=t.acceptance if t else 0.0, replay_events=replays,
        replays_per_second=replays / wall if wall > 0 else 0.0,
        host_fallbacks=t.host_fallbacks if t else 0,
        checkpoint_mode=t.checkpoint_mode if t else None,
        prefix_hit_rate=_hit_rate(t), cached_tokens=t.cached_tokens if t else 0,
        telemetry=t.model_dump(mode="json") if t else None)


def _hit_rate(t: Telemetry | None) -> float:
    placed = t.prefix_hits + t.prefix_misses if t else 0
    return t.prefix_hits / placed if t and placed else 0.0


def _oldest_wait(queue: Queue, now: float) -> float:
    """Seconds the job at the head of ``queue`` has waited (0 for an empty queue)."""
    for job_id in queue.get_job_ids(0, 1):
        try:
            job = Job.fetch(job_id, connection=queue.connection, serializer=JSONSerializer)
        except NoSuchJobError:
            return 0.0
        enqueued = job.enqueued_at
        if enqueued is None:
            return 0.0
        if enqueued.tzinfo is None:  # rq stores UTC
            enqueued = enqueued.replace(tzinfo=UTC)
        return max(0.0, now - enqueued.timestamp())
    return 0.0


def queue_rows(coordinator: Coordinator, models: set[str], now: float) -> list[QueueRow]:
    """Depth and head-of-queue wait of every queue of ``models``: each priority of each
    context tier (``tier`` is the queue name after the model's: ``ctx1024:high``, ``high``,
    ``normal`` for the untiered normal queue) and of each worker's own queues (``w:NAME``,
    ``w:NAME:high``: jobs routed to it for the prefix it holds)."""
    rows = []
    for model in sorted(models):
        base = coordinator.keys.queue(model)
        for name in coordinator.queue_names(model):
            queue = Queue(name, connection=coordinator.connection, serializer=JSONSerializer)
            rows.append(QueueRow(model=model, tier=name[len(base) + 1:] or "normal",
                                 depth=queue.count,
                                 oldest_wait_seconds=_oldest_wait(queue, now)))
    return rows


def lost_rows(coordinator: Coordinator, count: int = LOST_SHOWN) -> list[LostRow]:
    """The newest ``count`` workers declared lost, newest first (``Keys.fleet_events``)."""
    entries = coordinator.connection.xrevrange(coordinator.keys.fleet_events(), count=count)
    rows = []
    for _, fields in entries or []:
        record = json.loads((fields or {}).get(STREAM_FIELD.encode()) or b"{}")
        if record.get("event") == "worker.lost":
            rows.append(LostRow(worker=str(record["worker"]), model=record.get("model"),
                                jobs=list(record.get("jobs") or []),
                                requeued=list(record.get("requeued") or []),
                                by=record.get("by"), timestamp=str(record.get("timestamp"))))
    return rows


def fleet_snapshot(coordinator: Coordinator) -> FleetSnapshot:
    """Read live workers, every known model's queues and the newest lost workers
    (read-only)."""
    now = time.time()
    infos = coordinator.registry.live_workers()
    workers = sorted((worker_row(w, now) for w in infos), key=lambda r: (r.model, r.name))
    models = {w.model for w in workers} | coordinator.known_models()
    return FleetSnapshot(taken_at=now, workers=workers,
                         queues=queue_rows(coordinator, models, now),
                         lost=lost_rows(coordinator))


def render_fleet_metrics(coordinator: Coordinator) -> bytes:
    """The fleet snapshot in Prometheus text format: the gateway's ``GET /metrics`` body
    (serve it with ``Content-Type: METRICS_CONTENT_TYPE``)."""
    snapshot = fleet_snapshot(coordinator)
    registry = CollectorRegistry(auto_describe=False)

    def gauge(name: str, doc: str, labels: tuple[str, ...]) -> Gauge:
        return Gauge(PREFIX + name, doc, labels, registry=registry)

    depth = gauge("queue_depth", "Jobs waiting in a model's queue", ("model", "tier"))
    wait = gauge("queue_oldest_wait_seconds", "How long the job at the head of a queue has "
                 "waited", ("model", "tier"))
    for q in snapshot.queues:
        depth.labels(q.model, q.tier).set(q.depth)
        wait.labels(q.model, q.tier).set(q.oldest_wait_seconds)
    live = gauge("workers_live", "Workers with an unexpired registration", ("model",))
    slots = gauge("fleet_slots", "Generation slots of the live workers", ("model",))
    busy = gauge("fleet_busy_slots", "Slots running a job", ("model",))
    for model in snapshot.models():
        rows = [w for w in snapshot.workers if w.model == model]
        live.labels(model).set(len(rows))
        slots.labels(model).set(sum(w.slots for w in rows))
        busy.labels(model).set(sum(w.busy_slots for w in rows))
    age = gauge("worker_heartbeat_age_seconds", "Seconds since a worker's last heartbeat",
                ("worker", "model", "device"))
    for w in snapshot.workers:
        age.labels(w.name, w.model, w.device).set(w.heartbeat_age_seconds)
    registry.register(_PublishedTelemetry(snapshot.workers))
    registry.register(_Routing(coordinator, snapshot.models()))
    return generate_latest(registry)


class _Routing:
    """Submits per model by where they were queued (``Keys.routing``): ``to="holder"``, a
    worker holding the prompt's prefix; ``to="shared"``, the model's shared queues."""

    def __init__(self, coordinator: Coordinator, models: list[str]) -> None:
        self._coordinator = coordinator
        self._models = models

    def collect(self) -> list[CounterMetricFamily]:
        family = CounterMetricFamily(f"{PREFIX}prefix_routing", "Submits by where they were "
                                     "queued: a prefix holder's own queue or the shared ones",
                                     labels=["model", "to"])
        keys = self._coordinator.keys
        with self._coordinator.connection.pipeline(transaction=False) as pipe:
            for model in self._models:
                pipe.hgetall(keys.routing(model))
            counts = pipe.execute()
        for model, count in zip(self._models, counts, strict=True):
            for to in ("holder", "shared"):
                family.add_metric([model, to], int(count.get(to.encode(), 0)))
        return [family]


class _PublishedTelemetry:
    """A collector of the counts in the workers' published telemetry (counters: they only
    grow during a worker's life and restart at 0 with it, as Prometheus counters do)."""

    def __init__(self, workers: list[WorkerRow]) -> None:
        self._workers = workers

    def collect(self) -> list[CounterMetricFamily]:
        families = []
        for field in PUBLISHED_COUNTS:
            family = CounterMetricFamily(f"{PREFIX}worker_telemetry_{field}",
                                         f"Lifetime telemetry {field} a worker published",
                                         labels=["worker", "model", "device"])
            for w in self._workers:
                if w.telemetry is not None:
                    family.add_metric([w.name, w.model, w.device], w.telemetry[field])
            families.append(family)
        return families


__all__ = ["METRICS_CONTENT_TYPE", "FleetSnapshot", "LostRow", "QueueRow", "WorkerRow",
           "fleet_snapshot", "lost_rows", "render_fleet_metrics", "worker_row"]
