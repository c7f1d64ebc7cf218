"""The batch's Redis record outlives nothing: it expires even when a run dies half-way."""

from __future__ import annotations

import io
import json
import time

import pytest

from coordinator.batch import run_batch
from coordinator.client import Coordinator
from shared.protocol import WorkerInfo


def test_batch_hash_expires_when_the_run_times_out(coordinator: Coordinator) -> None:
    now = time.time()  # a registered worker that never takes the job
    coordinator.registry.register(WorkerInfo(
        name="w", model_name="m", model_path="/m.gguf", device="cpu", n_ctx=512,
        version="test", pid=1, host="h", started_at=now, heartbeat_at=now))
    line = json.dumps({"custom_id": "a", "body": {"prompt_tokens": [1, 2], "max_tokens": 4}})
    with pytest.raises(TimeoutError):
        run_batch(coordinator, [line], io.StringIO(), model="m", timeout=0.2)
    [key] = coordinator.connection.keys(coordinator.keys.batch("*"))
    record = coordinator.connection.hgetall(key)
    assert record[b"status"] == b"in_progress"
    assert 0 < coordinator.connection.ttl(key) <= coordinator.settings.result_ttl_seconds
    for job_id in json.loads(record[b"job_ids"]):
        assert coordinator.cancel(job_id)  # withdrawn: leaves nothing queued behind
