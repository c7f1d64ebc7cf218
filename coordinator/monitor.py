"""Summaries of specfleet's structured JSON logs, per worker, per model and per job.

Every count is taken from the event that is the record of it, never re-derived: speculation
counts (drafts, acceptance per position, verifies, replays, checkpoint saves) from the
``telemetry`` object each ``generation.finished`` event carries (so, over the same runs, they
equal the engine's own telemetry exactly); host fallbacks from ``checkpoint.fallback`` (which
also covers a start-up reservation that fell back before any generation); jobs, failures,
refusals and requeues from their ``job.*`` events; lost workers from ``worker.lost``.

A worker is declared lost in the log of whichever process swept it, which may be a log not
being read; with ``fleet_events`` the fleet's event stream in Redis (``Keys.fleet_events``,
:func:`read_fleet_events`) is the record of lost workers instead, whoever swept them.

A line that is not a JSON object with an ``event`` is counted as unparseable and skipped. A
line without a ``worker`` field (start-up events such as ``engine.loaded``) belongs to the
worker that the same source names in its ``worker.registered`` event.

Live (:class:`LiveFeed`, ``specfleet monitor --live``): the jobs' own events as the workers
publish them (Redis pub/sub, every job's channel at once: the event script PUBLISHes each
event it appends to the job's stream), turned into the records a log would hold
(:func:`records_of`), so a fleet is summarised without its workers' log files. Pub/sub is
at most once: a job whose events a reader missed (it started late, the connection dropped)
still has them all in its stream, which stays the durable record.
"""

from __future__ import annotations

import glob
import json
import operator
import os
import queue
import re
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import IO, Any

from redis import Redis

from shared.keys import STREAM_FIELD, Keys
from shared.protocol import AnyEvent, ErrorEvent, FinalEvent, JobStatus, ProgressEvent, Telemetry
from shared.protocol import parse_event as parse_job_event

#: Label for records whose worker no line of their source names.
UNKNOWN = "-"
#: The source name of the records read from the fleet's event stream.
FLEET_SOURCE = "redis:fleet-events"
#: The source of what :class:`LiveFeed` reads.
LIVE_SOURCE = "redis:live"
#: How long a stopping :class:`LiveFeed` waits for one more message before its last summary.
DRAIN_SECONDS = 0.2
#: How long :class:`LiveFeed` waits for Redis to confirm its subscription.
SUBSCRIBE_SECONDS = 10.0
#: Records held per source until its worker is known (a start-up is a few dozen lines).
_PENDING_MAX = 10_000

#: Telemetry's sums (``Summed``): counts and seconds, and the per-draft-position lists summed
#: position by position. Host fallbacks are left out: they are counted by reason from
#: ``checkpoint.fallback``, which also covers a start-up reservation before any generation.
_SUMMED = Telemetry.summed()
_POSITIONS = tuple(name for name, rule in _SUMMED.items() if rule.label == "position")
#: Each count's type (``int`` or ``float`` seconds), read from its default.
_COUNTS = {name: type(Telemetry.model_fields[name].default) for name in _SUMMED
           if name not in _POSITIONS and name != "host_fallbacks"}


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else 0.0


@dataclass
class Tally:
    """What happened in one group (a worker, a model, a job, or the whole fleet)."""

    generations: int = 0
    #: Telemetry's counts and seconds, summed over the generations (named as in Telemetry).
    sums: dict[str, float] = field(default_factory=lambda: {
        name: kind(0) for name, kind in _COUNTS.items()})
    positions: dict[str, list[int]] = field(
        default_factory=lambda: {name: [] for name in _POSITIONS})
    jobs_started: int = 0
    jobs_finished: int = 0
    jobs_cancelled: int = 0
    interruptions: int = 0
    refusals: int = 0
    lost: int = 0
    host_fallbacks: Counter[str] = field(default_factory=Counter)
    #: Host fallbacks by the device whose checkpoint share moved (one per device per event).
    host_fallback_devices: Counter[str] = field(default_factory=Counter)
    failures: Counter[str] = field(default_factory=Counter)
    requeues: Counter[str] = field(default_factory=Counter)

    def add_telemetry(self, t: dict[str, Any]) -> None:
        """One ``generation.finished`` event's telemetry."""
        self.generations += 1
        for name, kind in _COUNTS.items():
            self.sums[name] += kind(t.get(name) or 0)
        for name in _POSITIONS:
            _add(self.positions[name], t.get(name) or [])

    def to_json(self) -> dict[str, Any]:
        """Counts plus the rates derived from them (docs/telemetry.md defines each)."""
        s, positions = self.sums, self.positions
        accepted, drafts, generated = s["accepted"], s["drafts"], s["generated_tokens"]
        return {
            "generations": self.generations, **s,
            **{name: list(counts) for name, counts in positions.items()},
            "acceptance": _ratio(accepted, s["drafted"]),
            "acceptance_per_position": [_ratio(a, d) for a, d in
                                        zip(positions["accepted_per_position"],
                                            positions["drafted_per_position"], strict=False)],
            "mean_accepted_length": _ratio(accepted, drafts),
            "mean_acceptance_length": 1 + _ratio(accepted, drafts) if drafts else 0.0,
            "tokens_per_verify": _ratio(generated, s["target_decodes"]),
            "replay_ratio": _ratio(s["replay_events"], s["target_decodes"]),
            "effective_tokens_per_second": _ratio(generated, s["wall_seconds"]),
            "jobs_started": self.jobs_started, "jobs_finished": self.jobs_finished,
            "jobs_cancelled": self.jobs_cancelled, "interruptions": self.interruptions,
            "failures": sum(self.failures.values()),
            "failures_by_type": dict(sorted(self.failures.items())),
            "refusals": self.refusals,
            "requeues": sum(self.requeues.values()),
            "requeues_by_reason": dict(sorted(self.requeues.items())),
            "recoveries": self.requeues.get("lost", 0), "lost": self.lost,
            "host_fallbacks": sum(self.host_fallbacks.values()),
            "host_fallbacks_by_reason": dict(sorted(self.host_fallbacks.items())),
            "host_fallbacks_by_device": dict(sorted(self.host_fallback_devices.items())),
        }


def _add(into: list[int], other: Iterable[int]) -> None:
    for i, v in enumerate(other):
        if i == len(into):
            into.append(0)
        into[i] += int(v)


def _apply(tally: Tally, record: dict[str, Any]) -> None:
    """Count one event into one group."""
    event = record["event"]
    if event == "generation.finished" and isinstance(record.get("telemetry"), dict):
        tally.add_telemetry(record["telemetry"])
    elif event == "checkpoint.fallback":
        tally.host_fallbacks[str(record.get("kind") or record.get("phase") or "unknown")] += 1
        tally.host_fallback_devices.update(str(d) for d in record.get("devices") or ())
    elif event == "job.started":
        tally.jobs_started += 1
    elif event == "job.finished":
        tally.jobs_finished += 1
    elif event == "job.cancelled":
        tally.jobs_cancelled += 1
    elif event == "job.interrupted":
        tally.interruptions += 1
    elif event == "job.failed":  # (a crash's job.crashed only adds the traceback to it)
        tally.failures[str(record.get("error_type") or "unknown")] += 1
    elif event == "job.refused":
        tally.refusals += 1
    elif event == "job.requeued":
        tally.requeues[str(record.get("reason") or "lost")] += 1
    elif event == "worker.lost":
        tally.lost += 1


@dataclass
class _Source:
    """Per input: the worker (and model) its lines belong to, once ``worker.registered``
    names them."""

    worker: str | None = None
    model: str | None = None
    pending: list[dict[str, Any]] = field(default_factory=list)


class LogSummary:
    """Aggregates log records from any number of sources into per-group tallies."""

    def __init__(self, since: datetime | None = None, fleet_events: bool = False) -> None:
        self.since = since
        #: Lost workers are counted from the fleet's event stream only (not from logs).
        self.fleet_events = fleet_events
        self.lines = 0
        self.records = 0
        self.unparseable = 0
        self.before_since = 0
        self.total = Tally()
        self.workers: dict[str, Tally] = {}
        #: Per job, the first attempt each worker was seen with (orders ``job_info`` workers).
        self._job_runs: dict[str, dict[str, int]] = {}
        self.models: dict[str, Tally] = {}
        self.jobs: dict[str, Tally] = {}
        self.job_info: dict[str, dict[str, Any]] = {}
        self._sources: dict[str, _Source] = {}

    def feed(self, line: str, source: str = "-") -> None:
        """One raw log line from ``source`` (a file name, or ``-`` for stdin)."""
        if not line.strip():
            return
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict) or not isinstance(record.get("event"), str):
            self.skip()
            return
        self.add(record, source)

    def skip(self) -> None:
        """One input that is no record (not JSON, no ``event``): counted, never fatal."""
        self.lines += 1
        self.unparseable += 1

    def add(self, record: dict[str, Any], source: str = "-") -> None:
        """One record (an object with an ``event``) from ``source``, a log line's or one a
        live event stands for (:func:`records_of`)."""
        self.lines += 1
        if (self.fleet_events and record["event"] == "worker.lost"
                and source != FLEET_SOURCE):
            return  # the fleet's event stream has it, once
        if self.since is not None:
            ts = parse_time(record.get("timestamp"))
            if ts is None or ts < self.since:
                self.before_since += 1
                return
        src = self._sources.setdefault(source, _Source())
        if record["event"] == "worker.registered" and src.worker is None:
            src.worker = str(record.get("worker") or UNKNOWN)
            src.model = record.get("model")
            for held in src.pending:
                self._count(held, src.worker, src.model)
            src.pending.clear()
        if "worker" in record:
            self._count(record, str(record["worker"]), src.model)
        elif src.worker is not None:
            self._count(record, src.worker, src.model)
        elif len(src.pending) < _PENDING_MAX:
            src.pending.append(record)
        else:
            self._count(record, UNKNOWN, None)

    def close(self) -> None:
        """Count what no source ever attributed (a log without ``worker.registered``)."""
        for src in self._sources.values():
            for held in src.pending:
                self._count(held, UNKNOWN, None)
            src.pending.clear()

    def _count(self, record: dict[str, Any], worker: str, source_model: str | None) -> None:
        self.records += 1
        groups = [self.total, self.workers.setdefault(worker, Tally())]
        model = record.get("model") or source_model
        if model:
            groups.append(self.models.setdefault(str(model), Tally()))
        job_id = record.get("job_id")
        if job_id and record["event"] != "job.queued":
            groups.append(self.jobs.setdefault(str(job_id), Tally()))
            info = self.job_info.setdefault(str(job_id), {"workers": [], "model": None,
                                                          "attempts": 0, "outcome": None})
            attempt = record.get("attempt")
            if worker != UNKNOWN and worker not in info["workers"]:
                # In the order of the attempts they ran, not of the files read: the records
                # of one job are spread over several workers' (and clients') logs.
                runs = self._job_runs.setdefault(str(job_id), {})
                runs[worker] = attempt if isinstance(attempt, int) else len(runs) + 1
                info["workers"] = sorted(runs, key=lambda w: runs[w])
            info["model"] = info["model"] or model
            if isinstance(attempt, int):
                info["attempts"] = max(info["attempts"], attempt)
            if record["event"] in ("job.finished", "job.cancelled", "job.failed",
                                   "job.interrupted", "job.requeued", "job.refused"):
                info["outcome"] = record["event"].removeprefix("job.")
        for tally in groups:
            _apply(tally, record)

    def to_json(self) -> dict[str, Any]:
        return {
            "lines": self.lines, "records": self.records, "unparseable": self.unparseable,
            "before_since": self.before_since, "total": self.total.to_json(),
            "workers": {k: v.to_json() for k, v in sorted(self.workers.items())},
            "models": {k: v.to_json() for k, v in sorted(self.models.items())},
            "jobs": {k: {**self.job_info.get(k, {}), **v.to_json()}
                     for k, v in sorted(self.jobs.items())},
        }


# -- alert conditions -----------------------------------------------------------------------
_OPS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge, "<=": operator.le, "==": operator.eq, "!=": operator.ne,
    ">": operator.gt, "<": operator.lt,
}
_CONDITION = re.compile(r"^\s*([a-z_]+)\s*(>=|<=|==|!=|>|<)\s*([-+]?[0-9]*\.?[0-9]+)\s*$")
#: What a condition may name: every number a tally's summary has, and the skipped lines.
CONDITION_FIELDS = (*(k for k, v in Tally().to_json().items() if isinstance(v, int | float)),
                    "unparseable")


@dataclass(frozen=True)
class Condition:
    """``FIELD OP NUMBER`` (``host_fallbacks>0``, ``replay_ratio>0.2``, ``acceptance<0.5``),
    checked against the fleet total and every worker; it holds when it holds for any."""

    text: str
    name: str
    op: str
    value: float

    @classmethod
    def parse(cls, text: str) -> Condition:
        m = _CONDITION.match(text)
        if m is None:
            raise ValueError(f"bad condition {text!r}: expected FIELD OP NUMBER, e.g. "
                             "'host_fallbacks>0' or 'replay_ratio>0.2'")
        name, op, value = m.groups()
        if name not in CONDITION_FIELDS:
            raise ValueError(f"bad condition {text!r}: unknown field {name!r} (one of: "
                             f"{', '.join(CONDITION_FIELDS)})")
        return cls(text=text.strip(), name=name, op=op, value=float(value))

    def tripped(self, summary: LogSummary) -> list[str]:
        """Where the condition holds: ``total`` and/or worker names (``unparseable`` is a
        count of the whole input: ``total`` only)."""
        holds = _OPS[self.op]
        if self.name == "unparseable":
            return ["total"] if holds(summary.unparseable, self.value) else []
        groups = {"total": summary.total, **summary.workers}
        return [where for where, tally in groups.items()
                if holds(float(tally.to_json()[self.name]), self.value)]


def tripped_conditions(summary: LogSummary, conditions: Iterable[Condition]) -> list[str]:
    """One line per condition that holds, naming where (empty: all clear)."""
    alerts = []
    for cond in conditions:
        where = cond.tripped(summary)
        if where:
            alerts.append(f"{cond.text} holds for {', '.join(where)}")
    return alerts


# -- time -----------------------------------------------------------------------------------
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_time(value: object) -> datetime | None:
    """An ISO-8601 timestamp (structlog writes ``2026-12-01T09:00:00.123456Z``) as UTC."""
    if not isinstance(value, str):
        return None
    try:
        ts = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return ts if ts.tzinfo else ts.replace(tzinfo=UTC)


def parse_since(text: str, now: datetime | None = None) -> datetime:
    """``--since``: an ISO timestamp, or a duration back from now (``90s``, ``15m``, ``2h``)."""
    m = _DURATION.match(text.strip())
    if m:
        now = now or datetime.now(UTC)
        return now - timedelta(seconds=float(m.group(1)) * _UNIT[m.group(2)])
    ts = parse_time(text.strip())
    if ts is None:
        raise ValueError(f"bad --since {text!r}: expected an ISO time "
                         "(2026-12-01T09:00:00Z) or a duration (90s, 15m, 2h, 1d)")
    return ts


# -- sources --------------------------------------------------------------------------------
class _Tail:
    """One file read incrementally: only complete lines, reopened when truncated/rotated."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fh: IO[str] | None = None
        self._inode: int | None = None
        self._partial = ""

    def read(self) -> list[str]:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return []
        if self._fh is None or st.st_ino != self._inode or st.st_size < self._fh.tell():
            if self._fh is not None:
                self._fh.close()
            self._fh = open(self.path, encoding="utf-8", errors="replace")  # noqa: SIM115
            self._inode = st.st_ino
            self._partial = ""
        chunk = self._fh.read()
        if not chunk:
            return []
        text = self._partial + chunk
        lines = text.split("\n")
        self._partial = lines.pop()
        return lines

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()


def read_fleet_events(connection: Redis, keys: Keys, summary: LogSummary,
                      after: str = "0-0") -> str:
    """Feed the fleet's events after stream id ``after`` (``worker.lost`` records, whoever
    swept them); returns the id to read on from."""
    while True:
        entries = connection.xrange(keys.fleet_events(), min=f"({after}", count=1000)
        if not entries:
            return after
        for entry_id, fields in entries:
            after = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
            raw = (fields or {}).get(STREAM_FIELD.encode()) or b""
            summary.feed(raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw,
                         FLEET_SOURCE)


def expand(patterns: Iterable[str]) -> list[str]:
    """File names a list of paths and globs names now (``-`` is kept: stdin)."""
    found: list[str] = []
    for pattern in patterns:
        if pattern == "-":
            names = ["-"]
        elif glob.has_magic(pattern):
            names = sorted(glob.glob(pattern))
        else:
            names = [pattern] if Path(pattern).exists() else []
        found += [n for n in names if n not in found]
    return found


def read_all(patterns: list[str], summary: LogSummary, stdin: IO[str] | None = None) -> None:
    """Feed every line of every named file (and stdin for ``-``) once."""
    for name in expand(patterns):
        if name == "-":
            for line in stdin or sys.stdin:
                summary.feed(line, "-")
            continue
        with open(name, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                summary.feed(line, name)
    summary.close()


def follow(patterns: list[str], summary: LogSummary, interval: float = 0.5,
           stdin: IO[str] | None = None) -> Iterator[None]:
    """Feed lines as they are written, re-expanding globs to pick up new files; yields after
    each poll so the caller can render or check alerts. Files are read from their start."""
    tails: dict[str, _Tail] = {}
    lines: queue.Queue[str | None] = queue.Queue()
    if "-" in patterns:
        def pump() -> None:
            for line in stdin or sys.stdin:
                lines.put(line)
            lines.put(None)
        threading.Thread(target=pump, name="monitor-stdin", daemon=True).start()
    try:
        while True:
            for name in expand(p for p in patterns if p != "-"):
                tails.setdefault(name, _Tail(name))
            for name, tail in tails.items():
                for line in tail.read():
                    summary.feed(line, name)
            while not lines.empty():
                piped = lines.get_nowait()
                if piped is not None:
                    summary.feed(piped, "-")
            yield
            time.sleep(interval)
    finally:
        for tail in tails.values():
            tail.close()


_OUTCOMES = {JobStatus.FINISHED: "job.finished", JobStatus.CANCELLED: "job.cancelled",
             JobStatus.FAILED: "job.failed"}


def records_of(event: AnyEvent, error_type: str | None = None) -> list[dict[str, Any]]:
    """The log records a job's published ``event`` stands for: ``job.started``; at its final
    event ``generation.finished`` (its telemetry) and its outcome, a failure with the type of
    the ``error_type`` the job's error event gave (the caller remembers it per job)."""
    base = {"job_id": event.job_id, "attempt": event.attempt}
    if isinstance(event, ProgressEvent) and event.stage == "started":
        return [{"event": "job.started", "worker": event.worker or UNKNOWN, **base}]
    if not isinstance(event, FinalEvent):
        return []
    worker = {"worker": event.worker or UNKNOWN, **base}
    records: list[dict[str, Any]] = []
    if event.telemetry is not None and event.embeddings is None:  # an embedding's: usage
        records.append({"event": "generation.finished", **worker,
                        "telemetry": event.telemetry.model_dump(mode="json")})
    outcome: dict[str, Any] = {"event": _OUTCOMES[event.status], **worker}
    if event.status is JobStatus.FAILED:
        outcome["error_type"] = error_type or "unknown"
    return [*records, outcome]


class LiveFeed:
    """Every job's events as they are published (``PSUBSCRIBE`` on the jobs' channels),
    fed to a :class:`LogSummary` as the records they stand for (see the module docstring)."""

    def __init__(self, connection: Redis, keys: Keys) -> None:
        self._pubsub = connection.pubsub()
        self._pubsub.psubscribe(keys.channel("*"))
        # Only once Redis confirms the pattern does a published event reach this feed: a job
        # started between the command and its confirmation was missed (a loaded CI machine:
        # one job.started of three).
        deadline = time.monotonic() + SUBSCRIBE_SECONDS
        while (left := deadline - time.monotonic()) > 0:
            message = self._pubsub.get_message(timeout=left)
            if message is not None and message.get("type") == "psubscribe":
                break
        else:
            raise ConnectionError(f"Redis did not confirm the subscription to the jobs' "
                                  f"channels within {SUBSCRIBE_SECONDS:.0f} s")
        #: Per job, the type of its last error event (its final event says only "failed").
        self._errors: dict[str, str] = {}

    def poll(self, summary: LogSummary, seconds: float) -> int:
        """Feed what is published within ``seconds``; returns the events read."""
        deadline, read = time.monotonic() + seconds, 0
        while (left := deadline - time.monotonic()) > 0:
            message = self._pubsub.get_message(timeout=left)
            if message is None or message.get("type") != "pmessage":
                continue
            read += 1
            try:
                event = parse_job_event(message["data"])
            except ValueError:
                summary.skip()
                continue
            if isinstance(event, ErrorEvent):
                self._errors[event.job_id] = event.error_type
            error_type = self._errors.pop(event.job_id, None) if isinstance(
                event, FinalEvent) else None
            for record in records_of(event, error_type):
                summary.add(record, LIVE_SOURCE)
        return read

    def drain(self, summary: LogSummary) -> None:
        """Feed what has been published and not read yet (the reader stops: what arrived
        before it did belongs in its last summary)."""
        while self.poll(summary, DRAIN_SECONDS):
            pass

    def close(self) -> None:
        self._pubsub.close()

