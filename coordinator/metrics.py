"""The fleet as Redis sees it: live workers, their lifetime telemetry, queue depth and wait.

One snapshot feeds both views that read the fleet from outside a worker, so they can never
disagree: the gateway's ``GET /metrics`` (:func:`render_fleet_metrics`, Prometheus text) and
``specfleet top`` (:func:`fleet_snapshot`, rows and JSON). Reading is side-effect free: a
scrape never runs crash recovery (``Coordinator.recover()`` does, which ``specfleet fleet``
calls) and never writes to Redis.

Per-worker rates come from the telemetry each worker publishes with its heartbeat (its
engine's lifetime counters), so they are rates *while generating*: ``tokens_per_second`` is
generated tokens over decode-loop wall time and ``replays_per_second`` is replay events over
the same time, the same figures whether the view refreshes once or every second.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily
from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.queue import Queue
from rq.serializers import JSONSerializer

from coordinator.client import Coordinator
from coordinator.models import ModelListing
from shared.fleet_events import decode
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
#: Entries of the fleet's event stream read back at a time while looking for lost workers.
_LOST_PAGE = 500


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
    #: Its fit per device, in the model's device order (empty: it published no fit).
    devices: list[DeviceRow] = field(default_factory=list)


@dataclass(frozen=True)
class DeviceRow:
    """One device of a worker's fit: what its components take there (``fitted_bytes``), what
    the device had free at the fit and the margin the fitter left."""

    device: str
    fitted_bytes: int
    free_bytes: int
    margin_bytes: int


@dataclass(frozen=True)
class QueueRow:
    """One rq queue of a model: ``tier`` is the request priority it serves."""

    model: str
    tier: str
    depth: int
    oldest_wait_seconds: float


@dataclass(frozen=True)
class ModelDemand:
    """One model's demand and capacity, as an autoscaler reads them (per model, without
    knowing queues, tiers or keys): ``demand_slots`` is what the model could keep busy now
    (running + queued + waiting for a worker); ``tokens_per_second`` sums its live workers'
    generation speed while generating (a capacity figure: for throughput, take the rate of
    ``worker_telemetry_generated_tokens_total``)."""

    model: str
    declared: bool
    live_workers: int
    starting_workers: int
    slots: int
    busy_slots: int
    free_slots: int
    queued_jobs: int
    waiting_requests: int
    oldest_wait_seconds: float
    tokens_per_second: float
    demand_slots: int


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
    #: Every model's demand and capacity (each model known, declared, served or loading).
    demand: list[ModelDemand] = dataclasses.field(default_factory=list)

    def models(self) -> list[str]:
        return sorted({w.model for w in self.workers} | {q.model for q in self.queues}
                      | {d.model for d in self.demand})

    def to_json(self) -> dict[str, Any]:
        return {"taken_at": self.taken_at, "workers": [asdict(w) for w in self.workers],
                "queues": [asdict(q) for q in self.queues],
                "lost": [asdict(lost) for lost in self.lost],
                "demand": [asdict(d) for d in self.demand]}


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
        telemetry=t.model_dump(mode="json") if t else None,
        devices=[DeviceRow(d.device, sum(d.components.values()), d.free_bytes, d.margin_bytes)
                 for d in (info.fit.devices if info.fit else [])])


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
    """The newest ``count`` workers declared lost, newest first (``Keys.fleet_events``, read
    back a page at a time: the stream's other events are passed over)."""
    rows: list[LostRow] = []
    newest = "+"
    while len(rows) < count:
        entries = coordinator.connection.xrevrange(coordinator.keys.fleet_events(), max=newest,
                                                   count=_LOST_PAGE)
        for _, fields in entries or []:
            record = decode(fields)
            if record is not None and record["event"] == "worker.lost" and len(rows) < count:
                rows.append(LostRow(worker=str(record["worker"]), model=record.get("model"),
                                    jobs=list(record.get("jobs") or []),
                                    requeued=list(record.get("requeued") or []),
                                    by=record.get("by"),
                                    timestamp=str(record.get("timestamp"))))
        if not entries or len(entries) < _LOST_PAGE:
            break
        last = entries[-1][0]
        newest = "(" + (last.decode() if isinstance(last, bytes) else str(last))
    return rows


def demand_rows(coordinator: Coordinator, workers: list[WorkerRow], queues: list[QueueRow],
                listings: list[ModelListing], models: list[str]) -> list[ModelDemand]:
    """Each of ``models``' demand and capacity, from the workers and queues already read, the
    directory's listing and the waiting requests (``coordinator/waiting.py``)."""
    waiting = coordinator.waiting.of(models)
    by_name = {m.name: m for m in listings}
    rows = []
    for model in models:
        mine = [w for w in workers if w.model == model]
        queued = [q for q in queues if q.model == model]
        listing = by_name.get(model)
        slots, busy = sum(w.slots for w in mine), sum(w.busy_slots for w in mine)
        depth = sum(q.depth for q in queued)
        wait = waiting[model]
        rows.append(ModelDemand(
            model=model, declared=listing is not None and listing.entry is not None,
            live_workers=len(mine), starting_workers=len(listing.starting) if listing else 0,
            slots=slots, busy_slots=busy, free_slots=max(0, slots - busy), queued_jobs=depth,
            waiting_requests=wait.requests,
            oldest_wait_seconds=max([wait.oldest_seconds,
                                     *(q.oldest_wait_seconds for q in queued)]),
            tokens_per_second=sum(w.tokens_per_second for w in mine),
            demand_slots=busy + depth + wait.requests))
    return rows


def fleet_snapshot(coordinator: Coordinator) -> FleetSnapshot:
    """Read live workers, every model's queues and demand (known, declared, served or
    loading) and the newest lost workers (read-only)."""
    now = time.time()
    infos = coordinator.registry.live_workers()
    workers = sorted((worker_row(w, now) for w in infos), key=lambda r: (r.model, r.name))
    listings = coordinator.models.listing(infos)
    models = sorted({w.model for w in workers} | coordinator.known_models()
                    | {m.name for m in listings})
    queues = queue_rows(coordinator, set(models), now)
    return FleetSnapshot(taken_at=now, workers=workers, queues=queues,
                         lost=lost_rows(coordinator),
                         demand=demand_rows(coordinator, workers, queues, listings, models))


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
    fitted = gauge("worker_device_fitted_bytes", "Bytes a worker's fit placed on one of its "
                   "devices (every component: weights, KV, state, compute, reservations)",
                   ("worker", "model", "device"))
    free = gauge("worker_device_free_bytes", "Bytes the device had free when the worker fitted",
                 ("worker", "model", "device"))
    for w in snapshot.workers:
        age.labels(w.name, w.model, w.device).set(w.heartbeat_age_seconds)
        for d in w.devices:
            fitted.labels(w.name, w.model, d.device).set(d.fitted_bytes)
            free.labels(w.name, w.model, d.device).set(d.free_bytes)
    _demand_gauges(snapshot.demand, gauge)
    registry.register(_PublishedTelemetry(snapshot.workers))
    registry.register(_Routing(coordinator, snapshot.models()))
    return generate_latest(registry)


#: The per-model gauges an autoscaler reads (``model_<field>``), from :class:`ModelDemand`.
DEMAND_GAUGES = {
    "declared": "1 when the model is declared (specfleet models add)",
    "starting_workers": "Workers loading the model, not yet registered",
    "free_slots": "Generation slots of the live workers not running a job",
    "queued_jobs": "Jobs queued for the model, every tier and worker queue",
    "waiting_requests": "Requests and batch lines waiting for a worker of the model before "
                        "they can be queued (it is declared or loading, none is live)",
    "oldest_wait_seconds": "How long the oldest queued job or waiting request has waited",
    "tokens_per_second": "Sum of the live workers' generation speed while generating",
    "demand_slots": "Slots the model could keep busy now: running + queued + waiting",
}


def _demand_gauges(demand: list[ModelDemand], gauge: Callable[..., Gauge]) -> None:
    """One gauge per :data:`DEMAND_GAUGES` field, a series per model."""
    for name, doc in DEMAND_GAUGES.items():
        family = gauge(f"model_{name}", doc, ("model",))
        for row in demand:
            family.labels(row.model).set(float(getattr(row, name)))


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
        for count in PUBLISHED_COUNTS:
            family = CounterMetricFamily(f"{PREFIX}worker_telemetry_{count}",
                                         f"Lifetime telemetry {count} a worker published",
                                         labels=["worker", "model", "device"])
            for w in self._workers:
                if w.telemetry is not None:
                    family.add_metric([w.name, w.model, w.device], w.telemetry[count])
            families.append(family)
        return families


__all__ = ["METRICS_CONTENT_TYPE", "DeviceRow", "FleetSnapshot", "LostRow", "ModelDemand",
           "QueueRow", "WorkerRow", "demand_rows", "fleet_snapshot", "lost_rows",
           "render_fleet_metrics", "worker_row"]
