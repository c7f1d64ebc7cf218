"""Validation at submit: every bad request is a clear error and nothing is queued."""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings

from coordinator.client import Coordinator
from coordinator.validation import SubmitError
from shared.protocol import WorkerInfo
from shared.settings import Settings

from .strategies import VALID_FOR_MODEL_M as VALID
from .strategies import malformed_requests

MODEL = "m"


def _register(coordinator: Coordinator, name: str, n_ctx: int, model: str = MODEL) -> None:
    """A registration as a live worker writes it (the registry is what admission reads)."""
    now = time.time()
    coordinator.registry.register(WorkerInfo(
        name=name, model_name=model, model_path="/m.gguf", device="cpu", n_ctx=n_ctx,
        version="test", pid=1, host="h", started_at=now, heartbeat_at=now))


def _queued(coordinator: Coordinator) -> int:
    return sum(coordinator.queue_depths(MODEL).values())


def test_unknown_model_is_refused(coordinator: Coordinator) -> None:
    _register(coordinator, "w", 512)
    with pytest.raises(SubmitError, match=r"unknown model 'other' \(known models: m;"):
        coordinator.submit({**VALID, "model": "other"})


def test_model_without_live_worker_is_refused_or_queued(settings: Settings) -> None:
    strict = Coordinator(settings)
    _register(strict, "w", 512)
    strict.registry.deregister("w")  # the model is known, its last worker left
    with pytest.raises(SubmitError, match="no live worker serves model 'm'"):
        strict.submit(VALID)
    assert _queued(strict) == 0
    lenient = Coordinator(settings.model_copy(update={"require_live_worker": False}))
    lenient.submit(VALID)
    assert _queued(lenient) == 1


def test_context_is_checked_against_the_largest_worker(coordinator: Coordinator) -> None:
    _register(coordinator, "small", 256)
    _register(coordinator, "large", 1024)
    coordinator.submit({**VALID, "prompt_tokens": [1] * 24, "max_tokens": 1000})
    with pytest.raises(SubmitError, match=r"prompt \(25 tokens\) \+ max_tokens \(1000\) exceeds "
                                          r"the largest context of model 'm' workers "
                                          r"\(1024 tokens\)"):
        coordinator.submit({**VALID, "prompt_tokens": [1] * 25, "max_tokens": 1000})
    with pytest.raises(SubmitError, match="at least 1 token"):
        coordinator.submit({"model": MODEL, "prompt": "hi", "max_tokens": 1024})
    assert _queued(coordinator) == 1


@hsettings(max_examples=150, deadline=None,
           suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much])
@given(request=malformed_requests())
def test_fuzzed_requests_are_refused_with_clear_errors(coordinator: Coordinator,
                                                       request: object) -> None:
    _register(coordinator, "w", 4096)
    before = _queued(coordinator)
    try:
        coordinator.submit(request)  # type: ignore[arg-type]
    except SubmitError as exc:
        message = str(exc)
        assert message and "Traceback" not in message
        assert ("invalid request:" in message or "must be a JSON object" in message
                or "unknown model" in message or "exceeds" in message)
        assert _queued(coordinator) == before
    else:  # the mutation happened to be valid (e.g. sampling={}): it was queued
        assert _queued(coordinator) == before + 1
