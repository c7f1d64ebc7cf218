"""llama.cpp's own log lines and rq's (stdlib ``logging``) text logs reach the structured JSON
log as events with fields, at a level an operator filters with ``SPECFLEET_LOG_LEVEL``."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.logs import configure_logging
from shared.protocol import SpecMethod
from worker.engine.engine import EngineConfig, SpeculativeEngine
from worker.launch import EngineCapacity


@pytest.fixture
def log_to() -> Iterator[io.StringIO]:
    buf = io.StringIO()
    yield buf
    configure_logging()  # back to the default (stderr) for whatever runs next


def _events(buf: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in buf.getvalue().splitlines()]


def _load(model: Path) -> None:
    config = EngineConfig(str(model), n_ctx=64, n_threads=1,
                          capacity=EngineCapacity(method=SpecMethod.NONE))
    SpeculativeEngine(config).close()


def test_llama_cpp_lines_are_llama_log_events_at_debug(dense_model: Path,
                                                       log_to: io.StringIO) -> None:
    configure_logging("debug", "json", log_to)
    _load(dense_model)
    events = _events(log_to)  # every line is JSON: nothing raw reached this stream
    llama = [e for e in events if e["event"] == "llama.log"]
    assert any(e["line"].startswith("llama_model_loader:") and e["llama_level"] == "info"
               for e in llama)
    assert all(e["component"] == "llama" and e["line"] and "timestamp" in e for e in llama)
    assert {e["level"] for e in llama if e["llama_level"] in ("info", "debug")} == {"debug"}


def test_llama_cpp_chatter_is_filtered_at_info(dense_model: Path, log_to: io.StringIO) -> None:
    configure_logging("info", "json", log_to)
    _load(dense_model)
    assert [e for e in _events(log_to) if e["event"] == "llama.log"] == []


def test_rq_text_logs_become_redacted_rq_log_events(log_to: io.StringIO) -> None:
    configure_logging("info", "json", log_to)
    rq_log = logging.getLogger("rq.worker")
    rq_log.warning("Worker %s: lost connection to %s", "w1", "redis://app:s3cret@db:6379/0")
    rq_log.debug("below the level: dropped")
    (event,) = _events(log_to)
    assert event["event"] == "rq.log" and event["level"] == "warning"
    assert event["logger"] == "rq.worker"
    assert event["message"] == "Worker w1: lost connection to redis://app:***@db:6379/0"
