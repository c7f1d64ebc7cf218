"""Batches that live in Redis (OpenAI's Batch API): files in, jobs, files out.

A batch advances with no client alive. Creating one turns every line of its input file into a
job at once; each job's final event is accounted to the batch by the script that appends it
(``worker.service.events``: counts, the line's result, the batch's end), whoever writes it (a
worker, a cancel of a queued job, crash recovery). A line that cannot become a job (not UTF-8,
not JSON, not a batch line, a request the coordinator refuses) gets a failed final event
through the same script, so there is one way a line is accounted. Output and error files are
assembled from Redis when they are read, in input order. The process creating a batch holds a
short lease while it queues the lines; if it dies half-way, the next reader of the batch (a
status poll, any gateway) takes the lease and queues the rest, with job ids derived from the
batch and the line so that no line runs twice. The HTTP gateway and
``specfleet batch`` both use :class:`BatchStore`; there is no other implementation.

Redis keys (``shared.keys``): ``file:{id}`` (uploads), ``files`` (their listing),
``batch:{id}`` (status, counts, meta),
``batch:{id}:jobs`` (line -> custom id, job id, model), ``batch:{id}:results`` (line -> final
event), ``batch:{id}:creator`` (the queueing lease), ``job:{id}:batch`` (a job's line
reference, read by the script), ``batches`` (listing).
Everything expires ``SPECFLEET_RESULT_TTL_SECONDS`` after the batch's last change.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, Literal

from pydantic import ValidationError
from rq.job import Job

from coordinator.client import Coordinator
from coordinator.openai_api import replies, requests
from coordinator.openai_api.fields import RequestError
from coordinator.validation import SubmitError
from shared.event_stream import EventWriter
from shared.protocol import BatchLine, FinalEvent, JobStatus, describe_validation_error
from shared.replies import text

#: Largest input file, in bytes, and most lines in one batch.
MAX_FILE_BYTES = 32 * 1024 * 1024
MAX_BATCH_LINES = 10_000
#: The only completion window (OpenAI's); a batch not done by then is reported ``expired``.
COMPLETION_WINDOW = "24h"
WINDOW_SECONDS = 24 * 3600
#: Seconds a batch's creator holds its lease without renewing it (renewed as it queues).
CREATOR_LEASE_SECONDS = 3.0
#: Statuses after which a batch never changes again.
TERMINAL = frozenset({"failed", "completed", "expired", "cancelled"})

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

    # -- files -------------------------------------------------------------------------------
    def upload(self, content: bytes, filename: str, purpose: str = "batch") -> dict[str, Any]:
        """Store an input file; returns its OpenAI file object."""
        if purpose != "batch":
            raise BatchError(f"purpose must be 'batch', not {purpose!r}", param="purpose")
        if len(content) > MAX_FILE_BYTES:
            raise BatchError(f"file of {len(content)} bytes exceeds the limit of "
                             f"{MAX_FILE_BYTES} bytes", status=413, param="file")
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
        """Create a batch and queue every line of its input file as a job.

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
        now = int(time.time())
        batch_id = f"batch_{uuid.uuid4().hex}"
        meta = {"id": batch_id, "endpoint": endpoint, "input_file_id": input_file_id,
                "completion_window": completion_window, "metadata": metadata,
                "created_at": now, "expires_at": now + WINDOW_SECONDS, "model": model}
        key = self.keys.batch(batch_id)
        pipe = self.conn.pipeline(transaction=True)
        pipe.hset(key, mapping={"meta": json.dumps(meta), "status": "in_progress",
                                "in_progress_at": now, "total": len(raw_lines), "queued": 0,
                                "completed": 0, "failed": 0, "invalid": 0,
                                "generated_tokens": 0})
        pipe.expire(key, self.ttl)
        pipe.zadd(self.keys.batches(), {batch_id: now})
        pipe.execute()
        self._queue_lines(batch_id, meta, raw_lines)
        return self.get(batch_id)

    def _input_lines(self, input_file_id: str) -> list[bytes]:
        return [line for line in self.content(input_file_id).split(b"\n") if line.strip()]

    def _queue_lines(self, batch_id: str, meta: dict[str, Any],
                     raw_lines: list[bytes] | None = None) -> None:
        """Queue the batch's lines from the first one not queued yet, holding the creator
        lease (a process that dies while queueing stops refreshing it, and the next reader
        of the batch carries on where it stopped); nothing when another process holds it."""
        lease, token = self.keys.batch_creator(batch_id), uuid.uuid4().hex
        lease_ms = int(CREATOR_LEASE_SECONDS * 1000)
        if not self.conn.set(lease, token, nx=True, px=lease_ms):
            return
        try:
            lines = raw_lines if raw_lines is not None else self._input_lines(
                meta["input_file_id"])
            key = self.keys.batch(batch_id)
            queued, status = self.conn.hmget(key, "queued", "status")
            start = int(queued or 0)
            renewed = time.monotonic()
            for number in range(start + 1, len(lines) + 1):
                if time.monotonic() - renewed > CREATOR_LEASE_SECONDS / 3:
                    self.conn.pexpire(lease, lease_ms)
                    renewed = time.monotonic()
                # only the first line of a takeover can have been half done by the dead one
                self._queue_line(batch_id, meta, number, lines[number - 1],
                                 resumed=raw_lines is None and number == start + 1,
                                 cancelled=text(status) == "cancelling")
                pipe = self.conn.pipeline(transaction=False)
                pipe.hset(key, "queued", number)
                pipe.hget(key, "status")
                _, status = pipe.execute()
        finally:
            if text(self.conn.get(lease)) == token:
                self.conn.delete(lease)

    def _queue_line(self, batch_id: str, meta: dict[str, Any], number: int, raw: bytes,
                    resumed: bool, cancelled: bool) -> None:
        """Turn one input line into a job, or account it as failed with its reason (or as
        cancelled, once the batch is being cancelled).

        Job ids follow from the batch and the line, so a takeover (``resumed``) finds what
        the dead creator had already done for the line and does not do it twice."""
        job_id = f"{batch_id.removeprefix('batch_')}-{number}"
        jobs, results = self.keys.batch_jobs(batch_id), self.keys.batch_results(batch_id)
        custom_id, parsed, error = _parse_line(meta["endpoint"], number, raw,
                                                meta.get("model"), self.aliases)
        request = parsed.choices[0].request if parsed is not None else None
        record = {"custom_id": custom_id, "job_id": None,
                  "model": parsed.model if parsed is not None else None,
                  "echo": parsed.choices[0].echo if parsed is not None else ""}
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
        if (status in ("in_progress", "cancelling")
                and int(raw.get("queued", raw["total"])) < int(raw["total"])):
            self._queue_lines(batch_id, meta)  # unless its creator is alive and at it
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
            yield _output_line(batch["endpoint"], number, record, final)


def _valid_metadata(metadata: object) -> bool:
    """OpenAI's rule: at most 16 string pairs, keys up to 64 and values up to 512 characters."""
    return isinstance(metadata, dict) and len(metadata) <= 16 and all(
        isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
        for k, v in metadata.items())


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


def _output_line(endpoint: str, number: int, record: dict[str, Any],
                 final: FinalEvent) -> dict[str, Any]:
    """One line of an output or error file, in OpenAI's shape (plus the input ``line``)."""
    job_id = record.get("job_id")
    line: dict[str, Any] = {"id": f"batch_req_{final.job_id}",
                            "custom_id": record.get("custom_id"), "line": number}
    if final.status is JobStatus.FINISHED:
        parsed = requests.Parsed(endpoint, record.get("model") or "",
                                 [requests.Choice({}, echo=record.get("echo", ""))])
        body = replies.response_body(parsed, [final])
        return {**line, "response": {"status_code": 200, "request_id": job_id, "body": body},
                "error": None}
    if job_id is None:
        code, status = "invalid_request", 400
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
