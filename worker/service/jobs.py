"""The one job a specfleet worker runs: a generation request, and the resident state it uses.

A job is an rq job whose function is ``JOB_FUNCTION`` and whose single argument is a plain
JSON ``GenerationRequest`` dict, so nothing is unpickled. The worker's own loop
(``runner.py``) takes it from its queue and calls :func:`run_generation` with the worker's
:class:`WorkerRuntime`: the model lives on the worker, never in the job, and rq never imports
or calls the function itself. Each run is one *attempt* (an ``INCR`` on the job's attempt
counter): crash recovery or a shutdown requeue makes the next run attempt + 1, and the stream
shows it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, NoReturn

import structlog
from pydantic import ValidationError
from redis import Redis

from shared.capacity import capacity_refusal, effective_spec
from shared.keys import Keys
from shared.logs import get_logger
from shared.outage import ride_out
from shared.protocol import (
    FinishReason,
    GenerationRequest,
    JobStatus,
    WorkerCapacity,
    describe_validation_error,
)
from shared.settings import Settings
from worker.service.cancel import CancelWatch
from worker.service.events import EventWriter, TokenChunker

if TYPE_CHECKING:
    from worker.engine.engine import SpeculativeEngine
    from worker.service.metrics import WorkerMetrics

log = get_logger("job")


class Interruption(StrEnum):
    """Why the worker itself stopped a generation (the job is not failed: it runs again)."""

    #: A second SIGTERM: the runner requeues the job at the front of its queue.
    SHUTDOWN = "shutdown"
    #: Another monitor declared this worker lost and has already requeued the job.
    LOST = "lost"


class RequestRejected(Exception):
    """The request cannot run on this worker (already reported on the job's stream)."""


class JobInterrupted(Exception):
    """The worker stopped the generation for one of its own reasons (``reason``)."""

    def __init__(self, reason: Interruption) -> None:
        super().__init__(str(reason))
        self.reason = reason


@dataclass
class WorkerRuntime:
    """Everything a job needs from its worker: the resident engine and the worker's flags."""

    engine: SpeculativeEngine
    connection: Redis
    settings: Settings
    worker_name: str
    model_name: str
    n_ctx: int
    cancels: CancelWatch
    capacity: WorkerCapacity
    metrics: WorkerMetrics
    #: Set by a second SIGTERM: stop the running generation at its next step.
    interrupt: threading.Event = field(default_factory=threading.Event)
    #: Set by the heartbeat when this worker finds it was declared lost.
    lost: threading.Event = field(default_factory=threading.Event)

    @property
    def keys(self) -> Keys:
        return self.settings.keys

    def writer(self, job_id: str, attempt: int) -> EventWriter:
        """The event writer of one attempt of one job, with this worker's stream bounds."""
        return EventWriter(self.connection, self.keys, job_id, attempt,
                           maxlen=self.settings.stream_maxlen,
                           ttl_seconds=self.settings.stream_ttl_seconds,
                           outage_seconds=self.settings.redis_outage_seconds)

    def next_attempt(self, job_id: str) -> int:
        """Count one more attempt of ``job_id`` (shared by every worker that runs it)."""
        def incr() -> int:
            pipe = self.connection.pipeline(transaction=False)
            pipe.incr(self.keys.attempts(job_id))
            pipe.expire(self.keys.attempts(job_id), self.settings.stream_ttl_seconds)
            return int(pipe.execute()[0])
        return ride_out(incr, self.settings.redis_outage_seconds, "job.attempt")


def run_generation(rt: WorkerRuntime, job_id: str, request: Any) -> dict[str, Any]:
    """Validate one request, generate on the resident engine, stream every event.

    Returns the final event as a dict (also rq's job result). Raises ``RequestRejected`` for
    requests that cannot run (rq records the job failed) and ``JobInterrupted`` when the
    worker stops the generation (shutdown, or declared lost).
    """
    attempt = rt.next_attempt(job_id)
    writer = rt.writer(job_id, attempt)
    structlog.contextvars.bind_contextvars(job_id=job_id, attempt=attempt,
                                           worker=rt.worker_name, model=rt.model_name)
    try:
        log.info("job.started")
        rt.metrics.job_started(job_id)
        writer.progress("started", worker=rt.worker_name)
        req, prompt = _admit(rt, writer, request)
        # done/total for progress bars; each token event's ``index`` then advances ``done``.
        writer.progress("generating", done=0, total=req.max_tokens, worker=rt.worker_name)
        return _generate(rt, writer, job_id, req, prompt)
    except (RequestRejected, JobInterrupted):
        raise
    except Exception as exc:  # the engine failed: say so on the stream, then let rq record it
        writer.error(str(exc) or repr(exc), error_type=type(exc).__name__)
        writer.final(status=JobStatus.FAILED, worker=rt.worker_name, error=str(exc) or repr(exc))
        log.error("job.failed", error_type=type(exc).__name__, error=str(exc))
        rt.metrics.job_finished(job_id, None, "failed")
        raise
    finally:
        structlog.contextvars.unbind_contextvars("job_id", "attempt", "worker", "model")


def refuse(rt: WorkerRuntime, job_id: str, reason: str) -> None:
    """End a job this worker will not run (foreign, poisoned) with an error final event, so
    a client following it learns why at once instead of waiting for its timeout."""
    writer = rt.writer(job_id, rt.next_attempt(job_id))
    writer.error(reason, error_type="refused")
    writer.final(status=JobStatus.FAILED, worker=rt.worker_name, error=reason)


def _reject(rt: WorkerRuntime, writer: EventWriter, message: str, error_type: str) -> NoReturn:
    writer.error(message, error_type=error_type)
    writer.final(status=JobStatus.FAILED, worker=rt.worker_name, error=message)
    log.warning("job.failed", error_type=error_type, error=message)
    rt.metrics.job_finished(writer.job_id, None, "rejected")
    raise RequestRejected(message)


def _admit(rt: WorkerRuntime, writer: EventWriter,
           request: Any) -> tuple[GenerationRequest, list[int]]:
    """Validate the request against the protocol and this worker; returns it and its prompt."""
    try:
        req = GenerationRequest.model_validate(request)
    except ValidationError as exc:
        _reject(rt, writer, f"invalid request: {describe_validation_error(exc)}", "validation")
    if req.model != rt.model_name:
        _reject(rt, writer, f"this worker serves model '{rt.model_name}', not '{req.model}'",
                "wrong_model")
    refusal = capacity_refusal(req.speculative, rt.capacity)
    if refusal is not None:
        _reject(rt, writer, f"speculative: {refusal}", "capacity")
    req = req.model_copy(update={"speculative": effective_spec(req.speculative, rt.capacity)})
    from worker.engine.prompt import build_prompt  # loads llama.cpp: worker processes only
    prompt = build_prompt(rt.engine.model, req, rt.settings.chat_template)
    if len(prompt) + req.max_tokens > rt.n_ctx:
        _reject(rt, writer, f"prompt ({len(prompt)} tokens) + max_tokens ({req.max_tokens}) "
                f"exceeds the worker's context of {rt.n_ctx} tokens", "context")
    return req, prompt


def _generate(rt: WorkerRuntime, writer: EventWriter, job_id: str, req: GenerationRequest,
              prompt: list[int]) -> dict[str, Any]:
    chunker = TokenChunker(writer, rt.settings.token_chunk, rt.settings.token_flush_seconds)
    delay = rt.settings.step_delay_seconds
    cancel = rt.cancels.begin(job_id)

    def should_stop() -> bool:
        if delay:
            time.sleep(delay)
        return rt.interrupt.is_set() or rt.lost.is_set() or cancel.cancelled()

    on_tokens = rt.metrics.token_sink(job_id, chunker.add)
    try:
        result = rt.engine.generate(
            prompt, req.max_tokens, req.speculative, temperature=req.temperature,
            seed=req.seed, stop=req.stop, on_tokens=on_tokens, should_stop=should_stop)
    except ValueError as exc:
        _reject(rt, writer, str(exc), "request")
    finally:
        rt.cancels.end(job_id)
    chunker.flush()
    if result.finish_reason is FinishReason.CANCELLED and (rt.interrupt.is_set()
                                                           or rt.lost.is_set()):
        reason = Interruption.SHUTDOWN if rt.interrupt.is_set() else Interruption.LOST
        writer.progress("interrupted", worker=rt.worker_name)
        log.warning("job.interrupted", reason=str(reason))
        rt.metrics.job_finished(job_id, result.telemetry, "interrupted")
        raise JobInterrupted(reason)
    writer.emit("telemetry", telemetry=result.telemetry)
    cancelled = result.finish_reason is FinishReason.CANCELLED
    final = writer.final(
        status=JobStatus.CANCELLED if cancelled else JobStatus.FINISHED,
        finish_reason=result.finish_reason, tokens=result.tokens, text=result.text,
        telemetry=result.telemetry, worker=rt.worker_name)
    log.info("job.cancelled" if cancelled else "job.finished",
             finish_reason=str(result.finish_reason), tokens=len(result.tokens),
             effective_tps=round(result.telemetry.effective_tokens_per_second, 2))
    rt.metrics.job_finished(job_id, result.telemetry, "cancelled" if cancelled else "finished")
    return final.model_dump(mode="json")
