"""Submit -> stream -> result through real Redis and real worker processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.client import Coordinator
from coordinator.validation import SubmitError
from shared.protocol import FinalEvent, JobStatus, ProgressEvent, SpecSettings, TokenEvent
from worker.engine.engine import EngineConfig, SpeculativeEngine

from .workers import CTX, MODEL_NAME, Fleet

PROMPT = [1, 2, 3, 4, 5]


def _in_process(model: Path, prompt: list[int], max_tokens: int) -> list[int]:
    """What ``specfleet generate`` computes: the engine in this process, same settings."""
    with SpeculativeEngine(EngineConfig(model_path=str(model), n_ctx=CTX, n_threads=1)) as engine:
        return engine.generate(prompt, max_tokens, SpecSettings()).tokens


def test_stream_and_result_equal_in_process_generate(fleet: Fleet, coordinator: Coordinator,
                                                      dense_model: Path) -> None:
    fleet.start("w1")
    handle = coordinator.submit({"model": MODEL_NAME, "prompt_tokens": PROMPT,
                                 "max_tokens": 48})
    events = list(handle.stream(timeout=60))
    result = handle.result(timeout=5)

    expected = _in_process(dense_model, PROMPT, 48)
    assert result.status is JobStatus.FINISHED
    assert result.tokens == expected
    streamed = [t for e in events if isinstance(e, TokenEvent) for t in e.tokens]
    assert streamed == expected
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert {e.job_id for e in events} == {handle.job_id}
    assert {e.attempt for e in events} == {1}
    assert isinstance(events[0], ProgressEvent) and events[0].stage == "started"
    assert isinstance(events[1], ProgressEvent) and (events[1].done, events[1].total) == (0, 48)
    assert isinstance(events[-1], FinalEvent)
    assert result.worker == "w1" and result.attempts == 1
    assert result.telemetry is not None and result.telemetry.generated_tokens == 48


def test_text_prompt_is_tokenized_by_the_worker(fleet: Fleet, coordinator: Coordinator,
                                                 dense_model: Path) -> None:
    fleet.start("w1")
    result = coordinator.submit({"model": MODEL_NAME, "prompt": "abc", "max_tokens": 16,
                                 "speculative": {"method": "none"}}).result(timeout=60)
    with SpeculativeEngine(EngineConfig(model_path=str(dense_model), n_ctx=CTX,
                                        n_threads=1)) as engine:
        expected = engine.generate(engine.tokenize("abc"), 16,
                                   SpecSettings(method="none")).tokens
    assert result.status is JobStatus.FINISHED
    assert result.tokens == expected


def test_two_workers_share_a_queue(fleet: Fleet, coordinator: Coordinator) -> None:
    fleet.start("w1", step_delay=0.01, wait=False)
    fleet.start("w2", step_delay=0.01)
    fleet.wait_registered("w1")
    handles = [coordinator.submit({"model": MODEL_NAME, "prompt_tokens": [i + 1, 7, 9],
                                   "max_tokens": 24}) for i in range(6)]
    results = [h.result(timeout=60) for h in handles]
    assert all(r.status is JobStatus.FINISHED and len(r.tokens) == 24 for r in results)
    assert {r.worker for r in results} == {"w1", "w2"}


def test_heartbeat_keeps_a_long_job_alive(fleet: Fleet, coordinator: Coordinator) -> None:
    """A job running for several worker TTLs is not mistaken for a crash (no re-run): the
    other worker is idle and would take a requeued job. Both step slowly, since either may
    be the one that takes it."""
    fleet.start("w1", step_delay=0.1)
    fleet.start("w2", step_delay=0.1)
    handle = coordinator.submit({"model": MODEL_NAME, "prompt_tokens": PROMPT,
                                 "max_tokens": 40, "speculative": {"method": "none"}})
    result = handle.result(timeout=60)
    assert result.status is JobStatus.FINISHED
    assert result.attempts == 1
    assert result.telemetry is not None
    assert result.telemetry.wall_seconds > 2 * coordinator.settings.worker_ttl_seconds


def test_worker_fits_its_context_and_publishes_the_report(fleet: Fleet,
                                                         coordinator: Coordinator) -> None:
    fleet.start("w1", args=("--budget-mib", "64", "--fit-target-mib", "8", "--ctx-min", "256"))
    (info,) = coordinator.fleet()
    assert info.fit is not None
    assert info.n_ctx == info.fit.n_ctx and info.n_ctx % 256 == 0
    assert info.fit.budget_bytes == 56 * 1024 * 1024
    assert info.fit.total_bytes <= info.fit.budget_bytes
    too_long = {"model": MODEL_NAME, "prompt_tokens": [1] * 8, "max_tokens": info.n_ctx}
    with pytest.raises(SubmitError, match="exceeds the largest context"):
        coordinator.submit(too_long)
