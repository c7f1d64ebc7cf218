"""A worker checks and compiles a job's constraint where it can neither crash the worker nor
stall its other slots: the check in the sandbox's child process, the compile against the
vocabulary on a thread of its own, beside the decode.

The jobs here are written straight onto the worker's queue, as a client that bypasses the
coordinator's own check would (an old client, or a hostile one with Redis access)."""

from __future__ import annotations

from typing import Any

from rq.queue import Queue
from rq.serializers import JSONSerializer

from coordinator.client import Coordinator
from shared.protocol import JOB_FUNCTION, AnyEvent, FinalEvent, JobStatus, ProgressEvent

from .workers import CTX, MODEL_NAME, Fleet

from probes import chained_lark, pattern_properties_schema  # isort: skip

#: One token a step, a step at least 20 ms: decoding for seconds.
LONG = {"model": MODEL_NAME, "prompt_tokens": [1, 2, 3], "max_tokens": 300,
        "speculative": {"method": "none"}}


def _enqueue(coordinator: Coordinator, request: dict[str, Any]) -> str:
    queue = Queue(coordinator.keys.queue(MODEL_NAME), connection=coordinator.connection,
                  serializer=JSONSerializer)
    return queue.enqueue(JOB_FUNCTION, request).id


def _events(coordinator: Coordinator, job_id: str) -> list[AnyEvent]:
    return list(coordinator.handle(job_id).stream(timeout=60))


def _started_at(events: list[AnyEvent]) -> float:
    return next(e.ts for e in events if isinstance(e, ProgressEvent) and e.stage == "started")


def test_constraints_that_would_crash_or_stall_fail_alone(fleet: Fleet,
                                                          coordinator: Coordinator) -> None:
    """A grammar that overflowed llguidance's stack in-process and a schema that took tens of
    seconds to compile each fail their own job naming the limit, while the job in the other
    slot decodes on through both (its tokens keep coming between their start and their end)
    and the worker lives on."""
    fleet.start("w1", step_delay=0.02, args=("--ctx", str(CTX), "--slots", "2"))
    long_id = coordinator.submit(LONG).job_id
    first = coordinator.handle(long_id).stream(timeout=60)
    while not any(e.type == "token" for e in [next(first)]):
        pass  # the long job is decoding: the probes share the worker with it
    probes = {"crash": {"model": MODEL_NAME, "prompt_tokens": [1, 2], "max_tokens": 4,
                        "constraint": {"kind": "lark", "grammar": chained_lark()}},
              "stall": {"model": MODEL_NAME, "prompt_tokens": [1, 2], "max_tokens": 4,
                        "constraint": {"kind": "json_schema",
                                       "json_schema": pattern_properties_schema()}}}
    limits = {"crash": "nests too deeply to compile", "stall": "did not compile within"}
    ended = {name: _events(coordinator, _enqueue(coordinator, request))
             for name, request in probes.items()}
    tokens = [e.ts for e in _events(coordinator, long_id) if e.type == "token"]
    for name, events in ended.items():
        final = events[-1]
        assert isinstance(final, FinalEvent) and final.status is JobStatus.FAILED, final
        assert final.error is not None and limits[name] in final.error, final.error
        assert "Traceback" not in final.error
        during = [ts for ts in tokens if _started_at(events) < ts < final.ts]
        assert during, f"the other slot committed nothing while the {name} probe was checked"
    final = _events(coordinator, long_id)[-1]
    assert isinstance(final, FinalEvent) and final.status is JobStatus.FINISHED
    assert len(final.tokens) == LONG["max_tokens"]
    after = coordinator.submit({**LONG, "max_tokens": 4}).result(timeout=30)
    assert after.status is JobStatus.FINISHED and fleet.alive("w1")
