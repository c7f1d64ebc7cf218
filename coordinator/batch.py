"""Batch files: OpenAI-style JSONL in (``{"custom_id", "body": request}``), JSONL out.

Every valid line is queued at once (the fleet works on them in parallel); results are
written in input order, each keeping its ``custom_id``. A bad line (not JSON, not a batch
line, a request the coordinator refuses) is reported with its line number and does not stop
the batch. The batch's status and counts are kept in a Redis hash (``keys.batch``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import IO, Any

from pydantic import ValidationError

from coordinator.client import Coordinator, JobHandle
from coordinator.validation import SubmitError
from shared.protocol import BatchLine, JobStatus, describe_validation_error


@dataclass
class BatchSummary:
    """Counts of one batch run (also stored in Redis under the batch id)."""

    batch_id: str
    total: int = 0
    completed: int = 0
    failed: int = 0
    invalid: int = 0
    errors: list[str] = field(default_factory=list)


def _parse_line(number: int, raw: str, model: str | None) -> BatchLine:
    """One input line as a ``BatchLine``; ``ValueError`` naming the line otherwise."""
    try:
        line = BatchLine.model_validate_json(raw)
    except ValidationError as exc:
        raise ValueError(f"line {number}: {describe_validation_error(exc)}") from None
    if model is not None:
        line.body.setdefault("model", model)
    return line


def run_batch(coordinator: Coordinator, lines: Iterable[str], out: IO[str],
              errors: IO[str] | None = None, model: str | None = None,
              timeout: float | None = None,
              progress: Callable[[int, int], None] | None = None) -> BatchSummary:
    """Submit every line, then write one output line per request as results arrive in order.

    ``errors`` receives the lines that failed (invalid or failed jobs); without it they go
    to ``out`` too. ``progress(done, total)`` is called after each written result.
    """
    summary = BatchSummary(batch_id=uuid.uuid4().hex)
    hash_key = coordinator.keys.batch(summary.batch_id)
    ttl = coordinator.settings.result_ttl_seconds

    def save(**fields: Any) -> None:
        """Update the batch hash; it expires even when the run dies half-way (a timeout)."""
        pipe = coordinator.connection.pipeline(transaction=False)
        pipe.hset(hash_key, mapping=fields)
        pipe.expire(hash_key, ttl)
        pipe.execute()

    save(status="validating")
    error_out = errors or out
    submitted: list[tuple[int, str, JobHandle]] = []
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        summary.total += 1
        custom_id = None
        try:
            line = _parse_line(number, raw, model)
            custom_id = line.custom_id
            submitted.append((number, custom_id, coordinator.submit(line.body)))
        except (ValueError, SubmitError) as exc:
            message = str(exc) if str(exc).startswith("line ") else f"line {number}: {exc}"
            summary.invalid += 1
            summary.errors.append(message)
            _write(error_out, {"custom_id": custom_id, "line": number, "job_id": None,
                               "response": None, "error": {"message": message}})
    save(status="in_progress", total=summary.total, invalid=summary.invalid,
         job_ids=json.dumps([h.job_id for _, _, h in submitted]))
    for done, (number, custom_id, handle) in enumerate(submitted, start=1):
        result = handle.result(timeout)
        ok = result.status is JobStatus.FINISHED
        record: dict[str, Any] = {"custom_id": custom_id, "line": number,
                                  "job_id": handle.job_id}
        if ok:
            summary.completed += 1
            _write(out, {**record, "response": result.to_json(), "error": None})
        else:
            summary.failed += 1
            message = f"line {number}: job {result.status}: {result.error or result.finish_reason}"
            summary.errors.append(message)
            _write(error_out, {**record, "response": None, "error": {"message": message}})
        save(completed=summary.completed, failed=summary.failed)
        if progress:
            progress(done, len(submitted))
    save(status="completed")
    return summary


def _write(stream: IO[str], obj: dict[str, Any]) -> None:
    stream.write(json.dumps(obj) + "\n")
    stream.flush()
