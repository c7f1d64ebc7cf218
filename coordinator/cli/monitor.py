"""``specfleet monitor``: summarise workers' JSON logs, or the fleet's jobs live; alert through
the exit status.

Exit status: 0 all clear, 1 a ``--fail-on`` condition holds (each one is named on stderr),
2 bad usage (a bad condition or time, no log file matched), 3 Redis unreachable. With
``--follow`` it keeps reading growing files (and new files matching a glob), prints a summary
every ``--interval`` seconds and exits 1 as soon as a condition holds, so it can run under
cron, CI or a supervisor. ``--live`` reads no logs: it follows every job's events as the
workers publish them (Redis pub/sub), the same way, for ``--for`` seconds or until stopped.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Annotated, Any

import typer
from redis import RedisError
from rich.console import Console
from rich.table import Table

from coordinator.cli.app import app, environment_settings, error_line, fail, fail_redis
from coordinator.monitor import (
    Condition,
    LiveFeed,
    LogSummary,
    expand,
    follow,
    parse_since,
    read_all,
    read_fleet_events,
    tripped_conditions,
)
from shared.outage import RedisOutage, ride_out
from shared.redis_client import connect

#: ``--live``: how often the loop looks whether it was told to stop.
LOOK_SECONDS = 0.25
_COLUMNS = ("gens", "tokens", "accept", "accept/pos", "tok/verify", "replays", "fallbacks",
            "failed", "refused", "requeued", "lost")


def _row(t: dict[str, Any]) -> list[str]:
    per_pos = " ".join(f"{a:.2f}" for a in t["acceptance_per_position"][:6]) or "-"
    fallbacks = ",".join(f"{k}:{v}" for k, v in t["host_fallbacks_by_reason"].items()) or "0"
    return [str(t["generations"]), str(t["generated_tokens"]), f"{t['acceptance']:.3f}", per_pos,
            f"{t['tokens_per_verify']:.2f}", f"{t['replay_events']}/{t['replay_tokens']}",
            fallbacks, str(t["failures"]), str(t["refusals"]), str(t["requeues"]),
            str(t["lost"])]


def _print_text(data: dict[str, Any], jobs: bool) -> None:
    console = Console()
    groups = [("worker", data["workers"]), ("model", data["models"])]
    if jobs:
        groups.append(("job", data["jobs"]))
    for label, rows in groups:
        table = Table(label, *_COLUMNS, title=f"per {label}")
        for name, tally in rows.items():
            table.add_row(name, *_row(tally))
        if label != "job":
            table.add_row("[b]all[/b]", *_row(data["total"]))
        console.print(table)
    console.print(f"{data['lines']} lines, {data['records']} events, "
                  f"{data['unparseable']} unparseable skipped, "
                  f"{data['before_since']} before --since")


def _report(summary: LogSummary, as_json: bool, jobs: bool,
            conditions: list[Condition]) -> bool:
    """Print the summary; True when an alert condition holds (named on stderr)."""
    data = summary.to_json()
    alerts = tripped_conditions(summary, conditions)
    if as_json:
        print(json.dumps({**data, "alerts": alerts}), flush=True)
    else:
        _print_text(data, jobs)
    for alert in alerts:
        error_line(f"alert: {alert}")
    return bool(alerts)


def _fleet_reader(summary: LogSummary) -> Callable[[], None]:
    """What feeds ``summary`` the fleet's new events each time it is called (a Redis that
    cannot be read is a one-line error, exit 3)."""
    settings = environment_settings()
    connection = connect(settings.redis_url)
    after = "0-0"

    def read() -> None:
        nonlocal after
        try:
            after = ride_out(lambda: read_fleet_events(connection, settings.keys, summary,
                                                       after),
                             settings.redis_outage_seconds, "fleet_events.read")
        except (RedisError, RedisOutage) as exc:
            fail_redis(settings, exc)
    return read


@app.command()
def monitor(
    logs: Annotated[list[str] | None, typer.Argument(
        help="log files or globs ('workers/*.log'); '-' or nothing reads stdin")] = None,
    follow_logs: Annotated[bool, typer.Option(
        "--follow", "-f", help="keep reading as the logs grow")] = False,
    since: Annotated[str | None, typer.Option(
        help="only events at or after this ISO time or this long ago (15m, 2h)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
    fail_on: Annotated[list[str] | None, typer.Option(
        "--fail-on", help="exit 1 when FIELD OP NUMBER holds for the fleet or any worker "
        "(host_fallbacks>0, replay_ratio>0.2, acceptance<0.5); repeatable")] = None,
    jobs: Annotated[bool, typer.Option("--jobs", help="also a per-job table (text)")] = False,
    interval: Annotated[float, typer.Option(
        min=0.05, help="--follow: seconds between summaries")] = 5.0,
    fleet_events: Annotated[bool, typer.Option(
        "--fleet-events", help="count lost workers from the fleet's event stream in Redis "
        "(REDIS_URL, SPECFLEET_PREFIX), whoever swept them, not from the logs read")] = False,
    live: Annotated[bool, typer.Option(
        "--live", help="read no logs: follow every job's events as the workers publish them "
        "(Redis pub/sub, REDIS_URL and SPECFLEET_PREFIX), a summary every --interval")] = False,
    duration: Annotated[float | None, typer.Option(
        "--for", min=0.1, help="--live: stop after this many seconds (default: until "
        "stopped) and print the last summary")] = None,
) -> None:
    """Summarise JSON logs per worker, model and job: generations, tokens, acceptance (also
    per position), tokens per verify, replays, host fallbacks by reason, failures, refusals,
    requeues and lost workers. Unparseable lines are counted and skipped."""
    patterns = logs or ["-"]
    try:
        conditions = [Condition.parse(c) for c in fail_on or []]
        summary = LogSummary(since=parse_since(since) if since else None,
                             fleet_events=fleet_events)
    except ValueError as exc:
        fail(str(exc))
    if live:
        if logs or follow_logs:
            fail("--live reads the fleet's published events, not logs: drop the log files "
                 "and --follow")
        _live(summary, as_json, jobs, conditions, interval, duration, fleet_events)
    if duration is not None:
        fail("--for goes with --live")
    if not follow_logs and not expand(patterns):
        fail(f"no log file matches {' '.join(patterns)}")
    read_fleet = _fleet_reader(summary) if fleet_events else None
    if not follow_logs:
        if read_fleet is not None:
            read_fleet()
        read_all(patterns, summary)
        raise typer.Exit(1 if _report(summary, as_json, jobs, conditions) else 0)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    next_report = time.monotonic() + interval
    try:
        for _ in follow(patterns, summary, interval=min(interval, 0.5), stdin=sys.stdin):
            if read_fleet is not None:
                read_fleet()
            if time.monotonic() >= next_report or tripped_conditions(summary, conditions):
                next_report = time.monotonic() + interval
                if _report(summary, as_json, jobs, conditions):
                    raise typer.Exit(1)
    except KeyboardInterrupt:
        pass
    summary.close()
    raise typer.Exit(1 if _report(summary, as_json, jobs, conditions) else 0)


def _live(summary: LogSummary, as_json: bool, jobs: bool, conditions: list[Condition],
          interval: float, duration: float | None, fleet_events: bool) -> None:
    """``--live``: summaries of the published events every ``interval`` seconds, for
    ``duration`` seconds or until SIGINT/SIGTERM; exits as ``--follow`` does. A signal only
    sets a flag (a KeyboardInterrupt in the middle of reading a message would lose it): the
    loop stops at its next look, reads what had arrived, and prints the last summary."""
    settings = environment_settings()
    read_fleet = _fleet_reader(summary) if fleet_events else None
    try:
        feed = ride_out(lambda: LiveFeed(connect(settings.redis_url), settings.keys),
                        settings.redis_outage_seconds, "monitor.subscribe")
    except (RedisError, RedisOutage) as exc:
        fail_redis(settings, exc)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    sys.stderr.write(f"specfleet: following the fleet's jobs live (prefix {settings.prefix})\n")
    sys.stderr.flush()
    now = time.monotonic()
    end = now + duration if duration is not None else float("inf")
    next_report = now + interval
    try:
        while not stop.is_set() and (now := time.monotonic()) < end:
            feed.poll(summary, min(LOOK_SECONDS, end - now, max(next_report - now, 0.0)))
            if read_fleet is not None:
                read_fleet()
            if time.monotonic() >= next_report:
                next_report = time.monotonic() + interval
                if _report(summary, as_json, jobs, conditions):
                    raise typer.Exit(1)
        feed.drain(summary)
    except RedisError as exc:
        fail_redis(settings, exc)
    feed.close()
    raise typer.Exit(1 if _report(summary, as_json, jobs, conditions) else 0)
