"""The serving loop: the engine's slots fed from the worker's queues, stepped together, and
the worker's embedding and tokenizer jobs (``tasks.py``) served between the steps.

specfleet's own loop, not rq's ``Worker.work``: it takes each job atomically into the
worker's in-flight list (``intake.py``), refuses and quarantines entries it cannot run, and
keeps rq's job records and registries (``rq_state.py``) so rq's tools still tell the truth.
Every Redis call rides out an outage up to ``SPECFLEET_REDIS_OUTAGE_SECONDS``; past that the
loop raises :class:`RedisOutage`, leaving its jobs in the in-flight list for recovery. The
process around it (registry, heartbeat, signals, metrics) is wired in ``runner.py``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass
from functools import partial
from types import FrameType
from typing import TypeVar

from redis.client import Pipeline
from rq.executions import Execution
from rq.job import Job
from rq.worker import SimpleWorker, WorkerStatus

from shared.capacity import CapacityError
from shared.constraint import ConstraintError, sandbox
from shared.logs import get_logger
from shared.outage import RedisOutage, ride_out
from shared.protocol import JOB_FUNCTION, TOKENIZER_FUNCTION, Rejection
from shared.recovery import requeue_front
from worker.engine.constraint.matcher import CompiledGrammar, GrammarCompile, compile_off_thread
from worker.engine.slot import GenerationResult, Slot
from worker.service.intake import JobIntake, Taken
from worker.service.jobs import (
    Interruption,
    JobInterrupted,
    JobRun,
    RequestRejected,
    WorkerRuntime,
    refuse,
)
from worker.service.prefix_presence import PrefixPresence
from worker.service.rq_state import (
    PoisonedJob,
    end_execution,
    is_waiting,
    load_job,
    mark_failed,
    mark_finished,
    mark_started,
)
from worker.service.tasks import EmbeddingRun, tokenize_job

log = get_logger("worker")

T = TypeVar("T")

#: A worker gives a constraint this many times the coordinator's compile budget
#: (``SPECFLEET_CONSTRAINT_COMPILE_SECONDS``): it compiles the sandbox's check and then
#: against a vocabulary of up to 262k tokens, beside a decode.
WORKER_COMPILE_FACTOR = 4
#: How often an idle loop with constraints compiling looks at their budgets.
COMPILE_POLL_SECONDS = 0.1


@dataclass
class _Starting:
    """A job taken and opened, on its way into a slot: its constraint (if any) compiling
    off the engine's thread until ``deadline``."""

    job: Job
    execution: Execution
    run: JobRun
    grammar: GrammarCompile | None = None

    def compiled(self, budget: float) -> CompiledGrammar | None:
        """The compiled constraint (None: the job has none); a ``ConstraintError`` when it
        did not compile, or not within ``budget`` seconds (the thread runs on to its end;
        llguidance's parser limits bound it, and its result is dropped)."""
        if self.grammar is None:
            return None
        if not self.grammar.future.done():
            raise ConstraintError(f"the constraint did not compile against this model's "
                                  f"vocabulary within {budget:g} s "
                                  "(SPECFLEET_CONSTRAINT_COMPILE_SECONDS x "
                                  f"{WORKER_COMPILE_FACTOR})")
        return self.grammar.future.result()


@dataclass
class _Running:
    """A job in one of the engine's slots: rq's records of its run, and the run itself."""

    job: Job
    execution: Execution
    run: JobRun
    slot: Slot


@dataclass
class _Embedding:
    """An embedding job whose inputs wait for (or are in) the embedding decodes."""

    job: Job
    execution: Execution
    run: EmbeddingRun


class ServingLoop:
    """Feeds the engine's slots from the worker's queues and steps them all together.

    Each pass takes jobs while a slot is free (blocking only when the worker is idle), opens
    a :class:`JobRun` for each and admits it to the engine, then runs ONE engine step for
    every active slot and hands each slot's tokens and result to its run. A finished slot is
    refilled at the next pass (continuous batching). A tokenizer job is answered when taken;
    the pending inputs of every embedding job are pooled, one embedding decode a pass,
    before the step. A poisoned entry, a rejected request or a failing job never stops the
    others.
    """

    def __init__(self, runtime: WorkerRuntime, intake: JobIntake,
                 prefixes: PrefixPresence) -> None:
        self.runtime = runtime
        self.intake = intake
        #: What each slot holds, published for prefix-affinity routing.
        self.prefixes = prefixes
        #: rq's record of this worker, marked busy or idle (set once it is started).
        self.presence: SimpleWorker | None = None
        self.stopping = threading.Event()
        self._running: dict[int, _Running] = {}
        #: Jobs whose constraint is compiling; each holds a slot (free_slots counts them).
        self._compiling: list[_Starting] = []
        #: Embedding jobs with inputs still to pool, in the order taken; each holds a slot.
        self._embedding: list[_Embedding] = []
        #: Signals received and not yet logged (see :meth:`request_stop`).
        self._signals: list[tuple[int, bool]] = []

    @property
    def current_jobs(self) -> list[str]:
        """The jobs in the engine's slots right now, in slot order, then those whose
        constraint is compiling, then the embedding jobs."""
        return ([r.job.id for _, r in sorted(self._running.items())]
                + [s.job.id for s in self._compiling] + [e.job.id for e in self._embedding])

    def _free_slots(self) -> int:
        return self.runtime.engine.free_slots - len(self._compiling) - len(self._embedding)

    def _publish_held(self) -> None:
        """Routing's load figure counts the slots held outside the engine too (constraints
        compiling, embedding jobs): a generation routed here would wait behind them."""
        held = len(self._compiling) + len(self._embedding)
        self._ride(lambda: self.prefixes.holding(held), "prefix.publish")

    def _busy(self) -> bool:
        return bool(self._running or self._compiling or self._embedding)

    def run(self) -> None:
        """Serve until asked to stop and every slot is done; raises :class:`RedisOutage` past
        the outage deadline (the held jobs stay in the in-flight list for recovery)."""
        while not (self.stopping.is_set() and not self._busy()):
            self._log_signals()
            while (self._free_slots() > 0 and not self.stopping.is_set()
                   and not self.runtime.lost.is_set()):
                taken = self._ride(lambda: self.intake.take(block=not self._busy()),
                                   "intake.take")
                if taken is None:
                    break
                self._start(taken)
            self._admit_compiled()
            if self._embedding:
                self._embed()
            if self._running:
                self._step()
            elif self._compiling and not self._embedding:
                self._wait_compiles()
            elif self.runtime.lost.is_set() and not self._busy():
                self.runtime.lost.clear()  # every stale run has stood down
        self._log_signals()

    def request_stop(self, signum: int, frame: FrameType | None) -> None:
        """SIGTERM/SIGINT: the first finishes the running jobs; a second interrupts them.

        No logging here: a handler runs between two bytecodes of the main thread, which may
        be writing a log line under the stream's (non-reentrant) lock, and a log call here
        then waits for that lock forever (a SIGTERM that never drained, seen in the suite).
        The serving loop logs the signal at its next pass."""
        interrupt = self.stopping.is_set() and bool(self._running or self._embedding)
        self._signals.append((signum, interrupt))
        if interrupt:
            self.runtime.interrupt.set()
        else:
            self.stopping.set()

    def _log_signals(self) -> None:
        while self._signals:
            signum, interrupt = self._signals.pop(0)
            if interrupt:
                log.warning("worker.interrupting", worker=self.runtime.worker_name,
                            signal=signum, jobs=self.current_jobs)
            else:
                log.info("worker.stopping", worker=self.runtime.worker_name, signal=signum,
                         jobs=self.current_jobs)

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
        execution = self._ride(lambda: mark_started(conn, job, rt.rq_name, ttl),
                               "job.start")
        self._set_state(WorkerStatus.BUSY)
        if job.func_name != JOB_FUNCTION:
            self._start_task(job, execution, request)
            return
        try:
            run = JobRun.open(rt, job.id, request)
        except RedisOutage:
            raise
        except Exception as exc:  # rejected (already on its stream) or failed to start
            self._failed_start(job, execution, None, exc)
            return
        starting = _Starting(job, execution, run)
        if run.req.constraint is None:
            self._admit(starting)
            return
        starting.grammar = compile_off_thread(run.req.constraint, rt.engine.model)
        self._compiling.append(starting)
        self._publish_held()

    def _start_task(self, job: Job, execution: Execution, request: object) -> None:
        """A tokenizer job, answered now; an embedding job, admitted to the pending ones."""
        rt = self.runtime
        try:
            if job.func_name == TOKENIZER_FUNCTION:
                final = tokenize_job(rt, job.id, request)
                self._end(job, lambda pipe: mark_finished(pipe, job, execution, final,
                                                          rt.settings.result_ttl_seconds,
                                                          rt.rq_name))
                if not self._busy():
                    self._set_state(WorkerStatus.IDLE)
                return
            run = EmbeddingRun.open(rt, job.id, request)
        except RedisOutage:
            raise
        except Exception as exc:  # rejected or failed: already on its stream
            self._failed_start(job, execution, None, exc)
            return
        self._embedding.append(_Embedding(job, execution, run))
        self._publish_held()

    def _embed(self) -> None:
        """One decode of the embedding context over the pending inputs of every embedding
        job, in the order taken (``Embedder.embed_next``: as many as it holds); a job stopped
        meanwhile ends first, a job whose inputs are all pooled ends after."""
        rt = self.runtime
        for e in [e for e in self._embedding if e.run.should_stop()]:
            self._end_embedding(e)
        pending = [(e, tokens) for e in self._embedding for tokens in e.run.pending]
        if not pending:
            return
        embedder = rt.embedder
        assert embedder is not None  # EmbeddingRun.open refuses every job without one
        try:
            vectors = embedder.embed_next([tokens for _, tokens in pending])
        except Exception as exc:  # the decode failed: the context is suspect, every
            for e in list(self._embedding):  # embedding job this worker holds fails
                e.run.fail(exc)
                self._close(e, partial(mark_failed, job=e.job, execution=e.execution,
                                       error=exc, worker_name=rt.rq_name))
            self._log_crash(None, exc)
            return
        for (e, _), vector in zip(pending, vectors, strict=False):
            e.run.pooled([vector])
        for e in [e for e in self._embedding if e.run.done]:
            self._end_embedding(e)

    def _end_embedding(self, e: _Embedding) -> None:
        """An embedding job done or stopped: its final event, or handed back when the worker
        itself stopped it."""
        rt = self.runtime
        try:
            final = e.run.finish()
        except JobInterrupted as exc:
            self._hand_back(e, exc.reason)
            return
        self._close(e, lambda pipe: mark_finished(pipe, e.job, e.execution, final,
                                                  rt.settings.result_ttl_seconds, rt.rq_name))

    def _compile_budget(self) -> float:
        return sandbox().seconds * WORKER_COMPILE_FACTOR

    def _admit_compiled(self) -> None:
        """Admit the jobs whose constraint has compiled (or failed to, or ran past its
        budget: rejected naming it); the others keep compiling beside the decode."""
        for starting in list(self._compiling):
            grammar = starting.grammar
            assert grammar is not None
            if grammar.future.done() or grammar.overdue(self._compile_budget()):
                self._compiling.remove(starting)
                self._admit(starting)
                self._publish_held()

    def _wait_compiles(self) -> None:
        """Nothing to decode, only constraints compiling: wait for one to end (at most a
        tenth of a second, then look at the budgets again), not spin."""
        wait([s.grammar.future for s in self._compiling if s.grammar is not None],
             timeout=COMPILE_POLL_SECONDS, return_when=FIRST_COMPLETED)

    def _admit(self, starting: _Starting) -> None:
        rt = self.runtime
        run = starting.run
        try:
            try:
                slot = rt.engine.admit(run.slot_request(starting.compiled(
                    self._compile_budget())))
            except CapacityError as exc:  # shared/capacity.py: the rule applied at submit
                run.reject(f"speculative: {exc}", Rejection.CAPACITY)
            except ValueError as exc:  # a ConstraintError among them
                run.reject(str(exc))
        except RedisOutage:
            raise
        except Exception as exc:  # rejected (already on its stream) or failed to start
            self._failed_start(starting.job, starting.execution, run, exc)
            return
        self._running[slot.seq] = _Running(starting.job, starting.execution, run, slot)
        req = run.req
        self._ride(lambda: self.prefixes.admitted(slot.seq, req), "prefix.publish")

    def _failed_start(self, job: Job, execution: Execution, run: JobRun | None,
                      exc: Exception) -> None:
        """A job that never reached a slot: its failure recorded, its run closed."""
        rt = self.runtime
        if run is not None and not isinstance(exc, RequestRejected):
            run.fail(exc)
        self._end(job, partial(mark_failed, job=job, execution=execution, error=exc,
                               worker_name=rt.rq_name))
        if run is not None:
            run.close()
        self._log_crash(job.id, exc)
        if not self._busy():
            self._set_state(WorkerStatus.IDLE)

    # -- one engine step for every slot ----------------------------------------------------
    def _step(self) -> None:
        rt = self.runtime
        for r in self._running.values():
            if r.run.should_stop():
                rt.engine.cancel(r.slot)
        if rt.settings.step_delay_seconds:
            time.sleep(rt.settings.step_delay_seconds)  # test/drill only: a slower worker
        failed: list[Exception] = []

        def flush_due() -> None:
            """The token events due since the last step, sent while the device decodes this
            one (where it overlaps: ``engine.overlaps``); a Redis failure is raised after the
            step, as it would have been from ``tokens`` (the engine drops its slots on any
            exception in a step, and a Redis outage is not theirs)."""
            try:
                for r in self._running.values():
                    r.run.flush_due()
            except Exception as exc:
                failed.append(exc)

        try:
            updates = rt.engine.step(flush_due)
        except Exception as exc:  # the engine dropped every active slot: each job failed
            self._ride(lambda: self.prefixes.dropped(list(self._running)), "prefix.publish")
            for r in list(self._running.values()):
                r.run.fail(exc)
                self._close(r, partial(mark_failed, job=r.job, execution=r.execution,
                                       error=exc, worker_name=rt.rq_name))
            self._log_crash(None, exc)
            return
        if failed:
            raise failed[0]
        for update in updates:
            r = self._running[update.slot.seq]
            if update.verified:
                r.run.tokens(update.tokens, update.text, update.logprobs, update.origin)
            if update.result is not None:
                self._complete(r, update.result)

    def _complete(self, r: _Running, result: GenerationResult) -> None:
        rt = self.runtime
        # Before the final event: a client's next turn, sent once it has this one's answer,
        # already finds it published.
        self._ride(lambda: self.prefixes.ended(r.slot.seq, r.run.req, result.text,
                                               result.tokens), "prefix.publish")
        try:
            final = r.run.finish(result)
        except JobInterrupted as exc:
            self._hand_back(r, exc.reason)
            return
        self._close(r, lambda pipe: mark_finished(pipe, r.job, r.execution, final,
                                                  rt.settings.result_ttl_seconds,
                                                  rt.rq_name))

    def _hand_back(self, r: _Running | _Embedding, reason: Interruption) -> None:
        """A run the worker itself stopped goes back to its queue's front. A shutdown hands
        its runs back. A worker declared lost hands back only what is still in its in-flight
        list: the sweep took (and requeued) what was there when it claimed the name, so a
        job still listed was taken after it, and nobody else will ever run it (the soak's
        lost job behind a stalled worker's resume)."""
        shutdown = reason is Interruption.SHUTDOWN
        self._close(r, lambda pipe: end_execution(pipe, r.job, r.execution), release=shutdown)
        if shutdown or self._ride(lambda: self.intake.release(r.job.id), "intake.release"):
            self._requeue(r.job.id, reason)

    def _close(self, r: _Running | _Embedding, record: Callable[[Pipeline], None],
               release: bool = True) -> None:
        """A run is over: its outcome into rq's records, its slot (or place among the
        pending embeddings) and flag freed."""
        self._end(r.job, record, release)
        r.run.close()
        if isinstance(r, _Running):
            del self._running[r.slot.seq]
        else:
            self._embedding.remove(r)
            self._publish_held()
        if not self._busy():
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
        rt.metrics.job_refused(taken.job_id, reason)
        self._ride(lambda: refuse(rt, taken.job_id, reason), "job.refuse")
        if exc.job is not None:
            poisoned = exc.job

            def record() -> None:
                with rt.connection.pipeline() as pipe:
                    mark_failed(pipe, poisoned, None, reason, rt.rq_name)
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

    def _requeue(self, job_id: str, reason: Interruption) -> None:
        rt = self.runtime
        self._ride(lambda: requeue_front(rt.connection, rt.keys, job_id), "job.requeue")
        attempt = int(self._ride(lambda: rt.connection.get(rt.keys.attempts(job_id)),
                                 "job.requeue") or 1)
        log.warning("job.requeued", job_id=job_id, worker=rt.worker_name,
                    model=rt.model_name, attempt=attempt, next_attempt=attempt + 1,
                    reason=str(reason))
        rt.metrics.job_requeued(str(reason), job_id=job_id)

    def _set_state(self, state: WorkerStatus) -> None:
        presence = self.presence
        if presence is not None:
            self._ride(lambda: presence.set_state(state), "rq.state")

    def _ride(self, operation: Callable[[], T], what: str) -> T:
        return ride_out(operation, self.runtime.settings.redis_outage_seconds, what)
