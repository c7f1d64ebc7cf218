"""Batches that live in Redis: every line accounted once, by whoever writes its final event.

The accounting runs in the final-event script, so the tests reach it through each writer: a
worker finishing, a cancel withdrawing a queued job, crash recovery re-running a killed
worker's job, and a line that never became a job. Also issue 9 item 6 (one line of invalid
UTF-8 is a per-line error) and item 16 (``--out`` is in input order, errors included).
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from helpers import specfleet

from coordinator.batch import BatchStore
from coordinator.client import Coordinator
from coordinator.openai_api.requests import NATIVE
from shared.event_stream import EventWriter
from shared.protocol import JobStatus, WorkerInfo

from .workers import MODEL_NAME, Fleet


def _lines(*bodies: dict | bytes) -> bytes:
    return b"".join((b if isinstance(b, bytes) else json.dumps(b).encode()) + b"\n"
                    for b in bodies)


def _request(n: int, max_tokens: int = 6) -> dict:
    return {"custom_id": f"r{n}", "body": {"model": MODEL_NAME, "prompt_tokens": [n, 2],
                                            "max_tokens": max_tokens}}


def _wait_ended(store: BatchStore, batch_id: str, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while (batch := store.get(batch_id))["status"] not in ("completed", "cancelled"):
        assert time.monotonic() < deadline, f"batch still {batch['status']}"
        time.sleep(0.1)
    return batch


def test_cancelling_a_queued_batch_accounts_every_line(coordinator: Coordinator) -> None:
    _idle_worker(coordinator)
    store = BatchStore(coordinator)
    upload = store.files.upload(_lines(_request(1), _request(2), b"\xff oops"), "in.jsonl")
    batch = store.create(upload["id"], NATIVE)
    assert batch["status"] == "validating"
    assert store.advance(batch["id"])
    batch = store.get(batch["id"])
    assert batch["status"] == "in_progress"
    assert batch["request_counts"] == {"total": 3, "completed": 0, "failed": 1}
    batch = store.cancel(batch["id"])
    assert batch["status"] == "cancelled"  # the withdrawn jobs' final events ended it
    assert batch["request_counts"] == {"total": 3, "completed": 0, "failed": 3}
    errors = list(store.result_lines(batch["id"], "errors"))
    assert [(e["line"], e["error"]["code"]) for e in errors] == [
        (1, "cancelled"), (2, "cancelled"), (3, "invalid_request")]
    assert sum(coordinator.queue_depths(MODEL_NAME).values()) == 0
    for key in (coordinator.keys.batch(batch["id"]), coordinator.keys.batch_results(batch["id"]),
                coordinator.keys.batch_jobs(batch["id"])):
        assert 0 < coordinator.connection.ttl(key) <= coordinator.settings.result_ttl_seconds


def _idle_worker(coordinator: Coordinator) -> None:
    """A registered worker that never takes jobs: submitted lines stay queued."""
    now = time.time()
    coordinator.registry.register(WorkerInfo(
        name="w", model_name=MODEL_NAME, model_path="/m.gguf", device="cpu", n_ctx=512,
        version="test", pid=1, host="h", started_at=now, heartbeat_at=now))


def test_a_repeated_or_stale_final_event_counts_once(coordinator: Coordinator) -> None:
    _idle_worker(coordinator)
    store = BatchStore(coordinator)
    batch = store.create(store.files.upload(_lines(_request(1)), "in.jsonl")["id"], NATIVE)
    assert store.advance(batch["id"])
    job_id = json.loads(coordinator.connection.hget(coordinator.keys.batch_jobs(batch["id"]),
                                                    "1"))["job_id"]

    def final(attempt: int, status: JobStatus, tokens: list[int]) -> None:
        EventWriter(coordinator.connection, coordinator.keys, job_id, attempt).final(
            status=status, tokens=tokens)

    final(2, JobStatus.FINISHED, [4, 5, 6])
    final(2, JobStatus.FINISHED, [4, 5, 6])  # the same append retried through an outage
    final(1, JobStatus.FAILED, [])  # a stalled first attempt reporting late
    batch = store.get(batch["id"])
    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": 1, "completed": 1, "failed": 0}
    assert batch["specfleet"]["generated_tokens"] == 3
    [line] = store.result_lines(batch["id"], "all")
    assert line["response"]["body"]["tokens"] == [4, 5, 6]


def test_a_killed_workers_line_is_accounted_once(fleet: Fleet, coordinator: Coordinator) -> None:
    fleet.start("w0", step_delay=0.03, wait=False)
    fleet.start("w1", step_delay=0.03)
    fleet.wait_registered("w0")
    store = BatchStore(coordinator)
    upload = store.files.upload(_lines(*[_request(n, 24) for n in range(1, 5)]), "in.jsonl")
    batch = store.create(upload["id"], NATIVE)
    assert store.advance(batch["id"])
    job_id = json.loads(coordinator.connection.hget(coordinator.keys.batch_jobs(batch["id"]),
                                                    "1"))["job_id"]
    fleet.kill_runner(coordinator.handle(job_id).stream(timeout=60))
    fleet.start("w2", step_delay=0.03, wait=False)
    batch = _wait_ended(store, batch["id"])
    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": 4, "completed": 4, "failed": 0}
    assert batch["specfleet"]["generated_tokens"] == 4 * 24  # the re-run replaced attempt 1
    [first, *_] = store.result_lines(batch["id"], "output")
    assert first["line"] == 1 and first["response"]["body"]["attempts"] == 2


def _cli(fleet: Fleet, *args: str) -> subprocess.CompletedProcess[str]:
    return specfleet(*args, env=fleet.env(0.0, {}))


def test_invalid_utf8_line_is_its_own_error_and_out_keeps_input_order(
        fleet: Fleet, tmp_path: Path) -> None:
    fleet.start("w1")
    source = tmp_path / "in.jsonl"
    source.write_bytes(_lines(_request(1), b'{"custom_id": "x", "body": {"prompt": "\xc3\x28"}}',
                              _request(3), b"{not json", _request(5)))
    out = tmp_path / "out.jsonl"
    proc = _cli(fleet, "batch", str(source), "--model", MODEL_NAME, "--out", str(out))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["line"] for x in lines] == [1, 2, 3, 4, 5]  # errors where their input was
    assert [x["error"] is None for x in lines] == [True, False, True, False, True]
    assert lines[1]["error"]["message"] == "line 2: not valid UTF-8 (byte 39)"
    assert all(len(x["response"]["body"]["tokens"]) == 6 for x in lines if x["error"] is None)
    assert "3 completed, 0 failed, 2 invalid" in proc.stderr


def test_batch_sub_commands_share_one_batch(fleet: Fleet, tmp_path: Path) -> None:
    fleet.start("w1")
    source = tmp_path / "in.jsonl"
    source.write_bytes(_lines(_request(1), _request(2)))
    submitted = _cli(fleet, "batch", "submit", str(source), "--model", MODEL_NAME, "--wait")
    printed_id, ended = submitted.stdout.splitlines()  # the id first, the ended batch last
    batch = json.loads(ended)
    assert submitted.returncode == 0 and batch["status"] == "completed"
    assert printed_id == batch["id"]
    batch_id = batch["id"]
    out = tmp_path / "out.jsonl"
    done = _cli(fleet, "batch", "results", batch_id, "--out", str(out))
    assert done.returncode == 0 and "2 completed" in done.stderr
    assert [json.loads(x)["custom_id"] for x in out.read_text().splitlines()] == ["r1", "r2"]
    listed = [json.loads(x)["id"] for x in _cli(fleet, "batch", "list").stdout.splitlines()]
    assert batch_id in listed
    missing = _cli(fleet, "batch", "status", "batch_nope")
    assert missing.returncode == 1 and "no such batch: batch_nope" in missing.stderr
