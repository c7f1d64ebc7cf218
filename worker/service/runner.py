"""The resident-model worker: one process per device, the engine loaded once, its own loop.

Start-up (``startup.py``) pins the device, fits the context and loads the engine; then the
worker registers in the fleet, requeues whatever a previous process under its name left in
its in-flight list, and serves. The loop is specfleet's own, not rq's ``Worker.work``: it
takes each job atomically into the worker's in-flight list (``intake.py``), refuses and
quarantines entries it cannot run, and keeps rq's job records and registries (``rq_state.py``)
so rq's tools still tell the truth. Every Redis call of the loop rides out an outage up to
``SPECFLEET_REDIS_OUTAGE_SECONDS``; past that the worker exits non-zero, leaving its jobs in
its in-flight list for recovery.

SIGTERM: finish the current job, deregister, exit 0. A second SIGTERM/SIGINT: stop the current
generation at its next decode step, requeue it at the front (the next attempt runs on another
worker), deregister, exit 0.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from importlib.metadata import PackageNotFoundError, version
from types import FrameType
from typing import TypeVar

from redis import Redis
from redis.client import Pipeline
from rq.command import parse_payload
from rq.executions import Execution
from rq.job import Job
from rq.queue import Queue
from rq.serializers import JSONSerializer
from rq.worker import SimpleWorker, WorkerStatus

from shared.cancel import request_cancel
from shared.keys import Keys
from shared.logs import get_logger
from shared.outage import RedisOutage, ride_out
from shared.protocol import FitReport, WorkerCapacity, WorkerInfo
from shared.recovery import RecoveryMonitor, requeue_front
from shared.redis_client import connect
from shared.registry import FleetRegistry
from shared.replies import text
from shared.settings import Settings
from worker.engine.engine import SpeculativeEngine
from worker.engine.prompt import chat_template
from worker.engine.slot import GenerationResult, Slot
from worker.fitter.devices import parse_device
from worker.service.cancel import CancelWatch
from worker.service.heartbeat import Heartbeat
from worker.service.intake import JobIntake, Taken
from worker.service.jobs import (
    Interruption,
    JobInterrupted,
    JobRun,
    RequestRejected,
    WorkerRuntime,
    refuse,
)
from worker.service.metrics import start_worker_metrics
from worker.service.rq_state import (
    PoisonedJob,
    end_execution,
    is_waiting,
    load_job,
    mark_failed,
    mark_finished,
    mark_started,
)
from worker.service.startup import (
    WorkerOptions,
    load_engine,
    pin_device,
    reexec_if_pinned_too_late,
)

log = get_logger("worker")

T = TypeVar("T")


@dataclass
class _Running:
    """A job in one of the engine's slots: rq's records of its run, and the run itself."""

    job: Job
    execution: Execution
    run: JobRun
    slot: Slot


class ServingLoop:
    """Feeds the engine's slots from the worker's queues and steps them all together.

    Each pass takes jobs while a slot is free (blocking only when the worker is idle), opens
    a :class:`JobRun` for each and admits it to the engine, then runs ONE engine step for
    every active slot and hands each slot's tokens and result to its run. A finished slot is
    refilled at the next pass (continuous batching). A poisoned entry, a rejected request or
    a failing job never stops the others.
    """

    def __init__(self, runtime: WorkerRuntime, intake: JobIntake) -> None:
        self.runtime = runtime
        self.intake = intake
        #: rq's record of this worker, marked busy or idle (set once it is started).
        self.presence: SimpleWorker | None = None
        self.stopping = threading.Event()
        self._running: dict[int, _Running] = {}

    @property
    def current_jobs(self) -> list[str]:
        """The jobs in the engine's slots right now, in slot order."""
        return [r.job.id for _, r in sorted(self._running.items())]

    def run(self) -> None:
        """Serve until asked to stop and every slot is done; raises :class:`RedisOutage` past
        the outage deadline (the held jobs stay in the in-flight list for recovery)."""
        engine = self.runtime.engine
        while not (self.stopping.is_set() and not self._running):
            while (engine.free_slots and not self.stopping.is_set()
                   and not self.runtime.lost.is_set()):
                taken = self._ride(lambda: self.intake.take(block=not self._running),
                                   "intake.take")
                if taken is None:
                    break
                self._start(taken)
            if self._running:
                self._step()
            elif self.runtime.lost.is_set():
                self.runtime.lost.clear()  # every stale run has stood down

    def request_stop(self, signum: int, frame: FrameType | None) -> None:
        """SIGTERM/SIGINT: the first finishes the running jobs; a second interrupts them."""
        if self.stopping.is_set() and self._running:
            log.warning("worker.interrupting", worker=self.runtime.worker_name,
                        jobs=self.current_jobs)
            self.runtime.interrupt.set()
            return
        log.info("worker.stopping", worker=self.runtime.worker_name, signal=signum,
                 jobs=self.current_jobs)
        self.stopping.set()

    # -- a job enters a slot ---------------------------------------------------------------
    def _start(self, taken: Taken) -> None:
        rt = self.runtime
        conn = rt.connection
        try:
            job, request = self._ride(lambda: load_job(conn, taken.job_id), "job.load")
        except PoisonedJob as exc:
            self._refuse(taken, exc)
            return
        if not self._ride(lambda: is_waiting(job), "job.status"):
            log.info("job.skipped", job_id=job.id, worker=rt.worker_name,
                     status=str(job.get_status(refresh=False)))
            self._ride(lambda: self.intake.release(job.id), "intake.release")
            return
        ttl = int(job.timeout or rt.settings.job_timeout_seconds) + 60
        execution = self._ride(lambda: mark_started(conn, job, rt.worker_name, ttl),
                               "job.start")
        self._set_state(WorkerStatus.BUSY)
        run: JobRun | None = None
        try:
            run = JobRun.open(rt, job.id, request)
            try:
                slot = rt.engine.admit(run.slot_request())
            except ValueError as exc:
                run.reject(str(exc))
        except RedisOutage:
            raise
        except Exception as exc:  # rejected (already on its stream) or failed to start
            if run is not None and not isinstance(exc, RequestRejected):
                run.fail(exc)
            self._end(job, partial(mark_failed, job=job, execution=execution, error=exc,
                                   worker_name=rt.worker_name))
            if run is not None:
                run.close()
            self._log_crash(job.id, exc)
            return
        self._running[slot.seq] = _Running(job, execution, run, slot)

    # -- one engine step for every slot ----------------------------------------------------
    def _step(self) -> None:
        rt = self.runtime
        for r in self._running.values():
            if r.run.should_stop():
                rt.engine.cancel(r.slot)
        if rt.settings.step_delay_seconds:
            time.sleep(rt.settings.step_delay_seconds)  # test/drill only: a slower worker
        try:
            updates = rt.engine.step()
        except Exception as exc:  # the engine dropped every active slot: each job failed
            for r in list(self._running.values()):
                r.run.fail(exc)
                self._close(r, partial(mark_failed, job=r.job, execution=r.execution,
                                       error=exc, worker_name=rt.worker_name))
            self._log_crash(None, exc)
            return
        for update in updates:
            r = self._running[update.slot.seq]
            if update.verified:
                r.run.tokens(update.tokens, update.text, update.logprobs)
            if update.result is not None:
                self._complete(r, update.result)

    def _complete(self, r: _Running, result: GenerationResult) -> None:
        rt = self.runtime
        try:
            final = r.run.finish(result)
        except JobInterrupted as exc:
            shutdown = exc.reason is Interruption.SHUTDOWN
            self._close(r, lambda pipe: end_execution(pipe, r.job, r.execution),
                        release=shutdown)
            if shutdown:
                self._requeue(r.job.id)
            return
        self._close(r, lambda pipe: mark_finished(pipe, r.job, r.execution, final,
                                                  rt.settings.result_ttl_seconds,
                                                  rt.worker_name))

    def _close(self, r: _Running, record: Callable[[Pipeline], None],
               release: bool = True) -> None:
        """A slot's run is over: its outcome into rq's records, the slot and flag freed."""
        self._end(r.job, record, release)
        r.run.close()
        del self._running[r.slot.seq]
        if not self._running:
            self._set_state(WorkerStatus.IDLE)

    def _log_crash(self, job_id: str | None, exc: BaseException) -> None:
        if not isinstance(exc, RequestRejected):
            log.error("job.crashed", job_id=job_id, worker=self.runtime.worker_name,
                      exc_info=exc)

    def _refuse(self, taken: Taken, exc: PoisonedJob) -> None:
        """A poisoned or foreign entry: a final event on its stream, rq's failed record when
        its hash is readable, and the id moved to the quarantine list. The worker serves on."""
        rt = self.runtime
        reason = f"{exc}: refused"
        log.error("job.refused", job_id=taken.job_id, worker=rt.worker_name,
                  queue=taken.queue_key, reason=reason)
        rt.metrics.job_refused()
        self._ride(lambda: refuse(rt, taken.job_id, reason), "job.refuse")
        if exc.job is not None:
            poisoned = exc.job

            def record() -> None:
                with rt.connection.pipeline() as pipe:
                    mark_failed(pipe, poisoned, None, reason, rt.worker_name)
                    pipe.execute()
            try:
                self._ride(record, "job.refuse")
            except RedisOutage:
                raise
            except Exception as err:  # the hash is too broken even to be marked failed
                log.warning("job.refused_unrecorded", job_id=taken.job_id, error=repr(err))
        self._ride(lambda: self.intake.quarantine(taken.job_id, reason), "intake.quarantine")

    def _end(self, job: Job, record: Callable[[Pipeline], None], release: bool = True) -> None:
        """Write a run's outcome in rq's records and leave the in-flight list, atomically."""
        def write() -> None:
            with self.runtime.connection.pipeline() as pipe:
                record(pipe)
                if release:
                    pipe.lrem(self.intake.inflight_key, 1, job.id)
                pipe.execute()
        self._ride(write, "job.end")

    def _requeue(self, job_id: str) -> None:
        rt = self.runtime
        self._ride(lambda: requeue_front(rt.connection, rt.keys, job_id), "job.requeue")
        attempt = int(self._ride(lambda: rt.connection.get(rt.keys.attempts(job_id)),
                                 "job.requeue") or 1)
        log.warning("job.requeued", job_id=job_id, worker=rt.worker_name,
                    model=rt.model_name, attempt=attempt, next_attempt=attempt + 1,
                    reason="shutdown")
        rt.metrics.job_requeued("shutdown")

    def _set_state(self, state: WorkerStatus) -> None:
        presence = self.presence
        if presence is not None:
            self._ride(lambda: presence.set_state(state), "rq.state")

    def _ride(self, operation: Callable[[], T], what: str) -> T:
        return ride_out(operation, self.runtime.settings.redis_outage_seconds, what)


class ContextTiers:
    """The context tiers of a model this worker serves: every tier up to its own per-slot
    context. Registering adds its own to the model's tier set; :meth:`queues` reads the set
    again (each heartbeat), so a tier that appears later is served from then on."""

    def __init__(self, connection: Redis, keys: Keys, model: str, n_ctx: int) -> None:
        self._conn = connection
        self._keys = keys
        self._model = model
        self._n_ctx = n_ctx
        connection.zadd(keys.tiers(model), {str(n_ctx): n_ctx})

    def queues(self) -> list[str]:
        """The queue names to take from, in order (``Keys.queues``)."""
        tiers = [int(text(t)) for t in self._conn.zrangebyscore(self._keys.tiers(self._model),
                                                                0, self._n_ctx)]
        return self._keys.queues(self._model, tiers)


def loaded_capacity(engine: SpeculativeEngine) -> WorkerCapacity:
    """What this worker's engine was loaded with, published for admission at submit."""
    return engine.plan.capacity()


def _package_version() -> str:
    try:
        return version("specfleet")
    except PackageNotFoundError:
        return "unknown"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def check_name_free(registry: FleetRegistry, name: str) -> None:
    """Refuse a name a live worker holds; a dead holder on this host is taken over at once.

    After ``kill -9`` the registration lives on until its TTL: when it names this host and a
    pid that no longer exists, its holder is certainly gone, so the new process proceeds (its
    registration overwrites the old one and it requeues what the old one held)."""
    holder = registry.registration(name)
    if holder is None:
        return
    if holder.host == socket.gethostname() and holder.pid != os.getpid() \
            and not _pid_alive(holder.pid):
        log.warning("worker.takeover", worker=name, previous_pid=holder.pid,
                    previous_job=holder.current_job)
        return
    raise RuntimeError(f"a live worker is already registered as {name!r} "
                       f"(pid {holder.pid} on {holder.host})")


def serve(options: WorkerOptions, settings: Settings) -> None:
    """Run a worker until SIGTERM: pin, load, register, recover, work, deregister."""
    device = parse_device(options.device)
    reexec_if_pinned_too_late(device)
    n_gpu_layers = pin_device(device)
    connection = connect(settings.redis_url)
    connection.ping()
    keys = settings.keys
    name = options.name or f"{socket.gethostname()}-{device.name}-{os.getpid()}"
    registry = FleetRegistry(connection, keys, settings.worker_ttl_seconds)
    check_name_free(registry, name)
    engine, fit = load_engine(options, n_gpu_layers, settings)
    try:
        _serve_loaded(options, settings, connection, registry, name, device.name, engine, fit)
    finally:
        engine.close()


def _serve_loaded(options: WorkerOptions, settings: Settings, connection: Redis,
                  registry: FleetRegistry, name: str, device: str, engine: SpeculativeEngine,
                  fit: FitReport | None) -> None:
    keys = settings.keys
    metrics = start_worker_metrics(name, options.model_name, device, options.metrics_port)
    runtime = WorkerRuntime(engine=engine, connection=connection, settings=settings,
                            worker_name=name, model_name=options.model_name,
                            n_ctx=engine.config.n_ctx, cancels=CancelWatch(connection, keys),
                            capacity=loaded_capacity(engine), metrics=metrics)
    info = WorkerInfo(
        name=name, model_name=options.model_name, model_path=options.model_path,
        device=device, n_ctx=runtime.n_ctx, slots=engine.config.slots, version=_package_version(),
        pid=os.getpid(), host=socket.gethostname(), started_at=time.time(),
        heartbeat_at=time.time(), spec_methods=[str(engine.method)], fit=fit,
        capacity=runtime.capacity,
        chat_template=chat_template(engine.model, settings.chat_template) is not None,
        metrics_port=metrics.port)
    metrics.worker_loaded(runtime.n_ctx, fit, str(engine.method), options.checkpoint)
    monitor = RecoveryMonitor(connection, registry, settings)
    tiers = ContextTiers(connection, keys, options.model_name, runtime.n_ctx)
    queues = [Queue(q, connection=connection, serializer=JSONSerializer,
                    default_timeout=settings.job_timeout_seconds) for q in tiers.queues()]
    loop = ServingLoop(runtime, JobIntake(connection, keys, name, options.model_name,
                                          tiers.queues()))
    presence = RqPresence.start(
        connection, name, queues, on_shutdown=loop.stopping.set,
        on_stop_job=lambda job_id: request_cancel(connection, keys, job_id,
                                                  settings.stream_ttl_seconds))
    loop.presence = presence

    def current_info() -> WorkerInfo:
        jobs = loop.current_jobs
        info.current_job = jobs[0] if jobs else None
        info.current_jobs = jobs
        info.telemetry = engine.telemetry()
        return info

    def on_lost() -> None:
        log.error("worker.declared_lost", worker=name, jobs=loop.current_jobs)
        runtime.lost.set()

    def on_tick() -> None:
        presence.heartbeat()
        loop.intake.listen(tiers.queues())
        metrics.job_requeued("lost", len(monitor.sweep()))

    registry.register(current_info())
    # what a previous process under this name left in flight
    metrics.job_requeued("lost", len(monitor.recover(name)))
    log.info("worker.registered", worker=name, model=options.model_name, device=device,
             n_ctx=runtime.n_ctx, spec_method=str(engine.method), queues=[q.name for q in queues])
    heartbeat = Heartbeat(registry, current_info, settings.heartbeat_seconds,
                          on_tick=on_tick, on_lost=on_lost)
    heartbeat.start()
    signal.signal(signal.SIGTERM, loop.request_stop)
    signal.signal(signal.SIGINT, loop.request_stop)
    try:
        loop.run()
    except RedisOutage as exc:
        log.error("worker.redis_gave_up", worker=name, error=str(exc),
                  held=loop.current_jobs)
        raise
    finally:
        heartbeat.stop()
        metrics.close()
        runtime.cancels.close()
        try:
            registry.deregister(name)
            presence.stop()
        except Exception as exc:  # Redis gone for good: the TTL and recovery take over
            log.warning("worker.deregister_failed", worker=name, error=repr(exc))
        else:
            log.info("worker.deregistered", worker=name, model=options.model_name)


class RqPresence(SimpleWorker):
    """rq's record of this worker (``rq info`` lists it, busy or idle) and its command
    channel, so rq's own tools still reach it: ``shutdown`` stops the loop gracefully (as a
    first SIGTERM) and ``stop-job`` cancels that job. rq never runs a job here."""

    def __init__(self, queues: list[Queue], name: str, connection: Redis,
                 on_shutdown: Callable[[], None], on_stop_job: Callable[[str], None]) -> None:
        super().__init__(queues, name=name, connection=connection, serializer=JSONSerializer)
        self._on_shutdown = on_shutdown
        self._on_stop_job = on_stop_job

    def handle_payload(self, message: dict[str, object]) -> None:
        payload = parse_payload(message)
        command = payload.get("command")
        log.info("worker.rq_command", worker=self.name, command=command,
                 job_id=payload.get("job_id"))
        if command == "shutdown":
            self._on_shutdown()
        elif command == "stop-job" and payload.get("job_id"):
            self._on_stop_job(str(payload["job_id"]))

    @classmethod
    def start(cls, connection: Redis, name: str, queues: list[Queue],
              on_shutdown: Callable[[], None],
              on_stop_job: Callable[[str], None]) -> RqPresence:
        """Register with rq (retiring a record a previous process under this name left) and
        listen on rq's command channel."""
        stale = SimpleWorker.find_by_key(f"rq:worker:{name}", connection=connection,
                                         serializer=JSONSerializer)
        if stale is not None:
            stale.register_death()
        presence = cls(queues, name, connection, on_shutdown, on_stop_job)
        presence.register_birth()
        presence.set_state(WorkerStatus.IDLE)
        presence.subscribe()
        return presence

    def stop(self) -> None:
        """Leave rq's registry and its command channel."""
        self.unsubscribe()
        self.register_death()
