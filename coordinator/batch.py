"""Batches that live in Redis (OpenAI's Batch API): files in, jobs, files out.

A batch advances with no client alive. Creating one checks its input file (JSON Lines, every
``custom_id`` its own, within the limits) and answers at once, ``validating``; its lines are
turned into jobs afterwards by :meth:`BatchStore.advance` (``in_progress`` from the first
line), which whoever holds the batch's short creator lease runs: the creating process, or any
gateway's batch pump when that one died (the lease lapses in seconds, job ids follow from the
batch and the line, so no line runs twice). A line whose model has no live worker (a rolling
restart) waits for one; once the batch's window (``SPECFLEET_BATCH_WINDOW_SECONDS``, OpenAI's
``24h``) has passed, the batch is ``expired``: lines not yet run are withdrawn and reported
``batch_expired``, the finished ones stay in its output. Each job's final event is accounted
to the batch by the script that appends it (``shared.event_stream``: counts, the line's
result, the batch's end), whoever writes it (a worker, a cancel of a queued job, crash
recovery). A line that cannot become a job (not UTF-8, not JSON, not a batch line, a request
the coordinator refuses) gets a failed final event through the same script, so there is one
way a line is accounted. Output and error files are assembled from Redis when they are read,
in input order. The HTTP gateway and ``specfleet batch`` both use :class:`BatchStore`; there
is no other implementation.

Redis keys (``shared.keys``): ``file:{id}`` (uploads), ``files`` (their listing),
``batch:{id}`` (status, counts, meta),
``batch:{id}:jobs`` (line -> custom id, job id, model), ``batch:{id}:results`` (line -> final
event), ``batch:{id}:creator`` (the queueing lease), ``job:{id}:batch`` (a job's line
reference, read by the script), ``batches`` (listing), ``batches:open`` (batches not ended,
by when their window closes: what the gateways' pumps look after).
Everything expires ``SPECFLEET_RESULT_TTL_SECONDS`` after the batch's last change.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

from pydantic import ValidationError
from redis.exceptions import RedisError
from rq.job import Job

from coordinator.client import Coordinator
from coordinator.openai_api import replies, requests
from coordinator.openai_api.fields import RequestError
from coordinator.validation import SubmitError
from shared.event_stream import EventWriter
from shared.logs import get_logger
from shared.protocol import BatchLine, FinalEvent, JobStatus, describe_validation_error
from shared.replies import text

log = get_logger("batch")

#: Largest input file, in bytes, and most lines in one batch.
MAX_FILE_BYTES = 32 * 1024 * 1024
MAX_BATCH_LINES = 10_000
#: The only completion window (OpenAI's); its length is ``Settings.batch_window_seconds``.
COMPLETION_WINDOW = "24h"
#: Seconds a batch's creator holds its lease without renewing it (renewed as it queues).
CREATOR_LEASE_SECONDS = 3.0
#: Seconds between two looks for a live worker while a line's model has none.
WORKER_WAIT_SECONDS = 1.0
#: Statuses after which a batch never changes again.
TERMINAL = frozenset({"failed", "completed", "expired", "cancelled"})
#: Statuses in which a batch still has lines to queue or jobs to wait for.
OPEN = ("validating", "in_progress", "cancelling")

#: Move a batch to status ARGV[1] (stamping field ARGV[2] with Redis's clock) only from one of
#: the statuses ARGV[3..]: a cancel or the last line's accounting may have moved it meanwhile.
_MOVE_LUA = """
local status = redis.call('HGET', KEYS[1], 'status')
for i = 3, #ARGV do
  if status == ARGV[i] then
    redis.call('HSET', KEYS[1], 'status', ARGV[1], ARGV[2], redis.call('TIME')[1])
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


class _NoWorker(Exception):
    """A line's model has no live worker now: the line waits for one."""


class _LeaseLost(Exception):
    """Another process took the batch's creator lease (this one stalled past it)."""

_TIMESTAMPS = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
               "cancelling_at", "cancelled_at")


class BatchError(ValueError):
    """A files/batches request that cannot be served; ``status`` is its HTTP status."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


class BatchStore:
    """Files and batches of one deployment, kept in its Redis."""

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
        self._stopping = threading.Event()

    def stop(self) -> None:
        """Make every :meth:`advance` of this process let go at its next line or look for a
        worker (the process is stopping: its lease lapses and another carries on)."""
        self._stopping.set()

    # -- files -------------------------------------------------------------------------------
    def upload(self, content: bytes, filename: str, purpose: str = "batch") -> dict[str, Any]:
        """Store an input file; returns its OpenAI file object. A file that is not JSON
        Lines at all is refused here (:func:`_check_jsonl`)."""
        if purpose != "batch":
            raise BatchError(f"purpose must be 'batch', not {purpose!r}", param="purpose")
        if len(content) > MAX_FILE_BYTES:
            raise BatchError(f"file of {len(content)} bytes exceeds the limit of "
                             f"{MAX_FILE_BYTES} bytes", status=413, param="file")
        _check_jsonl(content)
        file_id = f"file-{uuid.uuid4().hex}"
        info: dict[str, Any] = {"id": file_id, "object": "file", "bytes": len(content),
                "created_at": int(time.time()), "filename": filename[:256], "purpose": purpose,
                "status": "processed"}
        pipe = self.conn.pipeline(transaction=True)
        pipe.hset(self.keys.file(file_id), mapping={"meta": json.dumps(info), "content": content})
        pipe.expire(self.keys.file(file_id), self.ttl)
        pipe.zadd(self.keys.files(), {file_id: info["created_at"]})
        pipe.execute()
        return {**info, "expires_at": info["created_at"] + self.ttl}

    def files(self, limit: int = 20, after: str | None = None) -> list[dict[str, Any]]:
        """Uploaded files, newest first (``after``: continue after that file); a file whose
        TTL ran out leaves the listing when it is met."""
        return self._listing(self.keys.files(), self.file, limit, after)

    def _listing(self, index: str, fetch: Callable[[str], dict[str, Any]], limit: int,
                 after: str | None) -> list[dict[str, Any]]:
        """Up to ``limit`` objects of the sorted set ``index``, newest first, from after
        ``after``; an id whose object has expired is dropped from the set."""
        ids = [text(i) for i in self.conn.zrevrange(index, 0, -1)]
        if after is not None and after in ids:
            ids = ids[ids.index(after) + 1:]
        found: list[dict[str, Any]] = []
        for object_id in ids:
            if len(found) >= limit:
                break
            try:
                found.append(fetch(object_id))
            except BatchError:  # expired: forget it
                self.conn.zrem(index, object_id)
        return found

    def delete_file(self, file_id: str) -> dict[str, Any]:
        """Delete an upload (a batch already created from it has its lines queued; one
        still queueing them reads the file and fails the lines it no longer finds)."""
        if _result_file(file_id)[0] is not None:
            raise BatchError(f"{file_id} is a batch's result file: it expires with its batch",
                             param="file_id")
        pipe = self.conn.pipeline(transaction=True)
        pipe.delete(self.keys.file(file_id))
        pipe.zrem(self.keys.files(), file_id)
        deleted, _ = pipe.execute()
        if not deleted:
            raise BatchError(f"no such file: {file_id}", status=404, param="file_id")
        return {"id": file_id, "object": "file", "deleted": True}

    def file(self, file_id: str) -> dict[str, Any]:
        """The file object of an upload or of a batch's output/error file."""
        batch_id, kind = _result_file(file_id)
        if batch_id is not None:
            content = self.content(file_id)
            batch = self.get(batch_id)
            return {"id": file_id, "object": "file", "bytes": len(content),
                    "created_at": batch.get("completed_at") or batch["created_at"],
                    "filename": f"{batch_id}_{kind}.jsonl", "purpose": "batch_output",
                    "status": "processed"}
        pipe = self.conn.pipeline(transaction=False)
        pipe.hget(self.keys.file(file_id), "meta")
        pipe.ttl(self.keys.file(file_id))
        raw, ttl = pipe.execute()
        if raw is None:
            raise BatchError(f"no such file: {file_id}", status=404, param="file_id")
        # OpenAI's expires_at: when the file's TTL ends
        return {**json.loads(raw), "expires_at": int(time.time()) + max(int(ttl), 0)}

    def content(self, file_id: str) -> bytes:
        """An upload's bytes, or a batch's output/error file assembled from its results."""
        batch_id, kind = _result_file(file_id)
        if batch_id is not None:
            lines = self.result_lines(batch_id, "errors" if kind == "errors" else "output")
            return "".join(json.dumps(line) + "\n" for line in lines).encode()
        raw = self.conn.hget(self.keys.file(file_id), "content")
        if raw is None:
            raise BatchError(f"no such file: {file_id}", status=404, param="file_id")
        return raw.encode() if isinstance(raw, str) else raw

    # -- batches -----------------------------------------------------------------------------
    def create(self, input_file_id: str, endpoint: str,
               completion_window: str = COMPLETION_WINDOW,
               metadata: dict[str, str] | None = None,
               model: str | None = None) -> dict[str, Any]:
        """Create a batch of the lines of its input file, ``validating``: its lines are queued
        by :meth:`advance` afterwards (the caller's, or any gateway's pump). Refused at once:
        a bad field, an empty or oversized file, two lines with one ``custom_id``.

        ``model`` fills in lines whose body names none (``specfleet batch --model``)."""
        if endpoint not in requests.ENDPOINTS:
            raise BatchError(f"endpoint must be one of {', '.join(requests.ENDPOINTS)}",
                             param="endpoint")
        if completion_window != COMPLETION_WINDOW:
            raise BatchError(f"completion_window must be '{COMPLETION_WINDOW}'",
                             param="completion_window")
        if metadata is not None and not _valid_metadata(metadata):
            raise BatchError("metadata: at most 16 string pairs (keys <= 64, values <= 512 "
                             "characters)", param="metadata")
        raw_lines = self._input_lines(input_file_id)
        if not raw_lines:
            raise BatchError(f"input file {input_file_id} has no lines", param="input_file_id")
        if len(raw_lines) > MAX_BATCH_LINES:
            raise BatchError(f"input file has {len(raw_lines)} lines; a batch holds at most "
                             f"{MAX_BATCH_LINES}", param="input_file_id")
        _check_unique(raw_lines)
        now = int(time.time())
        expires_at = now + self.window
        batch_id = f"batch_{uuid.uuid4().hex}"
        meta = {"id": batch_id, "endpoint": endpoint, "input_file_id": input_file_id,
                "completion_window": completion_window, "metadata": metadata,
                "created_at": now, "expires_at": expires_at, "model": model}
        key = self.keys.batch(batch_id)
        pipe = self.conn.pipeline(transaction=True)
        pipe.hset(key, mapping={"meta": json.dumps(meta), "status": "validating",
                                "total": len(raw_lines), "queued": 0,
                                "completed": 0, "failed": 0, "invalid": 0,
                                "generated_tokens": 0})
        pipe.expire(key, self.ttl)
        pipe.zadd(self.keys.batches(), {batch_id: now})
        pipe.zadd(self.keys.open_batches(), {batch_id: expires_at})
        pipe.execute()
        log.info("batch.created", batch_id=batch_id, lines=len(raw_lines), endpoint=endpoint)
        return self.get(batch_id)

    def _input_lines(self, input_file_id: str) -> list[bytes]:
        return [line for line in self.content(input_file_id).split(b"\n") if line.strip()]

    def needing_care(self) -> list[str]:
        """Open batches that someone must carry on: lines left to queue, or a window past
        (:meth:`advance` them); batches that have ended leave the set here."""
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
            elif now > expires_at or int(queued or 0) < int(total or 0):
                due.append(batch_id)
        if ended:
            self.conn.zrem(self.keys.open_batches(), *ended)
        return due

    def advance(self, batch_id: str) -> bool:
        """Carry a batch on from where it stands, holding its creator lease: queue its lines
        from the first one not queued yet (it becomes ``in_progress`` at the first), a line
        whose model has no live worker waiting for one; once the window has passed,
        :meth:`_expire` it. True once every line is queued or the batch has ended; False
        when another process holds the lease (or took it from this one), or after
        :meth:`stop`. A Redis error passes through: calling again resumes where this call
        stopped."""
        lease, token = self.keys.batch_creator(batch_id), uuid.uuid4().hex
        lease_ms = int(CREATOR_LEASE_SECONDS * 1000)
        if not self.conn.set(lease, token, nx=True, px=lease_ms):
            return False

        def renew() -> None:
            if not self._renew(keys=[lease], args=[token, lease_ms]):
                raise _LeaseLost(batch_id)

        key = self.keys.batch(batch_id)
        try:
            raw_meta, queued, total, status = self.conn.hmget(key, "meta", "queued", "total",
                                                             "status")
            if raw_meta is None or text(status) not in OPEN:
                return True
            meta = json.loads(raw_meta)
            start, total_lines = int(queued or 0), int(total or 0)
            if start < total_lines:
                self._move(keys=[key], args=["in_progress", "in_progress_at", "validating"])
            lines = self._lines_or_none(meta["input_file_id"], total_lines)
            waiting_since: float | None = None
            number = start + 1
            while not self._stopping.is_set():
                renew()
                status = self.conn.hget(key, "status")
                if time.time() > meta["expires_at"] and text(status) != "cancelling":
                    self._expire(batch_id, meta, lines, renew)
                    return True
                if number > total_lines:
                    return True
                try:
                    # only the first line of a takeover can have been half done by a dead one
                    self._queue_line(batch_id, meta, number, lines[number - 1],
                                     resumed=number == start + 1,
                                     cancelled=text(status) == "cancelling")
                except _NoWorker as exc:
                    if waiting_since is None:
                        waiting_since = time.monotonic()
                        log.warning("batch.waiting_for_worker", batch_id=batch_id, line=number,
                                    reason=str(exc), expires_at=meta["expires_at"])
                    self._stopping.wait(WORKER_WAIT_SECONDS)
                    continue
                if waiting_since is not None:
                    log.info("batch.worker_found", batch_id=batch_id, line=number,
                             waited_seconds=round(time.monotonic() - waiting_since, 2))
                    waiting_since = None
                self.conn.hset(key, "queued", number)
                number += 1
            return False
        except _LeaseLost:
            log.warning("batch.lease_lost", batch_id=batch_id)
            return False
        finally:
            with contextlib.suppress(RedisError):  # unreachable: the lease lapses by itself
                if text(self.conn.get(lease)) == token:
                    self.conn.delete(lease)

    def _lines_or_none(self, input_file_id: str, total: int) -> list[bytes | None]:
        """The input file's lines, or None for each when the file was deleted meanwhile."""
        try:
            return list(self._input_lines(input_file_id))
        except BatchError:
            return [None] * total

    def _expire(self, batch_id: str, meta: dict[str, Any], lines: Sequence[bytes | None],
                renew: Callable[[], None]) -> None:
        """The window has passed: the batch is ``expired``; the lines not queued yet and the
        jobs not finished are withdrawn (their lines ``batch_expired``), finished lines stay."""
        key = self.keys.batch(batch_id)
        if not self._move(keys=[key], args=["expired", "expired_at", "validating",
                                            "in_progress"]):
            return  # it ended (or is being cancelled) meanwhile
        queued = int(self.conn.hget(key, "queued") or 0)
        for number in range(queued + 1, len(lines) + 1):
            renew()
            self._queue_line(batch_id, meta, number, lines[number - 1], resumed=True,
                             cancelled=True)
            self.conn.hset(key, "queued", number)
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

    def _queue_line(self, batch_id: str, meta: dict[str, Any], number: int,
                    raw: bytes | None, resumed: bool, cancelled: bool) -> None:
        """Turn one input line into a job, or account it as failed with its reason (or as
        cancelled, once the batch is being cancelled or has expired); ``_NoWorker`` when
        the line's model has no live worker now (nothing is recorded as failed: it waits).

        Job ids follow from the batch and the line, so a takeover (``resumed``) finds what
        the dead creator had already done for the line and does not do it twice."""
        job_id = f"{batch_id.removeprefix('batch_')}-{number}"
        jobs, results = self.keys.batch_jobs(batch_id), self.keys.batch_results(batch_id)
        custom_id, parsed, error = (None, None, f"line {number}: the input file was deleted "
                                    "before the line was queued") if raw is None else \
            _parse_line(meta["endpoint"], number, raw, meta.get("model"), self.aliases)
        request = parsed.choices[0].request if parsed is not None else None
        record = {"custom_id": custom_id, "job_id": None,
                  "model": parsed.model if parsed is not None else None,
                  "echo": parsed.choices[0].echo if parsed is not None else "",
                  "tool_calls": parsed is not None and parsed.choices[0].tool_calls}
        if resumed and (self.conn.hexists(results, str(number))
                        or Job.exists(job_id, connection=self.conn)):
            if error is None and not self.conn.hexists(results, str(number)):
                self.conn.hset(jobs, str(number), json.dumps({**record, "job_id": job_id}))
            return
        ref = {"line": number, "batch": self.keys.batch(batch_id), "ttl": self.ttl,
               "results": results, "keep": [self.keys.batch(batch_id), results, jobs]}
        pipe = self.conn.pipeline(transaction=True)
        pipe.set(self.keys.job_batch(job_id), json.dumps(ref),
                 ex=self.coordinator.settings.stream_ttl_seconds)
        pipe.hset(jobs, str(number), json.dumps(record))
        pipe.expire(jobs, self.ttl)
        pipe.execute()
        writer = EventWriter.for_job(self.conn, self.coordinator.settings, job_id, 1)
        if cancelled and error is None:
            writer.final(status=JobStatus.CANCELLED, finish_reason="cancelled")
            self.conn.hset(jobs, str(number), json.dumps({**record, "job_id": job_id}))
            return
        if request is not None:  # a line without an error is a request
            try:
                self.coordinator.submit(request, job_id=job_id)
                self.conn.hset(jobs, str(number), json.dumps({**record, "job_id": job_id}))
                return
            except SubmitError as exc:
                if exc.reason == "no_worker":
                    raise _NoWorker(str(exc)) from None
                error = f"line {number}: {exc}"
        self.conn.hincrby(self.keys.batch(batch_id), "invalid", 1)
        writer.final(status=JobStatus.FAILED, error=error)

    def get(self, batch_id: str) -> dict[str, Any]:
        """The batch object (OpenAI's shape, plus ``specfleet`` progress figures)."""
        raw = {text(k): text(v) for k, v in
               self.conn.hgetall(self.keys.batch(batch_id)).items()}
        if "meta" not in raw:
            raise BatchError(f"no such batch: {batch_id}", status=404, param="batch_id")
        meta = json.loads(raw["meta"])
        status = raw["status"]
        if status not in TERMINAL and time.time() > meta["expires_at"]:
            status = "expired"
        counts = {name: int(raw.get(name, 0)) for name in ("total", "completed", "failed")}
        terminal = status in TERMINAL
        has_output = terminal and counts["completed"] > 0
        has_errors = terminal and counts["failed"] > 0
        return {
            "id": batch_id, "object": "batch", "endpoint": meta["endpoint"], "errors": None,
            "input_file_id": meta["input_file_id"],
            "completion_window": meta["completion_window"], "status": status,
            "output_file_id": f"file-{batch_id}-output" if has_output else None,
            "error_file_id": f"file-{batch_id}-errors" if has_errors else None,
            "created_at": meta["created_at"], "expires_at": meta["expires_at"],
            **{name: int(raw[name]) if name in raw else None for name in _TIMESTAMPS},
            "request_counts": counts, "metadata": meta["metadata"],
            "specfleet": {"invalid": int(raw.get("invalid", 0)),
                          "generated_tokens": int(raw.get("generated_tokens", 0))},
        }

    def list(self, limit: int = 20, after: str | None = None) -> list[dict[str, Any]]:
        """Batches, newest first; ``after`` continues a listing after that batch."""
        return self._listing(self.keys.batches(), self.get, limit, after)

    def cancel(self, batch_id: str) -> dict[str, Any]:
        """Stop a batch: queued jobs are withdrawn, running ones stop at their next step; it
        is ``cancelling`` until every line is accounted, then ``cancelled``."""
        batch = self.get(batch_id)
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
        return self.get(batch_id)

    def _records(self, batch_id: str) -> dict[int, dict[str, Any]]:
        return {int(k): json.loads(v)
                for k, v in self.conn.hgetall(self.keys.batch_jobs(batch_id)).items()}

    def result_lines(self, batch_id: str,
                     which: Literal["output", "errors", "all"]) -> Iterator[dict[str, Any]]:
        """The batch's output lines, error lines, or both, in input order."""
        batch = self.get(batch_id)
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


def _valid_metadata(metadata: object) -> bool:
    """OpenAI's rule: at most 16 string pairs, keys up to 64 and values up to 512 characters."""
    return isinstance(metadata, dict) and len(metadata) <= 16 and all(
        isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
        for k, v in metadata.items())


def _check_jsonl(content: bytes) -> None:
    """Refuse a file that is not JSON Lines at all (an image, a spreadsheet, a JSON array):
    one holding a NUL byte (no JSON text does), or lines none of which is a JSON object. A
    file of objects with some broken lines is taken: each bad line fails on its own."""
    nul = content.find(b"\x00")
    if nul >= 0:
        raise BatchError(f"the file is not JSONL (one JSON object per line): byte {nul} is "
                         "NUL, so it is binary data", param="file")
    lines = [line for line in content.split(b"\n") if line.strip()]
    for line in lines:
        with contextlib.suppress(ValueError):  # JSON errors and bad UTF-8 alike
            if isinstance(json.loads(line), dict):
                return
    if lines:  # an empty file is refused at create, for having no lines
            raise BatchError("the file is not JSONL (one JSON object per line): no line is a "
                         "JSON object", param="file")


def _check_unique(raw_lines: Sequence[bytes]) -> None:
    """Refuse two lines with one ``custom_id`` (OpenAI's rule: results are matched to
    requests by it); lines that are not JSON objects are left to fail on their own."""
    seen: dict[str, int] = {}
    for number, raw in enumerate(raw_lines, 1):
        try:
            line = json.loads(raw)
        except ValueError:
            continue
        custom_id = line.get("custom_id") if isinstance(line, dict) else None
        if not isinstance(custom_id, str):
            continue
        if custom_id in seen:
            raise BatchError(f"custom_id {custom_id!r} is on lines {seen[custom_id]} and "
                             f"{number}: each line needs its own", param="input_file_id")
        seen[custom_id] = number


def _result_file(file_id: str) -> tuple[str | None, str]:
    """``(batch id, "output" | "errors")`` for a batch's result file id, else ``(None, "")``."""
    if file_id.startswith("file-batch_"):
        batch_id, _, kind = file_id[len("file-"):].rpartition("-")
        if kind in ("output", "errors"):
            return batch_id, kind
    return None, ""


def _parse_line(endpoint: str, number: int, raw: bytes, model: str | None,
                aliases: dict[str, str]) -> tuple[str | None, requests.Parsed | None, str | None]:
    """``(custom_id, the body read, None)`` for a line that can be submitted, else
    ``(custom_id or None, None, "line N: why")``."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, None, f"line {number}: not valid UTF-8 (byte {exc.start})"
    try:
        line = BatchLine.model_validate_json(text)
    except ValidationError as exc:
        return None, None, f"line {number}: {describe_validation_error(exc)}"
    if line.url is not None and line.url != endpoint:
        return line.custom_id, None, (f"line {number}: url {line.url!r} differs from the "
                                      f"batch's endpoint {endpoint!r}")
    body = dict(line.body)
    if model is not None:
        body.setdefault("model", model)
    try:
        parsed = requests.parse_body(endpoint, body, aliases)
    except RequestError as exc:
        return line.custom_id, None, f"line {number}: {exc}"
    if parsed.stream:
        return line.custom_id, None, f"line {number}: a batch line cannot stream"
    if len(parsed.choices) > 1:
        return line.custom_id, None, (f"line {number}: a batch line is one job (n 1, one "
                                      "prompt)")
    return line.custom_id, parsed, None


def _output_line(endpoint: str, number: int, record: dict[str, Any], final: FinalEvent,
                 expired: bool = False) -> dict[str, Any]:
    """One line of an output or error file, in OpenAI's shape (plus the input ``line``); a
    line withdrawn when its batch ``expired`` is ``batch_expired``, as OpenAI reports it."""
    job_id = record.get("job_id")
    line: dict[str, Any] = {"id": f"batch_req_{final.job_id}",
                            "custom_id": record.get("custom_id"), "line": number}
    if final.status is JobStatus.FINISHED:
        parsed = requests.Parsed(endpoint, record.get("model") or "",
                                 [requests.Choice({}, echo=record.get("echo", ""),
                                                  tool_calls=record.get("tool_calls", False))])
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
