"""The one job a specfleet worker runs: a generation request, and the resident state it uses.

A job is an rq job whose function is ``JOB_FUNCTION`` and whose single argument is a plain
JSON ``GenerationRequest`` dict, so nothing is unpickled. The worker's own loop
(``loop.py``) takes it from its queue and opens a :class:`JobRun` on the worker's
:class:`WorkerRuntime`: the model lives on the worker, never in the job, and rq never calls
the function itself. Each run is one *attempt* (an ``INCR`` on the job's attempt
counter): crash recovery or a shutdown requeue makes the next run attempt + 1, and the stream
shows it.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import structlog
from pydantic import ValidationError
from redis import Redis

from shared.admission import context_refusal, vocabulary_refusal
from shared.event_stream import EventWriter
from shared.keys import Keys
from shared.logs import get_logger
from shared.outage import ride_out
from shared.protocol import (
    EmbeddingRequest,
    FinishReason,
    GenerationRequest,
    JobStatus,
    Rejection,
    Telemetry,
    TokenizerRequest,
    TokenLogprob,
    WorkerCapacity,
    describe_validation_error,
)
from shared.settings import Settings
from worker.engine.slot import GenerationResult, SlotRequest
from worker.service.cancel import CancelWatch
from worker.service.events import TokenChunker

if TYPE_CHECKING:
    from worker.engine.constraint.matcher import CompiledGrammar
    from worker.engine.embedding import Embedder
    from worker.engine.engine import SpeculativeEngine
    from worker.service.metrics import WorkerMetrics

log = get_logger("job")

#: The requests of the jobs a worker runs (``JOB_FUNCTION`` and ``worker/service/tasks.py``).
Request = TypeVar("Request", GenerationRequest, EmbeddingRequest, TokenizerRequest)


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
    #: The embedding context beside the engine (None: this worker serves no embeddings).
    embedder: Embedder | None = None

    @property
    def keys(self) -> Keys:
        return self.settings.keys

    @property
    def rq_name(self) -> str:
        """This worker's name in rq's records (:meth:`Keys.rq_worker`)."""
        return self.keys.rq_worker(self.worker_name)

    def writer(self, job_id: str, attempt: int) -> EventWriter:
        """The event writer of one attempt of one job, with this worker's stream bounds."""
        return EventWriter.for_job(self.connection, self.settings, job_id, attempt)

    def next_attempt(self, job_id: str) -> int:
        """Count one more attempt of ``job_id`` (shared by every worker that runs it), once
        however often the write is retried through an outage (:data:`_ATTEMPT_LUA`)."""
        token = uuid.uuid4().hex
        count = self.connection.register_script(_ATTEMPT_LUA)
        keys = [self.keys.attempts(job_id), self.keys.attempt_tokens(job_id)]

        def incr() -> int:
            return int(count(keys=keys, args=[token, self.settings.stream_ttl_seconds]))
        return ride_out(incr, self.settings.redis_outage_seconds, "job.attempt")


#: One start of a job counted once: an INCR that Redis ran but whose reply an outage cut was
#: retried and counted the attempt twice (a 10 s outage mid-batch: a job that ran once said
#: ``attempts: 2``). Each start carries a token; its retries get the number it was given.
_ATTEMPT_LUA = """
local n = redis.call('HGET', KEYS[2], ARGV[1])
if not n then
  n = redis.call('INCR', KEYS[1])
  redis.call('HSET', KEYS[2], ARGV[1], n)
end
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('EXPIRE', KEYS[2], ARGV[2])
return tonumber(n)
"""


def run_generation(request: Any) -> None:
    """The function every specfleet job names (``JOB_FUNCTION``): its identity on the queue.

    Generation needs the model the worker holds, so only ``specfleet worker`` runs these jobs
    (through :class:`JobRun`); a foreign rq worker that imports and calls this fails the job
    with this message instead of doing anything."""
    raise RuntimeError("specfleet jobs run only inside 'specfleet worker', which holds the "
                       f"model; got a request for {type(request).__name__}")


class JobRun:
    """One attempt of one job on this worker, from admission to its final event.

    The serving loop opens a run per job it takes (:meth:`open`: attempt, events, validation,
    prompt), hands :meth:`slot_request` to the engine, feeds each step's tokens to
    :meth:`tokens`, and ends it with :meth:`finish` (or :meth:`fail`). Several runs are open
    at once on a worker with several slots; each logs with its own job fields.
    """

    def __init__(self, rt: WorkerRuntime, job_id: str, writer: EventWriter,
                 req: GenerationRequest, prompt: list[int],
                 logger: structlog.typing.FilteringBoundLogger) -> None:
        self.rt = rt
        self.job_id = job_id
        self.writer = writer
        self.req = req
        self.prompt = prompt
        self.log = logger
        self._cancel = rt.cancels.begin(job_id)
        # Where the engine overlaps host work with the device's decode, a due chunk goes out
        # during the next step's decode (flush_due) instead of between steps.
        self._chunker = TokenChunker(writer, rt.settings.token_chunk,
                                     rt.settings.token_flush_seconds, logprobs=req.logprobs,
                                     deferred=rt.engine.overlaps)
        #: Why a constrained output cut by max_tokens may not parse (the budget is under the
        #: shortest document its constraint allows): the final event's ``error``.
        self._budget_note: str | None = None

    @classmethod
    def open(cls, rt: WorkerRuntime, job_id: str, request: Any) -> JobRun:
        """Start an attempt: count it, say so, validate the request against the protocol and
        this worker. Raises ``RequestRejected`` (already on the job's stream)."""
        writer, logger = begin_attempt(rt, job_id)
        req, prompt = _admit(rt, writer, logger, request)
        # done/total for progress bars; each token event's ``index`` then advances ``done``.
        writer.progress("generating", done=0, total=req.max_tokens, worker=rt.worker_name)
        return cls(rt, job_id, writer, req, prompt, logger)

    def slot_request(self, grammar: CompiledGrammar | None) -> SlotRequest:
        """The engine's request; ``grammar``: the request's constraint, compiled by the
        serving loop off the engine's thread (None: it has none)."""
        # The coordinator gave the request its seed before queueing; one that arrived
        # without (an old client writing the queue itself) gets one drawn by the engine.
        req = self.req
        if grammar is not None:
            self._budget_note = grammar.budget_note(req.max_tokens)
            if self._budget_note:
                self.log.warning("constraint.budget_short", max_tokens=req.max_tokens,
                                 shortest=grammar.shortest, kind=grammar.kind)
        return SlotRequest(self.prompt, req.max_tokens, req.speculative,
                           sampling=req.sampling, stop=req.stop, logprobs=req.logprobs_k,
                           prefix_cache=req.prefix_cache, constraint=grammar,
                           log_fields={"job_id": self.job_id, "attempt": self.writer.attempt})

    def tokens(self, tokens: list[int], text: str,
               logprobs: Sequence[TokenLogprob] = (), origin: str = "") -> None:
        """One step's committed tokens (their logprobs, how each was produced): timed, then
        streamed."""
        self.rt.metrics.tokens(self.job_id, len(tokens))
        self._chunker.add(tokens, text, logprobs, origin)

    def flush_due(self) -> None:
        """Send the token events that came due at the last step and were deferred."""
        self._chunker.flush_due()

    def should_stop(self) -> bool:
        """Checked once per engine step: a cancel, a second SIGTERM, or this worker lost."""
        rt = self.rt
        return rt.interrupt.is_set() or rt.lost.is_set() or self._cancel.cancelled()

    def reject(self, message: str, error_type: Rejection = Rejection.REQUEST) -> NoReturn:
        """The engine refused the request at admission (a prompt it cannot hold, a setting
        beyond its capacity, ...)."""
        reject_attempt(self.rt, self.writer, self.log, message, error_type)

    def finish(self, result: GenerationResult) -> dict[str, Any]:
        """The final event of a finished (or cancelled) generation; rq's result.

        Raises ``JobInterrupted`` when the worker itself stopped it (shutdown, lost)."""
        rt = self.rt
        self._chunker.flush()
        if result.finish_reason is FinishReason.CANCELLED:
            stand_down_if_interrupted(rt, self.writer, self.log, result.telemetry)
        self.writer.emit("telemetry", telemetry=result.telemetry)
        cancelled = result.finish_reason is FinishReason.CANCELLED
        # Counted before the final event: a client that has its result and then reads the
        # worker's metrics finds it there (a clean-clone CI run read 0 finished in between).
        rt.metrics.job_finished(self.job_id, result.telemetry,
                                "cancelled" if cancelled else "finished")
        final = self.writer.final(
            status=JobStatus.CANCELLED if cancelled else JobStatus.FINISHED,
            finish_reason=result.finish_reason, tokens=result.tokens, text=result.text,
            telemetry=result.telemetry, worker=rt.worker_name, seed=result.seed,
            logprobs=result.logprobs if self.req.logprobs else None,
            error=self._budget_note if result.finish_reason in (
                FinishReason.LENGTH, FinishReason.CONTEXT) else None)
        self.log.info("job.cancelled" if cancelled else "job.finished",
                      finish_reason=str(result.finish_reason), tokens=len(result.tokens),
                      effective_tps=round(result.telemetry.effective_tokens_per_second, 2))
        return final.model_dump(mode="json")

    def fail(self, exc: BaseException) -> None:
        """The engine failed under this job: say so on its stream (rq records it after)."""
        fail_attempt(self.rt, self.writer, self.log, exc)

    def close(self) -> None:
        self.rt.cancels.end(self.job_id)


def refuse(rt: WorkerRuntime, job_id: str, reason: str) -> None:
    """End a job this worker will not run (foreign, poisoned) with an error final event, so
    a client following it learns why at once instead of waiting for its timeout."""
    writer = rt.writer(job_id, rt.next_attempt(job_id))
    writer.error(reason, error_type="refused")
    writer.final(status=JobStatus.FAILED, worker=rt.worker_name, error=reason)


def begin_attempt(rt: WorkerRuntime,
                  job_id: str) -> tuple[EventWriter, structlog.typing.FilteringBoundLogger]:
    """Count a new attempt of ``job_id`` and say it started (its stream, the log, the
    metrics); its event writer and its logger, bound to the job's fields."""
    attempt = rt.next_attempt(job_id)
    writer = rt.writer(job_id, attempt)
    logger = log.bind(job_id=job_id, attempt=attempt, worker=rt.worker_name,
                      model=rt.model_name)
    logger.info("job.started")
    rt.metrics.job_started(job_id)
    writer.progress("started", worker=rt.worker_name)
    return writer, logger


def stand_down_if_interrupted(rt: WorkerRuntime, writer: EventWriter,
                              logger: structlog.typing.FilteringBoundLogger,
                              telemetry: Telemetry | None) -> None:
    """A stopped attempt that the worker itself stopped (a second SIGTERM, or it was
    declared lost) stands down: it says so and raises :class:`JobInterrupted` (the job runs
    again). One stopped by its own cancel returns, to end cancelled."""
    if not (rt.interrupt.is_set() or rt.lost.is_set()):
        return
    reason = Interruption.SHUTDOWN if rt.interrupt.is_set() else Interruption.LOST
    writer.progress("interrupted", worker=rt.worker_name)
    logger.warning("job.interrupted", reason=str(reason))
    rt.metrics.job_finished(writer.job_id, telemetry, "interrupted")
    raise JobInterrupted(reason)


def fail_attempt(rt: WorkerRuntime, writer: EventWriter,
                 logger: structlog.typing.FilteringBoundLogger, exc: BaseException) -> None:
    """The worker failed under a job: an error and a failed final event on its stream (rq
    records the failure after), logged and counted."""
    message = str(exc) or repr(exc)
    rt.metrics.job_finished(writer.job_id, None, "failed")  # before the final, as finish
    writer.error(message, error_type=type(exc).__name__)
    writer.final(status=JobStatus.FAILED, worker=rt.worker_name, error=message)
    logger.error("job.failed", error_type=type(exc).__name__, error=str(exc))


def reject_attempt(rt: WorkerRuntime, writer: EventWriter,
                   logger: structlog.typing.FilteringBoundLogger, message: str,
                   error_type: Rejection, param: str | None = None) -> NoReturn:
    """The request cannot run here: an error (naming the field at fault, ``param``) and a
    failed final event on its stream (the client hears a 400), logged; raises
    :class:`RequestRejected`."""
    rt.metrics.job_finished(writer.job_id, None, "rejected", reason=str(error_type))
    writer.error(message, error_type=error_type, param=param)
    writer.final(status=JobStatus.FAILED, worker=rt.worker_name, error=message)
    logger.warning("job.failed", error_type=error_type, error=message)
    raise RequestRejected(message)


def admit_request(rt: WorkerRuntime, writer: EventWriter,
                  logger: structlog.typing.FilteringBoundLogger, kind: type[Request],
                  request: Any) -> Request:
    """``request`` as a ``kind`` of this worker's model, or rejected naming the field."""
    try:
        req = kind.model_validate(request)
    except ValidationError as exc:
        errors = exc.errors()
        param = ".".join(str(p) for p in errors[0]["loc"]) if errors else None
        reject_attempt(rt, writer, logger, f"invalid request: {describe_validation_error(exc)}",
                       Rejection.VALIDATION, param or None)
    if req.model != rt.model_name:
        reject_attempt(rt, writer, logger,
                       f"this worker serves model '{rt.model_name}', not '{req.model}'",
                       Rejection.WRONG_MODEL, "model")
    return req


def _admit(rt: WorkerRuntime, writer: EventWriter, logger: structlog.typing.FilteringBoundLogger,
           request: Any) -> tuple[GenerationRequest, list[int]]:
    """Validate the request against the protocol and this worker; returns it and its prompt."""
    req = admit_request(rt, writer, logger, GenerationRequest, request)
    refusal = vocabulary_refusal(req, rt.engine.model.n_vocab)
    if refusal is not None:
        field, why = refusal
        reject_attempt(rt, writer, logger, f"{field}: {why}", Rejection.VALIDATION)
    from worker.engine.prompt import PromptError, build_prompt  # loads llama.cpp: worker only
    try:
        prompt = build_prompt(rt.engine.model, req, rt.settings.chat_template)
    except PromptError as exc:  # no chat template, a template that fails to render
        reject_attempt(rt, writer, logger, str(exc), Rejection.PROMPT)
    too_long = context_refusal(len(prompt), req.max_tokens, rt.n_ctx, "the worker's context")
    if too_long is not None:
        reject_attempt(rt, writer, logger, too_long, Rejection.CONTEXT)
    return req, prompt
