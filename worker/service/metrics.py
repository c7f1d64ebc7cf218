"""A worker's Prometheus metrics, and the observer its job code reports to.

The job code calls a handful of methods (:meth:`WorkerMetrics.job_started`,
:meth:`~WorkerMetrics.tokens`, :meth:`~WorkerMetrics.job_finished`,
:meth:`~WorkerMetrics.job_requeued`, ...) and never touches a metric itself, so what each metric
counts is decided here only. The happenings the whole fleet should see (host fallbacks, replays,
refusals, its own requeues, Redis faults) also go to the fleet's event stream from here, through
:attr:`WorkerMetrics.fleet` (``shared.fleet_events``), once the worker has set it.
Speculation counters are named like vLLM's and llama-server's (``spec_decode_num_drafts`` ...)
under the ``specfleet:`` prefix, so their dashboards carry over; every counter is advanced
from a finished generation's :class:`Telemetry` and nothing else, so summed over the same
runs the counters equal the per-job telemetry exactly (a generation interrupted by a shutdown
still did its work and is counted too, as the engine's lifetime telemetry counts it).

The metrics are always collected (a few dict updates per job); they are only *served* when
the worker runs with ``--metrics-port`` (``0`` picks a free port, published as
``WorkerInfo.metrics_port``). docs/telemetry.md lists every metric.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    start_http_server,
)

from shared.fleet_events import FleetReporter
from shared.protocol import CheckpointMode, FitReport, Telemetry
from shared.redis_faults import Fault

PREFIX = "specfleet:"

#: Seconds; the low end is for CPU test models, the high end for long prompts on big ones.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)

#: Every ``outcome`` label value of ``jobs``: what became of one run of a job on this worker.
OUTCOMES = ("finished", "cancelled", "failed", "rejected", "refused", "interrupted")

_BASE = ("worker", "model", "device")
_SPEC = (*_BASE, "method")


@dataclass
class _JobClock:
    """When a running job started and when its last tokens arrived (latency histograms)."""

    started: float
    first_token: float | None = None
    last_token: float | None = None
    gaps: list[float] = field(default_factory=list)


class WorkerMetrics:
    """The Prometheus registry of one worker process (labels: worker, model, device, method)."""

    def __init__(self, worker: str, model: str, device: str, slots: int = 1) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._base = (worker, model, device)
        self._device = device
        self._jobs: dict[str, _JobClock] = {}
        self._lock = threading.Lock()
        self._server: WSGIServer | None = None
        self.port: int | None = None
        #: Where the fleet-wide happenings are reported too (None: nowhere, as in tests that
        #: build metrics alone).
        self.fleet: FleetReporter | None = None

        def counter(name: str, doc: str, labels: tuple[str, ...] = _SPEC) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=self.registry)

        def gauge(name: str, doc: str, labels: tuple[str, ...] = _BASE) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, _SPEC, buckets=buckets, registry=self.registry)

        #: One counter per summed Telemetry field, named and documented where it is declared
        #: (``Summed`` in shared/protocol.py), with its extra label if it has one.
        self.summed = {name: counter(rule.series, rule.doc,
                                     (*_SPEC, rule.label) if rule.label else _SPEC)
                       for name, rule in Telemetry.summed().items()}
        self.jobs = counter("jobs", "Runs of jobs on this worker by outcome",
                            (*_BASE, "outcome"))
        self.requeues = counter("requeues", "Jobs this worker put back at the front of a queue",
                                (*_BASE, "reason"))
        self.redis_faults = counter("redis_faults", "Spells of Redis refusing this worker's "
                                    "commands (down, loading, out of memory, read-only, "
                                    "busy ...) that it waited out or gave up on, by kind",
                                    (*_BASE, "kind"))
        self.redis_fault_seconds = counter("redis_fault_seconds", "Seconds this worker's "
                                           "operations waited on a refusing Redis, by kind",
                                           (*_BASE, "kind"))
        self.device_fallbacks = counter(
            "checkpoint_device_host_fallbacks", "Slots whose device checkpoint share on one "
            "device of the worker moved to the host, by that device (over a group: each device "
            "holding recurrent layers)", (*_SPEC, "checkpoint_device"))
        self.checkpoint_mode = gauge("checkpoint_mode",
                                     "1 for the checkpoint storage in force, 0 for the other",
                                     (*_BASE, "mode"))
        self.fitted_ctx = gauge("fitted_context_tokens", "Context size the worker serves")
        self.reservation = gauge("checkpoint_reservation_bytes",
                                 "Checkpoint memory reserved, by where it lives",
                                 (*_BASE, "location"))
        self.slots = gauge("slots", "Generation slots of this worker")
        self.busy = gauge("busy_slots", "Slots running a job")
        self.ttft = histogram("time_to_first_token_seconds",
                              "From the worker starting a job to its first generated token",
                              TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds",
                             "Between successive token deliveries of a job (one delivery can "
                             "carry several tokens: a verify commits its accepted drafts too)",
                             ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds",
                             "From the worker starting a job to its last token", E2E_BUCKETS)
        self.slots.labels(*self._base).set(slots)
        self.busy.labels(*self._base).set(0)
        for outcome in OUTCOMES:
            self.jobs.labels(*self._base, outcome)

    # -- the worker's capacity ------------------------------------------------------------
    def worker_loaded(self, n_ctx: int, fit: FitReport | None, method: str,
                      configured: CheckpointMode) -> None:
        """What start-up decided: fitted context, checkpoint storage and its reservation.

        A device reservation that fell back to the host (``configured`` device, reserved
        host) happened before any job, so no job's telemetry carries it: it is counted here,
        once per slot, with the failure's kind the fit report names (``reserve`` when it
        names none)."""
        self.fitted_ctx.labels(*self._base).set(n_ctx)
        if fit is not None:
            self.slots.labels(*self._base).set(fit.slots)
        details = fit.details if fit else {}
        mode = details.get("checkpoint_mode")
        if mode is None:
            return
        self._set_checkpoint(str(mode), details.get("checkpoint_reserved_bytes"))
        if configured is CheckpointMode.DEVICE and mode == CheckpointMode.HOST:
            reason = str(details.get("checkpoint_fallback") or "reserve")
            count = fit.slots if fit else 1
            self.summed["host_fallbacks"].labels(*self._base, method, reason).inc(count)
            devices = details.get("checkpoint_fallback_devices")
            self._fell_back((*self._base, method), devices, count)
            self._report("worker.host_fallback", phase="reserve", reason=reason, count=count,
                         devices=devices)

    def _fell_back(self, spec: tuple[str, ...], devices: object, count: int) -> None:
        """``count`` slots' device checkpoints moved to the host from each of ``devices``."""
        for device in devices if isinstance(devices, list) else ():
            self.device_fallbacks.labels(*spec, str(device)).inc(count)

    def _set_checkpoint(self, mode: str, reserved: object) -> None:
        """The storage in force, and its reservation where it lives (device or ``host``)."""
        for m in CheckpointMode:
            self.checkpoint_mode.labels(*self._base, m.value).set(1 if m.value == mode else 0)
        if isinstance(reserved, int):
            here = self._device if mode == CheckpointMode.DEVICE else "host"
            for where in {self._device, "host"}:
                self.reservation.labels(*self._base, where).set(reserved if where == here else 0)

    # -- the job code's calls -------------------------------------------------------------
    def job_started(self, job_id: str) -> None:
        with self._lock:
            self._jobs[job_id] = _JobClock(time.monotonic())
            self.busy.labels(*self._base).set(len(self._jobs))

    def tokens(self, job_id: str, count: int) -> None:
        """``count`` tokens of ``job_id`` were just committed (one engine delivery)."""
        if count <= 0:
            return
        now = time.monotonic()
        with self._lock:
            clock = self._jobs.get(job_id)
            if clock is None:
                return
            if clock.first_token is None:
                clock.first_token = now
            else:
                clock.gaps.append(now - (clock.last_token or now))
            clock.last_token = now

    def job_finished(self, job_id: str, telemetry: Telemetry | None, outcome: str,
                     reason: str | None = None) -> None:
        """A run of ``job_id`` ended with ``outcome`` (one of :data:`OUTCOMES`); ``telemetry``
        is its generation's, None when nothing was generated (rejected, failed); ``reason``:
        a rejection's (``Rejection``)."""
        with self._lock:
            clock = self._jobs.pop(job_id, None)
            self.busy.labels(*self._base).set(len(self._jobs))
        self.jobs.labels(*self._base, outcome).inc()
        if outcome == "rejected":
            self._report("worker.refusal", job_id=job_id, outcome=outcome, reason=reason)
        if telemetry is None:
            return
        spec = (*self._base, telemetry.spec_method)
        self._count(spec, telemetry)
        if telemetry.replay_events:
            self._report("worker.replays", "info", job_id=job_id,
                         replay_events=telemetry.replay_events,
                         replay_tokens=telemetry.replay_tokens)
        if telemetry.host_fallbacks:
            self._fell_back(spec, telemetry.host_fallback_devices, telemetry.host_fallbacks)
            self._report("worker.host_fallback", job_id=job_id, phase="generation",
                         reason=telemetry.host_fallback_reason, count=telemetry.host_fallbacks,
                         devices=telemetry.host_fallback_devices)
        if clock is not None and clock.first_token is not None:
            self.ttft.labels(*spec).observe(clock.first_token - clock.started)
            self.e2e.labels(*spec).observe((clock.last_token or clock.first_token)
                                           - clock.started)
            for gap in clock.gaps:
                self.itl.labels(*spec).observe(gap)

    def _count(self, spec: tuple[str, ...], t: Telemetry) -> None:
        for name, rule in Telemetry.summed().items():
            metric, value = self.summed[name], getattr(t, name)
            if isinstance(value, list):
                for pos, n in enumerate(value):
                    metric.labels(*spec, str(pos)).inc(n)
            elif rule.label_field is not None:
                if value:
                    metric.labels(*spec, getattr(t, rule.label_field) or "unknown").inc(value)
            else:
                metric.labels(*spec).inc(value)
        if t.checkpoint_mode is not None:
            self._set_checkpoint(t.checkpoint_mode, t.checkpoint_reservation_bytes)

    def job_refused(self, job_id: str | None = None, reason: str | None = None) -> None:
        """A queue entry this worker will not run (foreign function, not JSON)."""
        self.jobs.labels(*self._base, "refused").inc()
        self._report("worker.refusal", "error", job_id=job_id, outcome="refused",
                     reason=reason)

    def job_requeued(self, reason: str, count: int = 1, job_id: str | None = None) -> None:
        """This worker put ``count`` jobs back at the front of their queues (``shutdown``: its
        own; ``lost``: a dead worker's, found by its recovery sweep, whose ``worker.lost``
        record already lists them on the fleet's stream)."""
        if count:
            self.requeues.labels(*self._base, reason).inc(count)
            if reason != "lost":
                self._report("worker.requeued", reason=reason, count=count, job_id=job_id)

    # -- Redis faults (shared.redis_faults: this worker listens while it runs) -------------
    def redis_fault(self, kind: Fault, operation: str) -> None:
        self.redis_faults.labels(*self._base, str(kind)).inc()

    def redis_fault_over(self, kind: Fault, operation: str, seconds: float) -> None:
        self.redis_fault_seconds.labels(*self._base, str(kind)).inc(seconds)
        self._report("worker.redis_fault", fault=str(kind), operation=operation,
                     seconds=round(seconds, 3))

    def _report(self, event: str, level: str = "warning", **fields: object) -> None:
        if self.fleet is not None:
            self.fleet.report(event, level, **fields)

    # -- serving --------------------------------------------------------------------------
    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serve ``/metrics`` on ``port`` (0: a free one) from a daemon thread; returns the
        bound port. The ``*_created`` timestamp series are left out: nothing reads them."""
        disable_created_metrics()
        try:
            server, _ = start_http_server(port, addr=addr, registry=self.registry)
        except OSError as exc:  # a taken port is the operator's to fix: one clear line
            raise RuntimeError(f"cannot serve metrics on {addr}:{port}: "
                               f"{exc.strerror or exc}") from exc
        self._server = server
        self.port = int(server.server_port)
        return self.port

    def close(self) -> None:
        """Stop serving (the worker is leaving)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def start_worker_metrics(worker: str, model: str, device: str, port: int | None,
                         slots: int = 1) -> WorkerMetrics:
    """The worker's metrics, served on ``port`` unless it is None (``--metrics-port``)."""
    metrics = WorkerMetrics(worker, model, device, slots)
    if port is not None:
        metrics.serve(port)
    return metrics
