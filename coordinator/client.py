"""The coordinator's Python API: submit requests, follow their events, cancel, watch the fleet.

``Coordinator(settings).submit(request)`` validates at the edge (protocol, model, live worker,
context), routes it to the worker holding its prefix when one has room (``routing.py``), and
queues one rq job running ``worker.service.jobs.run_generation`` with the JSON
serializer; the returned ``JobHandle`` streams the job's events transparently across attempts
(a crashed worker's job re-runs elsewhere) and gives the final result.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import structlog
from redis import Redis
from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.job import JobStatus as RqStatus
from rq.queue import Queue
from rq.serializers import JSONSerializer

from coordinator.events import StreamCursor, follow
from coordinator.models import ModelDirectory
from coordinator.routing import choose_holder
from coordinator.validation import (
    SubmitError,
    Task,
    check_admission,
    check_task_admission,
    choose_tier,
    parse_request,
    task_tier,
)
from coordinator.waiting import WaitingRequests, WorkerWait
from shared import doorbell, redis_faults
from shared.cancel import request_cancel
from shared.event_stream import EventWriter
from shared.logs import get_logger
from shared.outage import ride_out
from shared.protocol import (
    EMBEDDING_FUNCTION,
    JOB_FUNCTION,
    TOKENIZER_FUNCTION,
    AnyEvent,
    EmbeddingRequest,
    FinalEvent,
    GenerationRequest,
    JobStatus,
    Priority,
    TokenEvent,
    WorkerInfo,
)
from shared.recovery import RecoveryMonitor
from shared.redis_client import connect
from shared.registry import FleetRegistry
from shared.replies import text
from shared.results import JobResult
from shared.settings import Settings, get_settings

log = get_logger("coordinator")

#: rq states from which a job never runs again: cancelling them would only leave a flag.
_ENDED = frozenset({RqStatus.FINISHED, RqStatus.FAILED, RqStatus.CANCELED, RqStatus.STOPPED})

__all__ = ["Coordinator", "JobHandle", "StreamGapError", "SubmitError"]


class StreamGapError(RuntimeError):
    """Part of a job's event stream was trimmed before it was read, and the rest cannot
    complete the text that was already handed out."""


class JobHandle:
    """One submitted job: its events, its result, its cancellation."""

    def __init__(self, coordinator: Coordinator, job_id: str) -> None:
        self._coordinator = coordinator
        self.job_id = job_id

    def stream(self, timeout: float | None = None,
               cursor: StreamCursor | None = None) -> Iterator[AnyEvent]:
        """Every event from the first, across attempts, ending with the final event."""
        c = self._coordinator
        return follow(c.connection, c.settings.keys, self.job_id, timeout=timeout,
                      outage_seconds=c.settings.redis_outage_seconds, cursor=cursor)

    def text_stream(self, timeout: float | None = None) -> Iterator[str]:
        """The generated text as it arrives, once.

        A re-run after a crash repeats the same tokens, so only text beyond what was already
        yielded is passed on; a token event appended twice (a write retried through a Redis
        outage) is recognised by its ``index`` and skipped. When part of the stream was
        trimmed before it was read (``stream.gap``), the missing text comes from the final
        event, which carries all of it; :class:`StreamGapError` when even that cannot
        complete what was shown.
        """
        shown = ""
        attempt_text: dict[int, str] = {}
        attempt_tokens: dict[int, int] = {}
        newest = 0
        cursor = StreamCursor(self.job_id)
        for event in self.stream(timeout, cursor):
            newest = max(newest, event.attempt)
            if isinstance(event, TokenEvent) and not cursor.gaps:
                if event.index < attempt_tokens.get(event.attempt, 0):
                    continue
                attempt_tokens[event.attempt] = event.index + len(event.tokens)
                text = attempt_text.get(event.attempt, "") + event.text
                attempt_text[event.attempt] = text
                if len(text) > len(shown):
                    yield text[len(shown):]
                    shown = text
            elif isinstance(event, FinalEvent) and event.attempt >= newest:
                if not event.text.startswith(shown):
                    raise StreamGapError(
                        f"job {self.job_id}: events {cursor.gaps} were trimmed from its stream "
                        "before they were read (raise SPECFLEET_STREAM_MAXLEN); the full text "
                        "is in its result")
                if len(event.text) > len(shown):
                    yield event.text[len(shown):]

    def result(self, timeout: float | None = None) -> JobResult:
        """Wait for the final event; raises ``TimeoutError`` after ``timeout`` seconds."""
        final: FinalEvent | None = None
        for event in self.stream(timeout):
            if isinstance(event, FinalEvent):
                final = event
        assert final is not None  # follow() only ends on a final event
        return JobResult.from_final(final)

    def cancel(self) -> None:
        """Stop the job: a queued job is withdrawn, a running one stops within one step."""
        self._coordinator.cancel(self.job_id)


class Coordinator:
    """Submits to and watches one specfleet deployment (one Redis, one key prefix)."""

    def __init__(self, settings: Settings | None = None, connection: Redis | None = None) -> None:
        self.settings = settings or get_settings()
        self.connection = connection or connect(self.settings.redis_url)
        self.keys = self.settings.keys
        self.registry = FleetRegistry(self.connection, self.keys,
                                      self.settings.worker_ttl_seconds)
        #: Whether a model is served, coming, known or unknown (``coordinator/models.py``).
        self.models = ModelDirectory(self.connection, self.keys, self.registry)
        #: What waits for a worker of a coming model (``coordinator/waiting.py``).
        self.waiting = WaitingRequests(self.connection, self.keys)
        self._fleet_seen: dict[str, tuple[float, list[WorkerInfo]]] = {}
        self._tiers_recorded: set[tuple[str, int]] = set()

    def _serving(self, model: str) -> list[WorkerInfo]:
        """Live workers of ``model``; a non-empty answer is reused for one heartbeat interval
        (no staler than the registry itself), so a burst of submits costs no registry reads."""
        now = time.monotonic()
        seen = self._fleet_seen.get(model)
        if seen and now - seen[0] < self.settings.heartbeat_seconds:
            return seen[1]
        workers = self.registry.live_workers(model)
        if workers:
            self._fleet_seen[model] = (now, workers)
        return workers

    def _record_tier(self, model: str, tier: int) -> None:
        """Keep every tier a job may wait on in the model's tier set (workers add their own
        too), so queue depths and the workers that listen by the set always find it; once per
        tier per process."""
        if (model, tier) not in self._tiers_recorded:
            self.connection.zadd(self.keys.tiers(model), {str(tier): tier})
            self._tiers_recorded.add((model, tier))

    def _queue(self, name: str) -> Queue:
        return Queue(name, connection=self.connection, serializer=JSONSerializer,
                     default_timeout=self.settings.job_timeout_seconds)

    def known_models(self) -> set[str]:
        return {m.decode() if isinstance(m, bytes) else m
                for m in self.connection.smembers(self.keys.models())}

    def worker_wait(self, model: str, waiter: str, seconds: float | None = None) -> WorkerWait:
        """A wait for a worker of the coming ``model`` (``coordinator/waiting.py``), up to
        ``seconds`` (``SPECFLEET_WAIT_FOR_WORKER_SECONDS`` unless told)."""
        return WorkerWait(self.models, self.waiting, model, waiter,
                          self.settings.wait_for_worker_seconds if seconds is None else seconds)

    def submit(self, request: GenerationRequest | dict[str, Any],
               job_id: str | None = None, *, wait_seconds: float = 0.0) -> JobHandle:
        """Validate and queue one request; ``SubmitError`` says why it was refused.

        ``job_id`` lets a caller record the job (a batch line) before it can run. A Redis
        that refuses for a while (down, restarting, out of memory, busy ...) is waited out
        for up to ``redis_outage_seconds``, as the stream that follows is; the job is queued
        once even when a retried enqueue's first try had landed. A request for a model that
        is coming (declared, or a worker loading) waits up to ``wait_seconds`` for a live
        worker (the CLI passes ``SPECFLEET_WAIT_FOR_WORKER_SECONDS``); without it, it is
        refused ``coming`` at once, for a caller that waits in its own way (the gateway, the
        batch pump). A declared model's alias is submitted as that model."""
        # The seed is fixed here, before queueing: a re-run of the job samples the same tokens.
        return self._queued(parse_request(request).with_seed(), job_id, wait_seconds)

    def submit_task(self, request: Task, job_id: str | None = None, *,
                    wait_seconds: float = 0.0) -> JobHandle:
        """Validate and queue a task, an embedding or a tokenization
        (``worker/service/tasks.py``), as :meth:`submit` queues a generation: admitted by
        ``check_task_admission`` against the live workers, on the model's smallest context
        tier (every worker of it takes from there). Its final event carries the answer
        (``embeddings``; ``tokens``, ``text`` and ``pieces``)."""
        return self._queued(request, job_id, wait_seconds)

    def _queued(self, req: GenerationRequest | Task, job_id: str | None,
                wait_seconds: float) -> JobHandle:
        """Admit and queue one job: what :meth:`submit` and :meth:`submit_task` share."""
        job_id = job_id or uuid.uuid4().hex
        outage = self.settings.redis_outage_seconds
        req, workers = ride_out(lambda: self._admit(req, job_id, wait_seconds), outage,
                                "submit.admit")
        tried = False

        def enqueue() -> Queue:
            nonlocal tried
            if tried and self.connection.exists(Job.key_for(job_id)):
                return self._queue(Job.fetch(job_id, connection=self.connection,
                                             serializer=JSONSerializer).origin)
            tried = True
            return self._enqueue(req, job_id, workers)
        queue = ride_out(enqueue, outage, "submit.enqueue")
        fields = ({"priority": str(req.priority), "max_tokens": req.max_tokens,
                   "seed": req.sampling.seed} if isinstance(req, GenerationRequest)
                  else {"task": type(req).__name__})
        log.info("job.queued", job_id=job_id, model=req.model, attempt=0, queue=queue.name,
                 **fields)
        return JobHandle(self, job_id)

    def _admit(self, req: GenerationRequest | Task, job_id: str,
               wait_seconds: float) -> tuple[GenerationRequest | Task, list[WorkerInfo]]:
        """The request (a declared alias resolved) and the live workers that may serve it,
        or ``SubmitError``. A coming model is waited for up to ``wait_seconds``. No live
        worker while some of the model's registrations have just lapsed (Redis restarted or
        stalled under them: they re-register within a heartbeat, or recovery removes them
        within a TTL) is waited out for up to two registration TTLs before it is a refusal."""
        waited = 0.0
        wait: WorkerWait | None = None
        try:
            while True:
                workers = self._serving(req.model)
                if not workers and (target := self.models.catalog.resolve(req.model)):
                    req = req.model_copy(update={"model": target})
                    continue
                state = self.models.state(req.model, workers)
                try:
                    if isinstance(req, GenerationRequest):
                        check_admission(req, state, self.models.known,
                                        self.settings.require_live_worker)
                    else:
                        check_task_admission(req, state, self.models.known,
                                             self.settings.require_live_worker)
                except SubmitError as exc:
                    if exc.reason == "coming" and wait_seconds > 0:
                        wait = wait or self.worker_wait(req.model, job_id, wait_seconds)
                        if wait.coming():
                            time.sleep(wait.interval)
                        continue
                    if (exc.reason != "no_worker"
                            or waited >= 2 * self.settings.worker_ttl_seconds
                            or not self.registry.lapsed(req.model)):
                        raise
                    time.sleep(self.settings.heartbeat_seconds)
                    waited += self.settings.heartbeat_seconds
                    continue
                return req, workers
        finally:
            if wait is not None:
                wait.close()

    def _enqueue(self, req: GenerationRequest | Task, job_id: str,
                 workers: list[WorkerInfo]) -> Queue:
        """Queue the job (a generation on its holder's own queue, or the shared one of its
        tier; a task on the model's smallest tier), list the holder and ring the doorbell,
        in one transaction; returns the queue."""
        if isinstance(req, GenerationRequest):
            tier = choose_tier(req, workers)
            route = choose_holder(self.connection, self.keys, req, workers, tier)
            priority, custom_id = req.priority, req.custom_id
        else:  # no prefix to route by; every worker of the model takes from its smallest tier
            tier, route, priority, custom_id = task_tier(workers), None, Priority.NORMAL, None
        if tier is not None:
            self._record_tier(req.model, tier)
        shared = self.keys.queue(req.model, priority, tier)
        meta = {"model": req.model, "custom_id": custom_id}
        if route is not None:  # recovery sends it back there if its holder dies or leaves
            meta["shared_queue"] = shared
        queue = self._queue(shared if route is None
                            else self.keys.own_queue(req.model, route.worker, priority))
        with self.connection.pipeline() as pipe:
            pipe.multi()  # the job, its holder's listing and its ring land together
            # Only what the request set travels: an unset speculative field means "the
            # worker's capacity" (shared/capacity.py), which a filled-in default would override.
            queue.enqueue(_function(req), req.model_dump(mode="json", exclude_unset=True),
                          job_id=job_id,
                          job_timeout=self.settings.job_timeout_seconds,
                          result_ttl=self.settings.result_ttl_seconds,
                          failure_ttl=self.settings.result_ttl_seconds,
                          meta=meta, pipeline=pipe)
            if route is not None:
                pipe.zadd(self.keys.holders(req.model), {route.worker: route.n_ctx})
                pipe.sadd(self.keys.waiting_own_queues(req.model), queue.key)
            doorbell.ring_in(pipe, self.keys, req.model, route.worker if route else None)
            pipe.hincrby(self.keys.routing(req.model), "holder" if route else "shared", 1)
            pipe.execute()
        if route is not None:
            log.info("prefix.routed", job_id=job_id, model=req.model, worker=route.worker,
                     depth_blocks=route.depth_blocks, free_slots=route.free_slots)
        return queue

    def handle(self, job_id: str) -> JobHandle:
        """A handle on a job submitted earlier (by anyone)."""
        return JobHandle(self, job_id)

    def cancel(self, job_id: str) -> bool:
        """Cancel a job; True when it was still waiting and was withdrawn from its queue.

        Raises ``LookupError`` for a job Redis does not know (never submitted, or expired)
        and ``ValueError`` for one that has already ended."""
        try:
            job = Job.fetch(job_id, connection=self.connection, serializer=JSONSerializer)
        except NoSuchJobError:
            raise LookupError(f"no such job: {job_id}") from None
        status = job.get_status(refresh=False)
        if status in _ENDED:
            raise ValueError(f"job {job_id} has already ended ({status.value})")
        request_cancel(self.connection, self.keys, job_id, self.settings.stream_ttl_seconds)
        if not self._queue(job.origin).remove(job_id):
            return False  # running (it sees the flag within one step) or already done
        job.cancel()
        # The final is the attempt that will now never run: one past those that started
        # (a requeued job's last one is superseded, and its final would be refused).
        attempt = int(self.connection.get(self.keys.attempts(job_id)) or 0) + 1
        EventWriter.for_job(self.connection, self.settings, job_id, attempt).final(
            status=JobStatus.CANCELLED, finish_reason="cancelled")
        with structlog.contextvars.bound_contextvars(job_id=job_id, attempt=attempt):
            log.info("job.cancelled", model=(job.meta or {}).get("model"), stage="queued")
        return True

    def fleet(self) -> list[WorkerInfo]:
        """Live workers, as their registrations say (a read: nothing is written)."""
        return self.registry.live_workers()

    def recover(self) -> list[str]:
        """Requeue the jobs of workers that died (the sweep every live worker's heartbeat
        runs; with no worker alive, nothing else does it) and return their ids. A sweep that
        a refusing Redis, out of memory say, turns away is left to the next one: []."""
        try:
            return RecoveryMonitor(self.connection, self.registry, self.settings).sweep()
        except Exception as exc:
            fault = redis_faults.classify(exc)
            if fault is None:
                raise
            log.warning("recovery.skipped", fault=str(fault), error=str(exc))
            return []

    def queue_depths(self, model: str) -> dict[str, int]:
        """Jobs waiting per queue of one model."""
        return {name: self._queue(name).count for name in self.queue_names(model)}

    def queue_names(self, model: str) -> list[str]:
        """Every queue of ``model``: each priority of each context tier, then the own
        queues of every worker jobs were routed to (``Keys.holders``)."""
        holders = sorted(text(w) for w in self.connection.zrange(self.keys.holders(model), 0, -1))
        return self.keys.queues(model, self.context_tiers(model)) + [
            self.keys.own_queue(model, w, p) for w in holders
            for p in (Priority.HIGH, Priority.NORMAL)]

    def context_tiers(self, model: str) -> list[int]:
        """Every context tier a worker of ``model`` has served (``Keys.tiers``)."""
        return [int(text(t)) for t in self.connection.zrange(self.keys.tiers(model), 0, -1)]


def _function(req: GenerationRequest | Task) -> str:
    """The job function a request is queued under (what its worker runs)."""
    if isinstance(req, GenerationRequest):
        return JOB_FUNCTION
    return EMBEDDING_FUNCTION if isinstance(req, EmbeddingRequest) else TOKENIZER_FUNCTION
