"""The resident-model worker process: one per device, the engine loaded once.

Start-up (``startup.py``) pins the device, fits the context and loads the engine; then this
module wires the process: metrics, the fleet registration and its heartbeat, rq's record of
the worker (``rq_presence.py``), recovery of whatever a previous process under its name left
in its in-flight list, and the signals; the serving loop itself is ``loop.py``.

SIGTERM: finish the current job, deregister, exit 0. A second SIGTERM/SIGINT: stop the current
generation at its next decode step, requeue it at the front (the next attempt runs on another
worker), deregister, exit 0. SIGUSR1: write every thread's stack to stderr and serve on (where
a worker that does not stop, or does not answer, is waiting).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import socket
import time

from redis import Redis
from rq.queue import Queue
from rq.serializers import JSONSerializer

from shared import redis_faults
from shared.cancel import request_cancel
from shared.fleet_events import FleetReporter
from shared.logs import get_logger
from shared.outage import RedisOutage
from shared.protocol import WorkerCapacity, WorkerInfo
from shared.recovery import RecoveryMonitor, hand_back
from shared.redis_client import connect
from shared.registry import FleetRegistry
from shared.settings import Settings
from shared.starting import StartingRecord
from shared.version import package_version
from worker.engine.engine import SpeculativeEngine
from worker.engine.prompt import choose_template, reads_names
from worker.launch import DeviceGroup, DeviceRef, WorkerOptions
from worker.llm.placement import placed
from worker.service.cancel import CancelWatch
from worker.service.heartbeat import Heartbeat
from worker.service.intake import JobIntake
from worker.service.jobs import WorkerRuntime
from worker.service.loop import ServingLoop
from worker.service.metrics import start_worker_metrics
from worker.service.prefix_presence import PrefixPresence
from worker.service.rq_presence import (
    ContextTiers,
    RqPresence,
    check_devices_free,
    check_name_free,
)
from worker.service.startup import LoadedWorker, load_engine
from worker.threads import current_wait

log = get_logger("worker")


def loaded_capacity(engine: SpeculativeEngine) -> WorkerCapacity:
    """What this worker's engine was loaded with, published for admission at submit."""
    return engine.plan.capacity()


def serve(options: WorkerOptions, settings: Settings, device: DeviceRef | DeviceGroup,
          n_gpu_layers: int) -> None:
    """Run a worker until SIGTERM: load, register, recover, work, deregister. ``device`` was
    pinned before this module was imported (:func:`worker.launch.pin_device`, which gave
    ``n_gpu_layers``)."""
    connection = connect(settings.redis_url)
    connection.ping()
    keys = settings.keys
    name = options.name or f"{socket.gethostname()}-{device.name}-{os.getpid()}"
    registry = FleetRegistry(connection, keys, settings.worker_ttl_seconds)
    check_name_free(registry, name)
    # Before the placement: it connects to the group's RPC servers, which serve one client.
    check_devices_free(registry, device.name, name)
    group = device if isinstance(device, DeviceGroup) else DeviceGroup.of(device)
    # The fit measures, and the engine then loads, on the same placement.
    with placed(group):
        # Loading takes seconds to minutes: meanwhile requests for the model wait for it.
        with StartingRecord(connection, keys, options.model_name, name,
                            settings.worker_ttl_seconds, settings.heartbeat_seconds):
            loaded = load_engine(options, n_gpu_layers, settings)
        try:
            _serve_loaded(options, settings, connection, registry, name, device.name, loaded)
        finally:
            loaded.close()


def _serve_loaded(options: WorkerOptions, settings: Settings, connection: Redis,
                  registry: FleetRegistry, name: str, device: str,
                  loaded: LoadedWorker) -> None:
    keys = settings.keys
    engine, fit, embedder = loaded.engine, loaded.fit, loaded.embedder
    metrics = start_worker_metrics(name, options.model_name, device, options.metrics_port)
    metrics.fleet = FleetReporter(connection, keys, name, options.model_name)
    stop_listening = redis_faults.listen(metrics)
    runtime = WorkerRuntime(engine=engine, connection=connection, settings=settings,
                            worker_name=name, model_name=options.model_name,
                            n_ctx=engine.config.n_ctx, cancels=CancelWatch(connection, keys),
                            capacity=loaded_capacity(engine), metrics=metrics,
                            embedder=embedder)
    template = choose_template(engine.model, settings.chat_template)
    info = WorkerInfo(
        name=name, model_name=options.model_name, model_path=options.model_path,
        device=device, n_ctx=runtime.n_ctx, slots=engine.config.slots, version=package_version(),
        pid=os.getpid(), host=socket.gethostname(), started_at=time.time(),
        heartbeat_at=time.time(), spec_methods=[str(engine.method)], fit=fit,
        capacity=runtime.capacity,
        chat_template=True, n_vocab=engine.model.n_vocab,
        chat_template_source=template.source, chat_template_names=reads_names(template.text),
        threads=options.threads, thread_wait=current_wait(),
        metrics_port=metrics.port, prefix_cache=engine.config.prefix_cache,
        deterministic=engine.config.deterministic,
        embedding_tokens=embedder.max_tokens if embedder is not None else None)
    metrics.worker_loaded(runtime.n_ctx, fit, str(engine.method), options.checkpoint)
    monitor = RecoveryMonitor(connection, registry, settings, sweeper=name)
    tiers = ContextTiers(connection, keys, options.model_name, runtime.n_ctx, name)
    queues = [Queue(q, connection=connection, serializer=JSONSerializer,
                    default_timeout=settings.job_timeout_seconds) for q in tiers.queues()]
    prefixes = PrefixPresence(connection, keys, options.model_name, name,
                              settings.worker_ttl_seconds, engine.config.prefix_cache)
    loop = ServingLoop(runtime, JobIntake(connection, keys, name, options.model_name,
                                          tiers.queues(), runtime.n_ctx), prefixes)
    presence = RqPresence.start(
        connection, runtime.rq_name, queues, on_shutdown=loop.stopping.set,
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
        prefixes.refresh()
        loop.intake.listen(tiers.queues())
        metrics.job_requeued("lost", len(monitor.sweep()))

    # The signals first: once registered, a worker is signalled by name (a SIGUSR1 that came
    # before faulthandler's handler killed it: SIGUSR1's default action is to terminate).
    signal.signal(signal.SIGTERM, loop.request_stop)
    signal.signal(signal.SIGINT, loop.request_stop)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    registry.register(current_info())
    # what a previous process under this name left in flight
    metrics.job_requeued("lost", len(monitor.recover(name)))
    log.info("worker.registered", worker=name, model=options.model_name, device=device,
             n_ctx=runtime.n_ctx, spec_method=str(engine.method), queues=[q.name for q in queues])
    heartbeat = Heartbeat(registry, current_info, settings.heartbeat_seconds,
                          on_tick=on_tick, on_lost=on_lost)
    heartbeat.start()
    try:
        loop.run()
    except RedisOutage as exc:
        log.error("worker.redis_gave_up", worker=name, error=str(exc),
                  held=loop.current_jobs)
        raise
    finally:
        heartbeat.stop()
        stop_listening()
        metrics.close()
        runtime.cancels.close()
        try:
            # jobs routed here that it will not run: back to the shared queues, first
            metrics.job_requeued("shutdown", len(hand_back(connection, keys, name)))
            registry.deregister(name)
            presence.stop()
        except Exception as exc:  # Redis gone for good: the TTL and recovery take over
            log.warning("worker.deregister_failed", worker=name, error=repr(exc))
        else:
            log.info("worker.deregistered", worker=name, model=options.model_name)
