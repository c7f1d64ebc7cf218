"""The one job function a specfleet worker executes, and the resident state it runs on.

rq imports a job's function by name; the runner refuses every name but ``JOB_FUNCTION``. The
job receives plain JSON (a ``GenerationRequest`` dict; job meta rides on the rq job), so
nothing is unpickled. The model lives in ``WorkerRuntime`` on the worker, never in the job.
Each run is one *attempt* (an ``INCR`` on the job's attempt counter): crash recovery or a
shutdown requeue makes the next run attempt + 1, and the stream shows it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn

import structlog
from pydantic import ValidationError
from redis import Redis
from rq import get_current_job

from shared.keys import Keys
from shared.logs import get_logger
from shared.protocol import (
    FinishReason,
    GenerationRequest,
    JobStatus,
    describe_validation_error,
)
from shared.settings import Settings
from worker.service.cancel import CancelWatch
from worker.service.events import EventWriter, TokenChunker

if TYPE_CHECKING:
    from worker.engine.engine import SpeculativeEngine

#: Import path of the job function; the only one a worker will run.
JOB_FUNCTION = "worker.service.jobs.run_generation"

log = get_logger("job")


class RequestRejected(Exception):
    """The request cannot run on this worker (already reported on the job's stream)."""


class JobInterrupted(Exception):
    """The worker stopped the generation: on shutdown the runner requeues the job at the
    front; when the worker had been declared lost, its re-run is already queued elsewhere."""


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
    interrupt: threading.Event = field(default_factory=threading.Event)
    lost: threading.Event = field(default_factory=threading.Event)
    #: (job id, "shutdown" | "lost") of a generation stopped for this worker's own reasons.
    interrupted: tuple[str, str] | None = None

    @property
    def keys(self) -> Keys:
        return self.settings.keys


_runtime: WorkerRuntime | None = None


def bind_runtime(runtime: WorkerRuntime | None) -> None:
    """Install (or clear) the worker's resident state; called by the runner at start-up."""
    global _runtime
    _runtime = runtime


def run_generation(request: Any) -> dict[str, Any]:
    """Validate one request, generate on the resident engine, stream every event.

    Returns the final event as a dict (also rq's job result). Raises ``RequestRejected`` for
    requests that cannot run (so rq records the job failed) and ``JobInterrupted`` when the
    worker stops the generation (shutdown, or declared lost).
    """
    job = get_current_job()
    if _runtime is None or job is None:
        raise RuntimeError("run_generation only runs as an rq job inside a specfleet worker")
    rt = _runtime
    job_id = job.id
    pipe = rt.connection.pipeline(transaction=False)
    pipe.incr(rt.keys.attempts(job_id))
    pipe.expire(rt.keys.attempts(job_id), rt.settings.stream_ttl_seconds)
    attempt = int(pipe.execute()[0])
    writer = EventWriter(rt.connection, rt.keys, job_id, attempt,
                         maxlen=rt.settings.stream_maxlen,
                         ttl_seconds=rt.settings.stream_ttl_seconds)
    structlog.contextvars.bind_contextvars(job_id=job_id, attempt=attempt,
                                           worker=rt.worker_name, model=rt.model_name)
    try:
        log.info("job.started")
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
        raise
    finally:
        structlog.contextvars.unbind_contextvars("job_id", "attempt", "worker", "model")


def _reject(rt: WorkerRuntime, writer: EventWriter, message: str, error_type: str) -> NoReturn:
    writer.error(message, error_type=error_type)
    writer.final(status=JobStatus.FAILED, worker=rt.worker_name, error=message)
    log.warning("job.failed", error_type=error_type, error=message)
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
    prompt = req.prompt_tokens if req.prompt_tokens is not None else rt.engine.tokenize(req.prompt)
    if len(prompt) + req.max_tokens > rt.n_ctx:
        _reject(rt, writer, f"prompt ({len(prompt)} tokens) + max_tokens ({req.max_tokens}) "
                f"exceeds the worker's context of {rt.n_ctx} tokens", "context")
    return req, prompt


def _generate(rt: WorkerRuntime, writer: EventWriter, job_id: str, req: GenerationRequest,
              prompt: list[int]) -> dict[str, Any]:
    chunker = TokenChunker(writer, rt.settings.token_chunk, rt.settings.token_flush_seconds)
    delay = rt.settings.step_delay_seconds
    rt.cancels.begin(job_id)

    def should_stop() -> bool:
        if delay:
            time.sleep(delay)
        return rt.interrupt.is_set() or rt.lost.is_set() or rt.cancels.cancelled()

    try:
        result = rt.engine.generate(
            prompt, req.max_tokens, req.speculative, temperature=req.temperature,
            seed=req.seed, stop=req.stop, on_tokens=chunker.add, should_stop=should_stop)
    except ValueError as exc:
        _reject(rt, writer, str(exc), "request")
    chunker.flush()
    if result.finish_reason is FinishReason.CANCELLED and (rt.interrupt.is_set()
                                                           or rt.lost.is_set()):
        reason = "shutdown" if rt.interrupt.is_set() else "lost"
        writer.progress("interrupted", worker=rt.worker_name)
        log.warning("job.interrupted", reason=reason)
        rt.interrupted = (job_id, reason)
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
    return final.model_dump(mode="json")
