"""The service's command line: submit, fleet, cancel and batch against a real worker."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from helpers import specfleet

from coordinator.client import Coordinator
from shared.protocol import JobStatus

from .workers import CTX, MODEL_NAME, Fleet, wait_rq_ended


def _cli(fleet: Fleet, *args: str) -> subprocess.CompletedProcess[str]:
    env = fleet.env(0.0, {"SPECFLEET_LOG_LEVEL": "warning"})
    return specfleet(*args, env=env)


def test_submit_json_equals_generate_in_process(fleet: Fleet, dense_model: Path) -> None:
    """Sampled with a seed (the default ``--spec auto``): the fleet and the in-process
    engine give the same tokens; without ``--seed`` the one drawn at submit is reported and
    repeats the run."""
    fleet.start("w1")
    args = ("--prompt-tokens", "5,6,7", "--max-tokens", "24", "--temperature", "0.9",
            "--top-k", "40")
    submitted = _cli(fleet, "submit", "--model", MODEL_NAME, *args, "--json")
    assert submitted.returncode == 0, submitted.stderr
    result = json.loads(submitted.stdout)
    assert {"job_id", "tokens", "text", "telemetry", "worker", "attempts", "seed"} <= set(result)
    seed = str(result["seed"])
    generated = _cli(fleet, "generate", "--model", str(dense_model), "--ctx", str(CTX),
                     "--threads", "1", *args, "--seed", seed, "--json")
    assert generated.returncode == 0, generated.stderr
    assert result["tokens"] == json.loads(generated.stdout)["tokens"]
    assert result["worker"] == "w1" and result["attempts"] == 1

    streamed = _cli(fleet, "submit", "--model", MODEL_NAME, *args, "--seed", seed, "--stream")
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout == result["text"] + "\n"
    assert f"; seed {seed} (--seed {seed} repeats it)" in streamed.stderr


def test_submit_errors_are_one_line_and_non_zero(fleet: Fleet) -> None:
    fleet.start("w1")
    unknown = _cli(fleet, "submit", "--model", "nope", "--prompt", "x", "--max-tokens", "4")
    too_long = _cli(fleet, "submit", "--model", MODEL_NAME, "--prompt-tokens", "1,2",
                    "--max-tokens", str(CTX))
    for proc, needle in ((unknown, "unknown model 'nope'"), (too_long, "exceeds")):
        assert proc.returncode == 2
        assert proc.stderr.startswith("specfleet: error:") and needle in proc.stderr


@pytest.mark.parametrize(("args", "needle"), [
    (["submit", "--model", "m", "--prompt", "x", "--max-tokens", "many"], "'--max-tokens'"),
    (["submit", "--prompt", "x", "--max-tokens", "4"], "'--model'"),
    (["fleet", "--bogus"], "--bogus"),
    (["nosuch"], "nosuch"),
])
def test_usage_errors_are_one_line_and_exit_2(args: list[str], needle: str) -> None:
    proc = specfleet(*args, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specfleet: error:") and needle in lines[0]


def test_a_bad_environment_is_a_one_line_error() -> None:
    env = {**os.environ, "SPECFLEET_HEARTBEAT_SECONDS": "often"}
    proc = specfleet("fleet", env=env, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "specfleet: error: invalid SPECFLEET_* environment: heartbeat_seconds: "
        "Input should be a valid number, unable to parse string as a number"]


def test_batch_output_that_cannot_be_written_is_a_one_line_error(tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text("{}\n")
    out = tmp_path / "missing-dir" / "out.jsonl"
    proc = specfleet("batch", str(source), "--model", "m", "--out", str(out), timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"specfleet: error: {out}: No such file or directory"]


def test_fleet_and_cancel(fleet: Fleet, coordinator: Coordinator) -> None:
    fleet.start("w1", step_delay=0.05)
    listed = json.loads(_cli(fleet, "fleet", "--json").stdout)
    assert [w["name"] for w in listed["workers"]] == ["w1"]
    assert listed["workers"][0]["n_ctx"] == CTX
    handle = coordinator.submit({"model": MODEL_NAME, "prompt_tokens": [1, 2],
                                 "max_tokens": 300, "speculative": {"method": "none"}})
    next(iter(handle.stream(timeout=30)))  # it has started
    deadline = time.monotonic() + 30
    while handle.job_id[:8] not in (table := _cli(fleet, "fleet").stdout):
        assert time.monotonic() < deadline, table  # the next heartbeat lists the job
    assert "1/1" in table  # busy slots / slots
    assert f"{MODEL_NAME}: nothing queued (chat template: default:chatml)" in table
    cancelled = _cli(fleet, "cancel", handle.job_id)
    assert cancelled.returncode == 0 and handle.job_id in cancelled.stdout
    assert handle.result(timeout=30).status is JobStatus.CANCELLED
    wait_rq_ended(coordinator, handle.job_id)
    again = _cli(fleet, "cancel", handle.job_id)
    assert again.returncode == 1 and "has already ended (finished)" in again.stderr
    unknown = _cli(fleet, "cancel", "no-such-job")
    assert unknown.returncode == 1 and "no such job: no-such-job" in unknown.stderr


def test_batch_reports_bad_lines_and_keeps_going(fleet: Fleet, tmp_path: Path) -> None:
    fleet.start("w1")
    lines = [
        {"custom_id": "a", "body": {"prompt_tokens": [1, 2], "max_tokens": 8}},
        "{not json",
        {"custom_id": "b", "body": {"prompt_tokens": [3], "max_tokens": 0}},
        {"custom_id": "c", "body": {"prompt": "hello", "max_tokens": 8}},
        {"custom_id": "d", "body": {}},
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines)
                      + "\n")
    out, errors = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    proc = _cli(fleet, "batch", str(source), "--model", MODEL_NAME, "--out", str(out),
                "--errors", str(errors))
    assert proc.returncode == 1  # some lines were bad
    results = [json.loads(x) for x in out.read_text().splitlines()]
    failures = [json.loads(x) for x in errors.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == ["a", "c"]
    assert all(len(r["response"]["body"]["tokens"]) == 8 for r in results)
    assert sorted(f["line"] for f in failures) == [2, 3, 5]
    assert all(f["error"]["message"].startswith(f"line {f['line']}:") for f in failures)
    assert "2 completed" in proc.stderr and "3 invalid" in proc.stderr
