"""Capacity vs request: what a worker was loaded with (method, N, D) can only be narrowed.

``submit --rollback-depth`` used to be validated and then ignored: the worker's D is fixed at
load. Now a request asking for what its worker cannot do is refused at submit (and again by
the worker, for a request that bypassed the coordinator), never served with a substitute.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import specfleet
from rq.queue import Queue
from rq.serializers import JSONSerializer

from coordinator.client import Coordinator
from coordinator.validation import SubmitError
from shared.protocol import JOB_FUNCTION, JobStatus
from shared.settings import Settings

from .workers import MODEL_NAME, Fleet

BASE = {"model": MODEL_NAME, "prompt_tokens": [5, 3, 5, 3, 5], "max_tokens": 24}
LOADED = ("--ctx", "512", "--spec", "mtp", "--draft-max", "4", "--rollback-depth", "2")


@pytest.fixture
def hybrid_fleet(settings: Settings, hybrid_model: Path, tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(settings, hybrid_model, tmp_path)
    yield f
    f.stop_all()


def test_a_request_may_narrow_the_workers_capacity_but_never_widen_it(
        hybrid_fleet: Fleet, coordinator: Coordinator) -> None:
    hybrid_fleet.start("w1", args=LOADED)
    with pytest.raises(SubmitError, match="rollback_depth 1 is not the worker's 2"):
        coordinator.submit({**BASE, "speculative": {"rollback_depth": 1}})
    with pytest.raises(SubmitError, match="draft_max 8 exceeds the worker's draft width 4"):
        coordinator.submit({**BASE, "speculative": {"draft_max": 8}})

    narrowed = coordinator.submit({**BASE, "speculative": {"method": "mtp", "draft_max": 3,
                                                           "rollback_depth": 2}})
    result = narrowed.result(timeout=60)
    assert result.status is JobStatus.FINISHED
    assert result.telemetry is not None
    assert (result.telemetry.draft_max, result.telemetry.rollback_depth) == (3, 2)
    plain = coordinator.submit({**BASE, "speculative": {"method": "none"}}).result(timeout=60)
    assert plain.status is JobStatus.FINISHED and plain.tokens == result.tokens

    # Bypassing the coordinator: the worker applies the same rule before generating.
    queue = Queue(coordinator.keys.queue(MODEL_NAME), connection=coordinator.connection,
                  serializer=JSONSerializer)
    job = queue.enqueue(JOB_FUNCTION, {**BASE, "speculative": {"rollback_depth": 1}})
    refused = coordinator.handle(job.id).result(timeout=30)
    assert refused.status is JobStatus.FAILED
    assert refused.error and "rollback_depth 1 is not the worker's 2" in refused.error
    assert hybrid_fleet.alive("w1")

    env = hybrid_fleet.env(0.0, {})
    cli = specfleet("submit", "--model", MODEL_NAME, "--prompt-tokens", "1,2",
                    "--max-tokens", "4", "--rollback-depth", "3", env=env, timeout=60)
    assert cli.returncode == 2 and cli.stdout == ""
    assert cli.stderr.count("\n") == 1 and "rollback_depth 3 is not the worker's 2" in cli.stderr


def test_rollback_depth_on_a_model_that_is_not_recurrent_is_refused(
        fleet: Fleet, coordinator: Coordinator) -> None:
    fleet.start("w1")
    with pytest.raises(SubmitError, match="rollback_depth does not apply"):
        coordinator.submit({**BASE, "speculative": {"rollback_depth": 2}})
