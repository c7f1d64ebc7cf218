"""Cancellation within one decode step, and readers that arrive late or listen live."""

from __future__ import annotations

import threading

from redis import Redis

from coordinator.client import Coordinator
from coordinator.events import StreamCursor
from shared.protocol import FinalEvent, JobStatus, ProgressEvent, TokenEvent, parse_event

from .workers import MODEL_NAME, Fleet

LONG = {"model": MODEL_NAME, "prompt_tokens": [2, 7, 1, 8], "max_tokens": 400,
        "speculative": {"method": "none"}}


def test_cancel_mid_generation_stops_within_one_step(fleet: Fleet,
                                                      coordinator: Coordinator) -> None:
    # One token per event and per step (no speculation): each token event is one step.
    fleet.start("w1", step_delay=0.2, extra_env={"SPECFLEET_TOKEN_CHUNK": "1"})
    handle = coordinator.submit(LONG)
    events = handle.stream(timeout=60)
    for event in events:
        if isinstance(event, TokenEvent) and event.index >= 3:
            break
    handle.cancel()
    conn = coordinator.connection
    seen_at_cancel = conn.xlen(coordinator.keys.events(handle.job_id))
    rest = list(events)
    after = [e for e in rest if isinstance(e, TokenEvent) and e.seq > seen_at_cancel]
    final = rest[-1]
    assert isinstance(final, FinalEvent)
    assert final.status is JobStatus.CANCELLED and str(final.finish_reason) == "cancelled"
    assert len(after) <= 1  # the step already past its check may still commit
    assert len(final.tokens) < LONG["max_tokens"]
    assert fleet.alive("w1")


def test_cancel_of_a_queued_job_never_runs_it(fleet: Fleet, coordinator: Coordinator) -> None:
    fleet.start("w1", step_delay=0.05)
    running = coordinator.submit(LONG)
    waiting = coordinator.submit(LONG)
    assert coordinator.cancel(waiting.job_id) is True
    result = waiting.result(timeout=10)
    assert result.status is JobStatus.CANCELLED and result.tokens == []
    running.cancel()
    assert running.result(timeout=30).status is JobStatus.CANCELLED
    events = list(waiting.stream(timeout=5))
    assert not any(isinstance(e, ProgressEvent) and e.stage == "started" for e in events)


def test_late_reader_replays_the_whole_stream(fleet: Fleet, coordinator: Coordinator) -> None:
    fleet.start("w1", step_delay=0.01)
    conn = Redis.from_url(coordinator.settings.redis_url)
    request = {**LONG, "max_tokens": 40}
    handle = coordinator.submit(request)
    live = handle.stream(timeout=60)
    first = [next(live), next(live)]  # an early reader that drops out ...
    done = handle.result(timeout=60)
    replay = list(coordinator.handle(handle.job_id).stream(timeout=5))  # ... a late one
    assert [e.seq for e in replay] == list(range(1, len(replay) + 1))
    assert replay[:2] == first
    assert [t for e in replay if isinstance(e, TokenEvent) for t in e.tokens] == done.tokens
    assert isinstance(replay[-1], FinalEvent) and replay[-1].tokens == done.tokens
    assert conn.ttl(coordinator.keys.events(handle.job_id)) > 0


def test_pubsub_channel_fans_out_the_same_events(fleet: Fleet,
                                                 coordinator: Coordinator) -> None:
    fleet.start("w1")
    conn = Redis.from_url(coordinator.settings.redis_url)
    pubsub = conn.pubsub()
    received: list[bytes] = []
    subscribed = threading.Event()

    def listen() -> None:
        pubsub.psubscribe(coordinator.keys.channel("*"))
        for message in pubsub.listen():
            if message["type"] == "psubscribe":
                subscribed.set()
            elif message["type"] == "pmessage":
                received.append(message["data"])
                if parse_event(message["data"]).type == "final":
                    return

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    subscribed.wait(5)
    handle = coordinator.submit({**LONG, "max_tokens": 20})
    replay = list(handle.stream(timeout=60))
    listener.join(timeout=10)
    pubsub.close()
    assert [parse_event(r) for r in received] == replay


def test_a_late_reader_of_a_trimmed_stream_is_told_and_still_gets_all_the_text(
        fleet: Fleet, coordinator: Coordinator) -> None:
    """SPECFLEET_STREAM_MAXLEN=10 trims the stream (XADD MAXLEN ~ drops whole nodes of 100
    entries) long before a late reader arrives: the cursor reports the missing ``seq`` range,
    and the text comes out whole, completed from the final event."""
    fleet.start("w1", extra_env={"SPECFLEET_STREAM_MAXLEN": "10", "SPECFLEET_TOKEN_CHUNK": "1"})
    request = {**LONG, "max_tokens": 300}
    done = coordinator.submit(request).result(timeout=120)
    assert done.status is JobStatus.FINISHED and len(done.tokens) > 200
    late = coordinator.handle(done.job_id)
    cursor = StreamCursor(done.job_id)
    replayed = list(late.stream(timeout=10, cursor=cursor))
    assert cursor.gaps and cursor.gaps[0][0] == 1  # the oldest events are gone
    assert replayed[0].seq > 1
    assert "".join(late.text_stream(timeout=10)) == done.text
