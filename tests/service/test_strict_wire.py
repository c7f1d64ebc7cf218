"""Strict wire validation end to end: a request with a coerced type is refused at submit, and
a worker refuses one that reached its queue another way (``max_tokens: true`` used to run one
token); messages carry our sentence, never pydantic's "Value error," prefix."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from helpers import specfleet
from rq.queue import Queue
from rq.serializers import JSONSerializer

from coordinator.client import Coordinator, SubmitError
from shared.protocol import JOB_FUNCTION, JobStatus

from .workers import MODEL_NAME, Fleet

BAD = [
    ({"max_tokens": True}, "max_tokens: Input should be a valid integer"),
    ({"max_tokens": "10"}, "max_tokens: Input should be a valid integer"),
    ({"prompt_tokens": ["1", 2.0]}, "prompt_tokens.0: Input should be a valid integer; "
                                    "prompt_tokens.1: Input should be a valid integer"),
]


def _request(**fields: object) -> dict[str, object]:
    return {"model": MODEL_NAME, "prompt_tokens": [1, 2, 3], "max_tokens": 4,
            "speculative": {"method": "none"}, **fields}


@pytest.mark.parametrize(("fields", "message"), BAD)
def test_submit_refuses_coerced_types(fleet: Fleet, coordinator: Coordinator,
                                      fields: dict[str, object], message: str) -> None:
    fleet.start("w")
    with pytest.raises(SubmitError) as err:
        coordinator.submit(_request(**fields))
    assert str(err.value) == f"invalid request: {message}"


def test_a_worker_refuses_coerced_types_that_reached_its_queue(
        fleet: Fleet, coordinator: Coordinator) -> None:
    """rq hands the worker the request as a dict: strict there too, and it keeps serving."""
    fleet.start("w")
    queue = Queue(coordinator.keys.queue(MODEL_NAME), connection=coordinator.connection,
                  serializer=JSONSerializer)
    ids = []
    for fields, _ in BAD:
        ids.append(uuid.uuid4().hex)
        queue.enqueue(JOB_FUNCTION, _request(**fields), job_id=ids[-1],
                      result_ttl=60, failure_ttl=60)
    for job_id, (_, message) in zip(ids, BAD, strict=True):
        result = coordinator.handle(job_id).result(timeout=60)
        assert result.status is JobStatus.FAILED
        assert result.error == f"invalid request: {message}"
    good = coordinator.submit(_request(max_tokens=3)).result(timeout=60)
    assert good.status is JobStatus.FINISHED and len(good.tokens) == 3
    assert fleet.alive("w")


@pytest.mark.parametrize(("args", "line"), [
    (["submit", "--model", "m", "--max-tokens", "3", "--prompt", "hi", "--priority", "bogus"],
     "specfleet: error: Invalid value for '--priority': 'bogus' is not one of 'normal', "
     "'high'. (see specfleet submit --help)"),
    (["fit", "--model", "m.gguf", "--draft-max", "2", "--rollback-depth", "3"],
     "specfleet: error: rollback_depth (3) must satisfy 1 <= rollback_depth <= "
     "draft_max (2)"),
])
def test_cli_messages_carry_our_sentence(tmp_path: Path, args: list[str], line: str) -> None:
    proc = specfleet(*args, cwd=tmp_path, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == line
