"""The fleet's event stream the console's timeline reads (real Redis, no browser): what a
record looks like, how it becomes timeline entries, and that the other events written there do
not hide lost workers from ``specfleet top``; and the per-token origin a worker streams."""

from __future__ import annotations

import pytest

from coordinator.client import Coordinator
from coordinator.gateway.console import recent_events, timeline
from coordinator.metrics import LOST_SHOWN, lost_rows
from shared.event_stream import EventWriter
from shared.fleet_events import FleetReporter, append, fleet_record
from shared.keys import Keys
from shared.protocol import TokenEvent, parse_event
from shared.settings import Settings
from worker.engine.slot import token_origin
from worker.service.events import TokenChunker


@pytest.fixture
def coordinator(settings: Settings) -> Coordinator:
    return Coordinator(settings)


def test_a_record_is_a_log_line_and_unknown_events_are_refused() -> None:
    record = fleet_record("worker.replays", "info", worker="w", job_id="j", replay_events=2)
    assert record["event"] == "worker.replays" and record["level"] == "info"
    assert record["timestamp"].endswith("Z") and record["replay_events"] == 2
    with pytest.raises(ValueError, match="unknown fleet event 'worker.bogus'"):
        fleet_record("worker.bogus")


def test_timeline_entries_of_each_kind_and_a_lost_workers_requeues(
        coordinator: Coordinator) -> None:
    reporter = FleetReporter(coordinator.connection, coordinator.keys, "w1", "tiny")
    reporter.report("worker.host_fallback", phase="reserve", reason="fault_injection", count=1)
    reporter.report("worker.redis_fault", fault="connection", operation="intake", seconds=1.5)
    append(coordinator.connection, coordinator.keys,
           fleet_record("worker.lost", worker="w2", model="tiny", jobs=["a", "b"],
                        requeued=["a"], by="w1"))
    entries, last = recent_events(coordinator, 10)
    kinds = [(e["kind"], e["worker"], e.get("job_id")) for e in entries]
    assert kinds == [("fallback", "w1", None), ("redis", "w1", None), ("lost", "w2", None),
                     ("requeue", "w2", "a")]
    assert last == entries[2]["id"]  # the stream's own id: the console follows on from it
    assert {e["id"] for e in entries} == {e["id"] for e in entries[:3]} | {f"{last}/a"}
    assert timeline("1-0", {"event": "job.started"}) == []


def test_lost_workers_are_found_behind_many_other_events(coordinator: Coordinator) -> None:
    keys: Keys = coordinator.keys
    for i in range(LOST_SHOWN + 5):
        append(coordinator.connection, keys, fleet_record("worker.lost", worker=f"dead{i}"))
    reporter = FleetReporter(coordinator.connection, keys, "w1", "tiny")
    for i in range(1200):  # more than a page of the read-back
        reporter.report("worker.replays", "info", job_id=str(i), replay_events=1)
    rows = lost_rows(coordinator)
    assert [r.worker for r in rows] == [f"dead{i}" for i in reversed(range(5, LOST_SHOWN + 5))]


def test_token_origin_is_one_letter_per_committed_token() -> None:
    assert token_origin(4, 3, 0) == "dddt"
    assert token_origin(4, 3, 2) == "ffdt"
    assert token_origin(2, 3, 0) == "dd"  # cut by a stop: the bonus token never came
    assert token_origin(1, 0, 0) == "t"


def test_token_events_carry_each_tokens_origin(coordinator: Coordinator,
                                               settings: Settings) -> None:
    writer = EventWriter.for_job(coordinator.connection, settings, "origin-job", 1)
    chunker = TokenChunker(writer, chunk=8, flush_seconds=60)
    chunker.add([1], "a", origin="t")  # the first delivery goes out at once
    chunker.add([2, 3, 4], "bcd", origin="ddt")
    chunker.add([5, 6], "ef", origin="ft")
    chunker.flush()
    with pytest.raises(ValueError, match="origin has 1 letters for 2 tokens"):
        chunker.add([7, 8], "gh", origin="d")
    raw = coordinator.connection.xrange(coordinator.keys.events("origin-job"))
    events = [parse_event(fields[b"event"]) for _, fields in raw]
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    assert [(e.tokens, e.origin) for e in tokens] == [([1], "t"), ([2, 3, 4, 5, 6], "ddtft")]
