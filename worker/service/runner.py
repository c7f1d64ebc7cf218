"""The resident-model worker: one process per device, the engine loaded once, rq without fork.

Start-up order matters: pin the device (``CUDA_VISIBLE_DEVICES``) before llama.cpp loads, fit
the context, load the engine, register in the fleet, recover our own previous life's job, and
only then take work. rq's ``SimpleWorker`` runs jobs in this process (a forking worker would
reload the model per job and break CUDA), with the JSON serializer, and this subclass refuses
every job whose function is not ``JOB_FUNCTION`` or whose payload is not JSON.

SIGTERM: finish the current job, deregister, exit. A second SIGTERM/SIGINT: stop the current
generation at its next decode step, requeue it at the front (the next attempt runs on another
worker), deregister, exit.
"""

from __future__ import annotations

import os
import socket
import time
from importlib.metadata import PackageNotFoundError, version
from types import FrameType

from redis import Redis
from rq.exceptions import DeserializationError
from rq.job import Job
from rq.queue import Queue
from rq.serializers import JSONSerializer
from rq.worker import SimpleWorker, WorkerStatus

from shared.logs import get_logger
from shared.protocol import WorkerInfo
from shared.settings import Settings
from worker.fitter.devices import parse_device
from worker.service.cancel import CancelWatch
from worker.service.jobs import (
    JOB_FUNCTION,
    JobInterrupted,
    RequestRejected,
    WorkerRuntime,
    bind_runtime,
)
from worker.service.recovery import RecoveryMonitor, requeue_front
from worker.service.registry import FleetRegistry, Heartbeat
from worker.service.startup import (
    WorkerOptions,
    load_engine,
    pin_device,
    reexec_if_pinned_too_late,
)

log = get_logger("worker")


def refusal_reason(job: Job) -> str | None:
    """Why this worker will not run ``job``, or None when it is the project's own job."""
    try:
        func_name, args, kwargs = job.func_name, job.args, job.kwargs
    except (DeserializationError, TypeError, ValueError):
        return "payload is not a JSON job (pickled, corrupt or malformed): refused"
    if func_name != JOB_FUNCTION:
        return f"function {func_name!r} is not {JOB_FUNCTION!r}: refused"
    if not isinstance(args, list | tuple) or len(args) != 1 or kwargs:
        return "the job must carry exactly one argument, the request: refused"
    return None


class SpecfleetWorker(SimpleWorker):
    """A non-forking rq worker that runs only ``JOB_FUNCTION`` on a resident engine."""

    def __init__(self, queues: list[Queue], runtime: WorkerRuntime,
                 registry: FleetRegistry, **kwargs: object) -> None:
        super().__init__(queues, name=runtime.worker_name, connection=runtime.connection,
                         serializer=JSONSerializer, **kwargs)  # type: ignore[arg-type]
        self.runtime = runtime
        self.registry = registry
        self.current_job_id: str | None = None

    def execute_job(self, job: Job, queue: Queue) -> None:
        reason = refusal_reason(job)
        if reason is not None:
            log.error("job.refused", job_id=job.id, worker=self.name, queue=queue.name,
                      reason=reason)
            self.handle_job_failure(job, queue, exc_string=reason)
            return
        self.current_job_id = job.id
        self.runtime.lost.clear()
        self.registry.set_current_job(self.name, job.id)
        try:
            super().execute_job(job, queue)
        finally:
            interrupted, self.runtime.interrupted = self.runtime.interrupted, None
            if interrupted == (job.id, "shutdown"):
                requeue_front(self.connection, job.id)
                attempt = int(self.connection.get(self.runtime.keys.attempts(job.id)) or 1)
                log.warning("job.requeued", job_id=job.id, worker=self.name,
                            model=self.runtime.model_name, attempt=attempt,
                            next_attempt=attempt + 1, reason="shutdown")
            self.registry.set_current_job(self.name, None)
            self.current_job_id = None

    def handle_job_failure(self, job: Job, queue: Queue, started_job_registry: object = None,
                           exc_string: str = "") -> None:
        """An interrupted generation is not a failed job (it runs again, here or elsewhere):
        only end this worker's execution of it, leaving the job's state to its next run."""
        interrupted = self.runtime.interrupted
        if interrupted is not None and interrupted[0] == job.id:
            with self.connection.pipeline() as pipe:
                self.cleanup_execution(job, pipeline=pipe)
                pipe.execute()
            return
        super().handle_job_failure(job, queue, started_job_registry, exc_string)

    def handle_exception(self, job: Job, *exc_info: object) -> None:
        """Expected outcomes (a refused request, a shutdown) are already logged as events."""
        if isinstance(exc_info[1], RequestRejected | JobInterrupted):
            return
        super().handle_exception(job, *exc_info)

    def request_force_stop(self, signum: int, frame: FrameType | None) -> None:
        """Second signal: interrupt the running generation (it is requeued), then exit."""
        if self.get_state() != WorkerStatus.BUSY:
            return super().request_force_stop(signum, frame)
        log.warning("worker.interrupting", worker=self.name, job_id=self.current_job_id)
        self.runtime.interrupt.set()


def _package_version() -> str:
    try:
        return version("specfleet")
    except PackageNotFoundError:
        return "unknown"


def serve(options: WorkerOptions, settings: Settings) -> None:
    """Run a worker until SIGTERM: pin, load, register, recover, work, deregister."""
    device = parse_device(options.device)
    reexec_if_pinned_too_late(device)
    n_gpu_layers = pin_device(device)
    connection = Redis.from_url(settings.redis_url)
    connection.ping()
    keys = settings.keys
    name = options.name or f"{socket.gethostname()}-{device.name}-{os.getpid()}"
    registry = FleetRegistry(connection, keys, settings.worker_ttl_seconds)
    if registry.is_alive(name):
        raise RuntimeError(f"a live worker is already registered as {name!r}")
    engine, fit = load_engine(options, n_gpu_layers, settings)
    runtime = WorkerRuntime(engine=engine, connection=connection, settings=settings,
                            worker_name=name, model_name=options.model_name,
                            n_ctx=engine.config.n_ctx, cancels=CancelWatch(connection, keys))
    bind_runtime(runtime)
    info = WorkerInfo(
        name=name, model_name=options.model_name, model_path=options.model_path,
        device=device.name, n_ctx=runtime.n_ctx, slots=1, version=_package_version(),
        pid=os.getpid(), host=socket.gethostname(), started_at=time.time(),
        heartbeat_at=time.time(), spec_methods=[str(engine.method)], fit=fit)
    monitor = RecoveryMonitor(connection, keys, registry, settings.stream_maxlen,
                              settings.stream_ttl_seconds)
    monitor.recover_leftover(name)
    _forget_stale_rq_worker(connection, name)
    queues = [Queue(q, connection=connection, serializer=JSONSerializer,
                    default_timeout=settings.job_timeout_seconds)
              for q in keys.queues(options.model_name)]
    worker = SpecfleetWorker(queues, runtime, registry,
                             default_result_ttl=settings.result_ttl_seconds)

    def current_info() -> WorkerInfo:
        info.current_job = worker.current_job_id
        return info

    def on_lost() -> None:
        log.error("worker.declared_lost", worker=name, job_id=worker.current_job_id)
        runtime.lost.set()

    registry.register(current_info())
    log.info("worker.registered", worker=name, model=options.model_name, device=device.name,
             n_ctx=runtime.n_ctx, spec_method=str(engine.method), queues=[q.name for q in queues])
    heartbeat = Heartbeat(registry, current_info, settings.heartbeat_seconds,
                          on_tick=monitor.sweep, on_lost=on_lost)
    heartbeat.start()
    try:
        worker.work(logging_level="WARNING")
    finally:
        heartbeat.stop()
        runtime.cancels.close()
        registry.deregister(name)
        bind_runtime(None)
        engine.close()
        log.info("worker.deregistered", worker=name, model=options.model_name)


def _forget_stale_rq_worker(connection: Redis, name: str) -> None:
    """rq refuses a name whose previous process died without saying so; that process is gone."""
    stale = SimpleWorker.find_by_key(f"rq:worker:{name}", connection=connection,
                                     serializer=JSONSerializer)
    if stale is not None:
        stale.register_death()
