"""Batches that live in Redis (OpenAI's Batch API): a file in, jobs, files out (the files are
``coordinator/files.py``'s, the tenants ``coordinator/tenancy.py``'s).

A batch advances with no client alive. Creating one checks its input file (JSON Lines, every
``custom_id`` its own, within the limits) and answers at once, ``validating``; its lines are
turned into jobs afterwards by :meth:`BatchStore.advance` (``in_progress`` from the first
line), which whoever holds the batch's short creator lease runs: the creating process, or any
gateway's batch pump when that one died (the lease lapses in seconds, job ids follow from the
batch and the line, so no line runs twice). A line whose model has no live worker (a rolling
restart, a declared model scaled to zero: ``coordinator/models.py``) waits for one, counted
among the model's waiting requests (``coordinator/waiting.py``); once the batch's window
(``SPECFLEET_BATCH_WINDOW_SECONDS``, OpenAI's ``24h``) has passed, the batch is ``expired``:
lines not yet run are withdrawn and reported ``batch_expired``, the finished ones stay in its
output. Each job's final event is accounted
to the batch by the script that appends it (``shared.event_stream``: counts, the line's
result, the batch's end), whoever writes it (a worker, a cancel of a queued job, crash
recovery). A line that cannot become a job (not UTF-8, not JSON, not a batch line, a request
the coordinator refuses) gets a failed final event through the same script, so there is one
way a line is accounted. Output and error files are assembled from Redis when they are read,
in input order. The HTTP gateway and ``specfleet batch`` both use :class:`BatchStore`; there
is no other implementation.

Tenants: every batch is owned by the tenant that created it (``coordinator/tenancy.py``), and
its output and error files are its. A tenant's quota bounds its open batches, checked and
booked in one script with the write, so concurrent requests cannot overshoot it.

A batch cannot take its pumps down with it. A cancelled or expired batch's remaining lines are
accounted ``cancelled`` without being parsed. Before a pump parses a line it books the attempt
in the batch's hash (``attempt_line``, ``attempts``), and books it off when it lets go without
dying (a stop, a lost lease); a line that pumps took :data:`MAX_LINE_ATTEMPTS` times and never
finished (they died on it: a crash in a parser, a kill) is failed unparsed, and the batch
carries on. An unexpected exception on a line fails that line; one outside any line is
counted in ``pump_failures`` and fails the batch (OpenAI's ``errors`` object) at
:data:`MAX_BATCH_FAILURES`. Redis errors only delay: the next call resumes.

Redis keys (``shared.keys``): ``batch:{id}`` (status, counts, meta, owner, the line being
attempted), ``batch:{id}:jobs`` (line -> custom id, job id, model), ``batch:{id}:results``
(line -> final event), ``batch:{id}:creator`` (the queueing lease, naming its holder
``HOST:PID:TOKEN``), ``job:{id}:batch`` (a job's line reference, read by the script),
``batches`` (listing), ``batches:open`` (batches not ended, by when their window closes: what
the gateways' pumps look after), ``owner:{key id}:batches...`` (a tenant's listings and what
its quota counts).
Everything expires ``SPECFLEET_RESULT_TTL_SECONDS`` after the batch's last change.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

from pydantic import TypeAdapter, ValidationError
from redis.exceptions import RedisError
from rq.job import Job

from coordinator.client import Coordinator
from coordinator.files import (
    FileStore,
    batch_of_file,
    json_value,
    jsonl_lines,
    result_file_id,
)
from coordinator.openai_api import embeddings as embeddings_api
from coordinator.openai_api import replies, requests
from coordinator.openai_api.fields import Metadata, RequestError
from coordinator.tenancy import ANONYMOUS, OPERATOR, StoreError, Tenant, listing
from coordinator.validation import SubmitError
from shared.event_stream import EventWriter
from shared.logs import get_logger
from shared.outage import RedisOutage
from shared.protocol import BatchLine, FinalEvent, JobStatus, describe_validation_error
from shared.replies import text

log = get_logger("batch")

#: Most lines in one batch.
MAX_BATCH_LINES = 10_000
#: The only completion window (OpenAI's); its length is ``Settings.batch_window_seconds``.
COMPLETION_WINDOW = "24h"
#: Seconds a batch's creator holds its lease without renewing it (renewed as it queues).
CREATOR_LEASE_SECONDS = 3.0
#: Seconds between two looks for a live worker while a line's model has none.
WORKER_WAIT_SECONDS = 1.0
#: Pumps that may take one line and die on it before the next one fails it unparsed: one
#: death is a kill or an OOM that had nothing to do with the line, three in a row are the line.
MAX_LINE_ATTEMPTS = 3
#: Unexpected failures outside any line (corrupt batch data, a bug) after which a batch is
#: ``failed`` instead of retried by every pump for ever.
MAX_BATCH_FAILURES = 3
#: Statuses after which a batch never changes again.
TERMINAL = frozenset({"failed", "completed", "expired", "cancelled"})
#: Statuses in which a batch still has lines to queue or jobs to wait for.
OPEN = ("validating", "in_progress", "cancelling")
#: Move a batch to status ARGV[1] (stamping field ARGV[2] with Redis's clock, and storing
#: ARGV[3] as its ``errors`` object unless empty) only from one of the statuses ARGV[4..]: a
#: cancel or the last line's accounting may have moved it meanwhile.
_MOVE_LUA = """
local status = redis.call('HGET', KEYS[1], 'status')
for i = 4, #ARGV do
  if status == ARGV[i] then
    redis.call('HSET', KEYS[1], 'status', ARGV[1], ARGV[2], redis.call('TIME')[1])
    if ARGV[3] ~= '' then redis.call('HSET', KEYS[1], 'errors', ARGV[3]) end
    return 1
  end
end
return 0
"""
#: Extend the lease KEYS[1] by ARGV[2] ms only while it is still ours (token ARGV[1]).
_RENEW_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
#: A pump takes line ARGV[1] of batch KEYS[1] (ARGV[2] = 1), or lets go of it without dying
#: (-1): ``attempts`` counts the pumps that took ``attempt_line`` and never finished it (a
#: finished line deletes both fields). Returns the count.
_ATTEMPT_LUA = """
if redis.call('HGET', KEYS[1], 'attempt_line') ~= ARGV[1] then
  if ARGV[2] ~= '1' then return 0 end
  redis.call('HSET', KEYS[1], 'attempt_line', ARGV[1], 'attempts', 0)
end
return redis.call('HINCRBY', KEYS[1], 'attempts', ARGV[2])
"""
#: Create batch ARGV[1] (hash KEYS[1] of the field/value pairs ARGV[8..], TTL ARGV[4]; in the
#: listing KEYS[2] and the owner's KEYS[4] scored ARGV[2], in the open set KEYS[3] and the
#: owner's KEYS[5] scored ARGV[3]; the owner's sets expire after ARGV[7]), unless the owner
#: already has ARGV[5] batches open (-1: no limit; KEYS[5] loses those that ended, found by
#: their hash under prefix ARGV[6]). Returns -1 once created, else the owner's open batches.
_CREATE_LUA = "local open_status = {" + ", ".join(f"{s} = true" for s in OPEN) + "}" + """
local open = 0
for _, id in ipairs(redis.call('ZRANGE', KEYS[5], 0, -1)) do
  if open_status[redis.call('HGET', ARGV[6] .. id, 'status')] then
    open = open + 1
  else
    redis.call('ZREM', KEYS[5], id)
  end
end
local limit = tonumber(ARGV[5])
if limit >= 0 and open >= limit then return open end
redis.call('HSET', KEYS[1], unpack(ARGV, 8))
redis.call('EXPIRE', KEYS[1], ARGV[4])
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
redis.call('ZADD', KEYS[3], ARGV[3], ARGV[1])
redis.call('ZADD', KEYS[4], ARGV[2], ARGV[1])
redis.call('ZADD', KEYS[5], ARGV[3], ARGV[1])
redis.call('EXPIRE', KEYS[4], ARGV[7])
redis.call('EXPIRE', KEYS[5], ARGV[7])
return -1
"""


class _NoWorker(Exception):
    """A line's model has no live worker now: the line (``waiter``, its job id) waits for
    one, recorded as waiting for ``model`` (``coordinator/waiting.py``)."""

    def __init__(self, message: str, model: str, waiter: str) -> None:
        super().__init__(message)
        self.model = model
        self.waiter = waiter


class _LeaseLost(Exception):
    """Another process took the batch's creator lease (this one stalled past it)."""

#: OpenAI's ``metadata`` rule, the one every request field follows (``fields.Metadata``).
METADATA: TypeAdapter[dict[str, str]] = TypeAdapter(Metadata)

_TIMESTAMPS = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
               "cancelling_at", "cancelled_at")


class BatchStore:
    """The batches of one deployment, kept in its Redis, and (``files``) the Files API they
    read their input from and write their output to.

    Every method that reads or acts on objects takes the ``tenant`` asking (the operator's
    view unless told otherwise: the gateway always tells it)."""

    def __init__(self, coordinator: Coordinator,
                 aliases: dict[str, str] | None = None) -> None:
        self.coordinator = coordinator
        #: Model aliases a line's body may name (the gateway's ``--model-alias``).
        self.aliases = aliases or {}
        self.conn = coordinator.connection
        self.keys = coordinator.keys
        self.ttl = coordinator.settings.result_ttl_seconds
        self.window = coordinator.settings.batch_window_seconds
        self._move = self.conn.register_script(_MOVE_LUA)
        self._renew = self.conn.register_script(_RENEW_LUA)
        self._attempt = self.conn.register_script(_ATTEMPT_LUA)
        self._create = self.conn.register_script(_CREATE_LUA)
        self._stopping = threading.Event()
        #: Uploads and this store's batches' result files (OpenAI's ``/v1/files``).
        self.files = FileStore(self.conn, self.keys, self.ttl, self)

    def stop(self) -> None:
        """Make every :meth:`advance` of this process let go at its next line or look for a
        worker (the process is stopping: its lease lapses and another carries on)."""
        self._stopping.set()

    # -- batches -----------------------------------------------------------------------------
    def create(self, input_file_id: str, endpoint: str,
               completion_window: str = COMPLETION_WINDOW,
               metadata: dict[str, str] | None = None,
               model: str | None = None, *, tenant: Tenant = OPERATOR) -> dict[str, Any]:
        """Create a batch of the lines of its input file, owned by ``tenant``, ``validating``:
        its lines are queued by :meth:`advance` afterwards (the caller's, or any gateway's
        pump). Refused at once: a bad field, an input that is a batch's result file, one the
        tenant does not see, an empty or oversized file, two lines with one ``custom_id``,
        and a batch past the tenant's open-batches quota (429).

        ``model`` fills in lines whose body names none (``specfleet batch --model``)."""
        if endpoint not in requests.ENDPOINTS:
            raise StoreError(f"endpoint must be one of {', '.join(requests.ENDPOINTS)}",
                             param="endpoint")
        if completion_window != COMPLETION_WINDOW:
            raise StoreError(f"completion_window must be '{COMPLETION_WINDOW}'",
                             param="completion_window")
        if metadata is not None:
            try:
                metadata = METADATA.validate_python(metadata, strict=True)
            except ValidationError as exc:
                raise StoreError(f"metadata: {describe_validation_error(exc, subject=None)}",
                                 param="metadata") from None
        if batch_of_file(input_file_id)[0] is not None:
            raise StoreError(f"{input_file_id} is a batch's output or error file: a batch's "
                             "input is a file uploaded with purpose 'batch'",
                             param="input_file_id")
        try:
            raw_lines = jsonl_lines(self.files.content(input_file_id, tenant=tenant))
        except StoreError as exc:
            raise StoreError(str(exc), exc.status, "input_file_id") from None
        if not raw_lines:
            raise StoreError(f"input file {input_file_id} has no lines", param="input_file_id")
        if len(raw_lines) > MAX_BATCH_LINES:
            raise StoreError(f"input file has {len(raw_lines)} lines; a batch holds at most "
                             f"{MAX_BATCH_LINES}", param="input_file_id")
        _check_unique(raw_lines)
        now = int(time.time())
        batch_id = f"batch_{uuid.uuid4().hex}"
        meta = {"id": batch_id, "endpoint": endpoint, "input_file_id": input_file_id,
                "completion_window": completion_window, "metadata": metadata,
                "created_at": now, "expires_at": now + self.window, "model": model}
        self._store_batch(meta, len(raw_lines), tenant)
        log.info("batch.created", batch_id=batch_id, lines=len(raw_lines), endpoint=endpoint,
                 owner=tenant.owner)
        return self.get(batch_id, tenant=tenant)

    def _store_batch(self, meta: dict[str, Any], total: int, tenant: Tenant) -> None:
        """Write a new batch's hash and its listings, unless its owner has as many batches
        open as its quota allows (429)."""
        batch_id, owner = meta["id"], tenant.owner
        fields: dict[str, str | int] = {"meta": json.dumps(meta), "status": "validating",
                                        "owner": owner, "total": total, "queued": 0,
                                        "completed": 0, "failed": 0, "invalid": 0,
                                        "generated_tokens": 0}
        limit = tenant.quota.open_batches if tenant.quota is not None else -1
        open_batches = int(self._create(
            keys=[self.keys.batch(batch_id), self.keys.batches(), self.keys.open_batches(),
                  self.keys.owner_batches(owner), self.keys.owner_open_batches(owner)],
            args=[batch_id, meta["created_at"], meta["expires_at"], self.ttl, limit,
                  self.keys.batch(""), self.window + self.ttl,
                  *itertools.chain.from_iterable(fields.items())]))
        if open_batches >= 0:
            raise StoreError(f"this API key has {open_batches} batches open, as many as "
                             f"SPECFLEET_MAX_OPEN_BATCHES_PER_KEY ({limit}) allows: wait for "
                             "one to end, or cancel one", status=429, param="input_file_id",
                             code="quota_exceeded")

    def needing_care(self) -> list[str]:
        """Open batches that someone must carry on: lines left to queue, or a window past
        (:meth:`advance` them); batches that have ended leave the set here. A batch whose
        counts are unreadable is due too: advancing it fails it, instead of it stopping
        every pump's look."""
        entries: list[tuple[Any, float]] = self.conn.zrange(  # type: ignore[assignment]
            self.keys.open_batches(), 0, -1, withscores=True)
        if not entries:
            return []
        pipe = self.conn.pipeline(transaction=False)
        for raw_id, _ in entries:
            pipe.hmget(self.keys.batch(text(raw_id)), "status", "queued", "total")
        now, due, ended = time.time(), [], []
        for (raw_id, expires_at), (status, queued, total) in zip(entries, pipe.execute(),
                                                                 strict=True):
            batch_id = text(raw_id)
            if status is None or text(status) not in OPEN:
                ended.append(batch_id)
            elif now > expires_at or _behind(queued, total):
                due.append(batch_id)
        if ended:
            self.conn.zrem(self.keys.open_batches(), *ended)
        return due

    def advance(self, batch_id: str) -> bool:
        """Carry a batch on from where it stands, holding its creator lease: queue its lines
        from the first one not queued yet (it becomes ``in_progress`` at the first), a line
        whose model has no live worker waiting for one; once the window has passed,
        :meth:`_expire` it. True once every line is queued or the batch has ended; False
        when another process holds the lease (or took it from this one), after
        :meth:`stop`, or after an unexpected failure outside any line that has not yet
        failed the batch. A Redis error passes through: calling again resumes where this
        call stopped."""
        lease, token = self.keys.batch_creator(batch_id), _lease_token()
        lease_ms = int(CREATOR_LEASE_SECONDS * 1000)
        if not self.conn.set(lease, token, nx=True, px=lease_ms):
            return False

        def renew() -> None:
            if not self._renew(keys=[lease], args=[token, lease_ms]):
                raise _LeaseLost(batch_id)

        try:
            return self._carry_on(batch_id, renew)
        except _LeaseLost:
            log.warning("batch.lease_lost", batch_id=batch_id)
            return False
        except (RedisError, RedisOutage):
            raise
        except Exception as exc:  # noqa: BLE001  corrupt batch data or a bug: bounded retries
            return self._advance_failed(batch_id, exc)
        finally:
            with contextlib.suppress(RedisError):  # unreachable: the lease lapses by itself
                if text(self.conn.get(lease)) == token:
                    self.conn.delete(lease)

    def _carry_on(self, batch_id: str, renew: Callable[[], None]) -> bool:
        """:meth:`advance`'s work under the lease: one line at a time, each taken (booked in
        the batch's hash) before it is parsed and booked off if this call lets go of it."""
        key = self.keys.batch(batch_id)
        raw_meta, queued, total, status = self.conn.hmget(key, "meta", "queued", "total",
                                                         "status")
        if raw_meta is None or text(status) not in OPEN:
            return True
        meta = json.loads(raw_meta)
        start, total_lines = int(queued or 0), int(total or 0)
        if start < total_lines:
            self._move_batch(batch_id, "in_progress", "validating")
        lines = self._lines_or_none(meta["input_file_id"], total_lines)
        waiting_since: float | None = None
        waiting: _NoWorker | None = None  # the line waiting for a worker, while one does
        number, taken, died = start + 1, 0, 0
        try:
            while not self._stopping.is_set():
                renew()
                status = self.conn.hget(key, "status")
                if time.time() > meta["expires_at"] and text(status) != "cancelling":
                    self._expire(batch_id, meta, lines, renew)
                    return True
                if number > total_lines:
                    return True
                cancelled = text(status) == "cancelling"
                if not cancelled and taken != number:
                    taken, died = number, int(self._attempt(keys=[key], args=[number, 1])) - 1
                try:
                    # only the first line of a takeover can have been half done by a dead one
                    self._take_line(batch_id, meta, number, lines[number - 1],
                                    resumed=number == start + 1, cancelled=cancelled, died=died)
                except _NoWorker as exc:
                    self.coordinator.waiting.touch(exc.model, exc.waiter)
                    waiting = exc
                    if waiting_since is None:
                        waiting_since = time.monotonic()
                        log.warning("batch.waiting_for_worker", batch_id=batch_id, line=number,
                                    reason=str(exc), expires_at=meta["expires_at"])
                    self._stopping.wait(WORKER_WAIT_SECONDS)
                    continue
                if waiting_since is not None:
                    log.info("batch.worker_found", batch_id=batch_id, line=number,
                             waited_seconds=round(time.monotonic() - waiting_since, 2))
                    if waiting is not None:
                        self.coordinator.waiting.leave(waiting.model, waiting.waiter)
                    waiting_since, waiting = None, None
                self._line_done(key, number)
                taken, number = 0, number + 1
            return False
        finally:
            if taken:  # letting go alive (a stop, a lost lease, Redis away): not a death
                with contextlib.suppress(RedisError, RedisOutage):
                    self._attempt(keys=[key], args=[taken, -1])

    def _line_done(self, key: str, number: int) -> None:
        """Lines up to ``number`` are queued or accounted; the attempt record goes with it."""
        pipe = self.conn.pipeline(transaction=True)
        pipe.hset(key, "queued", number)
        pipe.hdel(key, "attempt_line", "attempts")
        pipe.execute()

    def _advance_failed(self, batch_id: str, exc: Exception) -> bool:
        """Count an unexpected failure outside any line; at :data:`MAX_BATCH_FAILURES` the
        batch is ``failed`` with OpenAI's ``errors`` object (True), else the next call tries
        again (False)."""
        failures = int(self.conn.hincrby(self.keys.batch(batch_id), "pump_failures", 1))
        log.error("batch.advance_error", batch_id=batch_id, error_type=type(exc).__name__,
                  error=str(exc), failures=failures, limit=MAX_BATCH_FAILURES)
        if failures < MAX_BATCH_FAILURES:
            return False
        message = (f"the batch pump failed {failures} times outside any line "
                   f"({type(exc).__name__}); the batch is failed")
        errors = {"object": "list", "data": [{"code": "batch_pump_failed", "message": message,
                                              "line": None, "param": None}]}
        if self._move_batch(batch_id, "failed", *OPEN, errors=json.dumps(errors)):
            log.error("batch.failed", batch_id=batch_id, error_type=type(exc).__name__,
                      failures=failures)
        self.conn.zrem(self.keys.open_batches(), batch_id)
        return True

    def _move_batch(self, batch_id: str, status: str, *from_statuses: str,
                    errors: str = "") -> bool:
        """Move a batch to ``status`` (stamping ``{status}_at``) only from ``from_statuses``."""
        return bool(self._move(keys=[self.keys.batch(batch_id)],
                               args=[status, f"{status}_at", errors, *from_statuses]))

    def _lines_or_none(self, input_file_id: str, total: int) -> list[bytes | None]:
        """The input file's lines, or None for each when the file was deleted meanwhile."""
        try:
            return list(jsonl_lines(self.files.content(input_file_id)))
        except StoreError:
            return [None] * total

    def _expire(self, batch_id: str, meta: dict[str, Any], lines: Sequence[bytes | None],
                renew: Callable[[], None]) -> None:
        """The window has passed: the batch is ``expired``; the lines not queued yet and the
        jobs not finished are withdrawn (their lines ``batch_expired``), finished lines stay."""
        key = self.keys.batch(batch_id)
        if not self._move_batch(batch_id, "expired", "validating", "in_progress"):
            return  # it ended (or is being cancelled) meanwhile
        queued = int(self.conn.hget(key, "queued") or 0)
        for number in range(queued + 1, len(lines) + 1):
            renew()
            self._take_line(batch_id, meta, number, lines[number - 1], resumed=True,
                            cancelled=True, died=0)
            self._line_done(key, number)
        done = {int(n) for n in self.conn.hkeys(self.keys.batch_results(batch_id))}
        withdrawn = 0
        for number, record in self._records(batch_id).items():
            if record["job_id"] is not None and number not in done:
                renew()
                with contextlib.suppress(LookupError, ValueError):  # ended meanwhile
                    self.coordinator.cancel(record["job_id"])
                    withdrawn += 1
        self.conn.zrem(self.keys.open_batches(), batch_id)
        log.warning("batch.expired", batch_id=batch_id, not_queued=len(lines) - queued,
                    withdrawn=withdrawn)

    def _take_line(self, batch_id: str, meta: dict[str, Any], number: int,
                   raw: bytes | None, *, resumed: bool, cancelled: bool, died: int) -> None:
        """One line's turn. A takeover's first line (``resumed``) may already be done. A
        batch being cancelled (or expired) accounts it cancelled unparsed; a line ``died``
        pumps took and never finished is failed unparsed; else it is parsed and queued, and
        an unexpected exception doing so fails it. ``_NoWorker``: it waits for a worker."""
        if resumed and self._done_before(batch_id, number):
            return
        if cancelled:
            job_id = _job_id(batch_id, number)
            self._register(batch_id, number, {"custom_id": _custom_id(raw), "job_id": job_id})
            self._writer(job_id).final(status=JobStatus.CANCELLED, finish_reason="cancelled")
        elif died >= MAX_LINE_ATTEMPTS:
            log.error("batch.line_poisoned", batch_id=batch_id, line=number, attempts=died)
            self._fail_line(batch_id, number, _custom_id(raw), (
                f"line {number}: the batch pump died {died} times on this line; it is failed "
                "and the batch carries on"))
        else:
            try:
                self._queue_line(batch_id, meta, number, raw)
            except (_NoWorker, RedisError, RedisOutage):
                raise
            except Exception as exc:  # noqa: BLE001  one line's failure is that line's
                log.error("batch.line_error", batch_id=batch_id, line=number,
                          error_type=type(exc).__name__, error=str(exc))
                self._fail_line(batch_id, number, _custom_id(raw), (
                    f"line {number}: the batch pump failed on this line "
                    f"({type(exc).__name__}); it is failed and the batch carries on"))

    def _done_before(self, batch_id: str, number: int) -> bool:
        """Whether a pump that died already took the line to its end: accounted it, or
        queued its job (whose record then gets the job id that pump did not write)."""
        if self.conn.hexists(self.keys.batch_results(batch_id), str(number)):
            return True
        job_id = _job_id(batch_id, number)
        if not Job.exists(job_id, connection=self.conn):
            return False
        record = self.conn.hget(self.keys.batch_jobs(batch_id), str(number))
        self.conn.hset(self.keys.batch_jobs(batch_id), str(number),
                       json.dumps({**json.loads(record or "{}"), "job_id": job_id}))
        return True

    def _queue_line(self, batch_id: str, meta: dict[str, Any], number: int,
                    raw: bytes | None) -> None:
        """Turn one input line into a job, or account it as failed with its reason;
        ``_NoWorker`` when the line's model has no live worker now (nothing is recorded as
        failed: it waits). Job ids follow from the batch and the line, so a takeover finds
        what the dead creator had already done for the line and does not do it twice."""
        if raw is None:
            self._fail_line(batch_id, number, None, f"line {number}: the input file was "
                            "deleted before the line was queued")
            return
        custom_id, parsed = _parse_line(meta["endpoint"], number, raw, meta.get("model"),
                                        self.aliases)
        if isinstance(parsed, str):
            self._fail_line(batch_id, number, custom_id, parsed)
            return
        job_id = _job_id(batch_id, number)
        record: dict[str, Any] = {"custom_id": custom_id, "job_id": None, "model": parsed.model}
        if isinstance(parsed, embeddings_api.Embeddings):
            record["encoding_format"] = parsed.encoding_format
            submit = functools.partial(self.coordinator.submit_task, parsed.request,
                                       job_id=job_id)
        else:
            choice = parsed.choices[0]
            record.update(echo=choice.echo, tool_calls=choice.tool_calls)
            submit = functools.partial(self.coordinator.submit, choice.request, job_id=job_id)
        self._register(batch_id, number, record)
        try:
            submit()
        except SubmitError as exc:
            if exc.reason in ("no_worker", "coming"):  # known or coming: it waits
                raise _NoWorker(str(exc), exc.model or parsed.model, job_id) from None
            self._fail_line(batch_id, number, custom_id, f"line {number}: {exc}")
            return
        self.conn.hset(self.keys.batch_jobs(batch_id), str(number),
                       json.dumps({**record, "job_id": job_id}))

    def _register(self, batch_id: str, number: int, record: dict[str, Any]) -> None:
        """Record a line (its custom id, its job once queued) and its job's line reference,
        which the final-event script accounts the line by."""
        jobs, results = self.keys.batch_jobs(batch_id), self.keys.batch_results(batch_id)
        ref = {"line": number, "batch": self.keys.batch(batch_id), "ttl": self.ttl,
               "results": results, "keep": [self.keys.batch(batch_id), results, jobs]}
        pipe = self.conn.pipeline(transaction=True)
        pipe.set(self.keys.job_batch(_job_id(batch_id, number)), json.dumps(ref),
                 ex=self.coordinator.settings.stream_ttl_seconds)
        pipe.hset(jobs, str(number), json.dumps(record))
        pipe.expire(jobs, self.ttl)
        pipe.execute()

    def _fail_line(self, batch_id: str, number: int, custom_id: str | None,
                   error: str) -> None:
        """Account a line that never became a job as failed, saying why."""
        self._register(batch_id, number, {"custom_id": custom_id, "job_id": None})
        self.conn.hincrby(self.keys.batch(batch_id), "invalid", 1)
        self._writer(_job_id(batch_id, number)).final(status=JobStatus.FAILED, error=error)

    def _writer(self, job_id: str) -> EventWriter:
        return EventWriter.for_job(self.conn, self.coordinator.settings, job_id, 1)

    def get(self, batch_id: str, *, tenant: Tenant = OPERATOR) -> dict[str, Any]:
        """The batch object (OpenAI's shape, plus ``specfleet`` progress figures), if
        ``tenant`` sees it: another's batch is "no such batch", as a missing one."""
        raw = {text(k): text(v) for k, v in
               self.conn.hgetall(self.keys.batch(batch_id)).items()}
        if "meta" not in raw or not tenant.sees(raw.get("owner") or ANONYMOUS):
            raise StoreError(f"no such batch: {batch_id}", status=404, param="batch_id")
        meta = json.loads(raw["meta"])
        status = raw["status"]
        if status not in TERMINAL and time.time() > meta["expires_at"]:
            status = "expired"
        counts = {name: int(raw.get(name, 0)) for name in ("total", "completed", "failed")}
        terminal = status in TERMINAL
        has_output = terminal and counts["completed"] > 0
        has_errors = terminal and counts["failed"] > 0
        return {
            "id": batch_id, "object": "batch", "endpoint": meta["endpoint"],
            "errors": json.loads(raw["errors"]) if "errors" in raw else None,
            "input_file_id": meta["input_file_id"],
            "completion_window": meta["completion_window"], "status": status,
            "output_file_id": result_file_id(batch_id, "output") if has_output else None,
            "error_file_id": result_file_id(batch_id, "errors") if has_errors else None,
            "created_at": meta["created_at"], "expires_at": meta["expires_at"],
            **{name: int(raw[name]) if name in raw else None for name in _TIMESTAMPS},
            "request_counts": counts, "metadata": meta["metadata"],
            "specfleet": {"invalid": int(raw.get("invalid", 0)),
                          "generated_tokens": int(raw.get("generated_tokens", 0))},
        }

    def list(self, limit: int = 20, after: str | None = None, *,
             tenant: Tenant = OPERATOR) -> list[dict[str, Any]]:
        """The batches ``tenant`` sees (an admin: everyone's), newest first; ``after``
        continues a listing after that batch."""
        index = self.keys.batches() if tenant.admin else self.keys.owner_batches(tenant.owner)
        return listing(self.conn, index, self.get, limit, after,
                       lambda batch_id: self.conn.zrem(index, batch_id))

    def cancel(self, batch_id: str, *, tenant: Tenant = OPERATOR) -> dict[str, Any]:
        """Stop a batch: queued jobs are withdrawn, running ones stop at their next step, lines
        not queued yet are accounted cancelled unparsed; it is ``cancelling`` until every line
        is accounted, then ``cancelled``."""
        batch = self.get(batch_id, tenant=tenant)
        if batch["status"] in TERMINAL or batch["status"] == "cancelling":
            return batch
        self.conn.hset(self.keys.batch(batch_id), mapping={"status": "cancelling",
                                                           "cancelling_at": int(time.time())})
        for record in self._records(batch_id).values():
            if record["job_id"] is None:
                continue
            # a job that already ended has its final event accounted (or on its way)
            with contextlib.suppress(LookupError, ValueError):
                self.coordinator.cancel(record["job_id"])
        return self.get(batch_id, tenant=tenant)

    def _records(self, batch_id: str) -> dict[int, dict[str, Any]]:
        return {int(k): json.loads(v)
                for k, v in self.conn.hgetall(self.keys.batch_jobs(batch_id)).items()}

    def result_lines(self, batch_id: str, which: Literal["output", "errors", "all"], *,
                     tenant: Tenant = OPERATOR) -> Iterator[dict[str, Any]]:
        """The batch's output lines, error lines, or both, in input order."""
        batch = self.get(batch_id, tenant=tenant)
        records = self._records(batch_id)
        results = {int(k): FinalEvent.model_validate_json(v)
                   for k, v in self.conn.hgetall(self.keys.batch_results(batch_id)).items()}
        for number in sorted(results):
            final, record = results[number], records.get(number, {})
            ok = final.status is JobStatus.FINISHED
            if which != "all" and ok != (which == "output"):
                continue
            yield _output_line(batch["endpoint"], number, record, final,
                               expired=batch["status"] == "expired")


def _custom_id(raw: bytes | None) -> str | None:
    """A line's ``custom_id`` read plainly (nothing else of the line is looked at), for the
    record of a line accounted without being parsed as a request."""
    line = json_value(raw)
    custom_id = line.get("custom_id") if isinstance(line, dict) else None
    return custom_id if isinstance(custom_id, str) else None


def _check_unique(raw_lines: Sequence[bytes]) -> None:
    """Refuse two lines with one ``custom_id`` (OpenAI's rule: results are matched to
    requests by it); lines that are not JSON objects are left to fail on their own."""
    seen: dict[str, int] = {}
    for number, raw in enumerate(raw_lines, 1):
        custom_id = _custom_id(raw)
        if custom_id is None:
            continue
        if custom_id in seen:
            raise StoreError(f"custom_id {custom_id!r} is on lines {seen[custom_id]} and "
                             f"{number}: each line needs its own", param="input_file_id")
        seen[custom_id] = number


def _behind(queued: object, total: object) -> bool:
    """Whether a batch has lines left to queue; True for counts that do not read as numbers
    (advancing such a batch fails it, see :meth:`BatchStore._advance_failed`)."""
    try:
        return int(text(queued) or 0) < int(text(total) or 0)
    except ValueError:
        return True


def _lease_token() -> str:
    """A creator lease's value: unique, and naming its holder (``HOST:PID:TOKEN``) for an
    operator who wants to know which process is queueing a batch."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex}"


def _job_id(batch_id: str, number: int) -> str:
    """The job of a batch's line: it follows from both, so no line is queued twice."""
    return f"{batch_id.removeprefix('batch_')}-{number}"


def _parse_line(endpoint: str, number: int, raw: bytes, model: str | None,
                aliases: dict[str, str],
                ) -> tuple[str | None, requests.Parsed | embeddings_api.Embeddings | str]:
    """``(custom_id, the body read)`` for a line that can be submitted (an embeddings
    line's body is a task's), else ``(custom_id or None, "line N: why")``."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, f"line {number}: not valid UTF-8 (byte {exc.start})"
    try:
        line = BatchLine.model_validate_json(text)
    except ValidationError as exc:
        return None, f"line {number}: {describe_validation_error(exc)}"
    if line.url is not None and line.url != endpoint:
        return line.custom_id, (f"line {number}: url {line.url!r} differs from the batch's "
                                f"endpoint {endpoint!r}")
    body = dict(line.body)
    if model is not None:
        body.setdefault("model", model)
    try:
        if endpoint == requests.EMBEDDINGS:
            return line.custom_id, embeddings_api.parse(body, aliases)
        parsed = requests.parse_body(endpoint, body, aliases)
    except RequestError as exc:
        return line.custom_id, f"line {number}: {exc}"
    if parsed.stream:
        return line.custom_id, f"line {number}: a batch line cannot stream"
    if len(parsed.choices) > 1:
        return line.custom_id, f"line {number}: a batch line is one job (n 1, one prompt)"
    return line.custom_id, parsed


def _output_line(endpoint: str, number: int, record: dict[str, Any], final: FinalEvent,
                 expired: bool = False) -> dict[str, Any]:
    """One line of an output or error file, in OpenAI's shape (plus the input ``line``); a
    line withdrawn when its batch ``expired`` is ``batch_expired``, as OpenAI reports it."""
    job_id = record.get("job_id")
    line: dict[str, Any] = {"id": f"batch_req_{final.job_id}",
                            "custom_id": record.get("custom_id"), "line": number}
    if final.status is JobStatus.FINISHED:
        model = record.get("model") or ""
        if endpoint == requests.EMBEDDINGS:
            body = embeddings_api.reply(model, record.get("encoding_format", "float"), final)
        else:
            parsed = requests.Parsed(endpoint, model, [requests.Choice(
                {}, echo=record.get("echo", ""), tool_calls=record.get("tool_calls", False))])
            body = replies.response_body(parsed, [final])
        return {**line, "response": {"status_code": 200, "request_id": job_id, "body": body},
                "error": None}
    if job_id is None:
        code, status = "invalid_request", 400
    elif final.status is JobStatus.CANCELLED and expired:
        code, status = "batch_expired", 408
        final = final.model_copy(update={"error": final.error or (
            f"line {number}: not run before the batch's completion window ended")})
    elif final.status is JobStatus.CANCELLED:
        code, status = "cancelled", 499
    else:
        code, status = "job_failed", 500
    message = final.error or (f"line {number}: job {final.status}" if job_id else "")
    if job_id and not message.startswith("line "):
        message = f"line {number}: {message}"
    error = {"code": code, "message": message}
    return {**line, "response": {"status_code": status, "request_id": job_id,
                                 "body": {"error": error}}, "error": error}
