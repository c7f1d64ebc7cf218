"""``specfleet monitor`` over the real JSON log of the live run: its counts equal the engine
telemetry of the same run; bad lines are counted, never fatal; alerts are exit codes."""

from __future__ import annotations

import json
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from helpers import SPECFLEET, specfleet

from coordinator.monitor import parse_since

from .conftest import PROMPTS, WORKER, LiveRun

FIELDS = ("drafts", "drafted", "accepted", "target_decodes", "generated_tokens",
          "prompt_tokens", "replay_events", "replay_tokens", "checkpoint_saves")


def monitor(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return specfleet("monitor", *args, stdin=stdin, timeout=60)


def summary(*args: str, stdin: str | None = None) -> dict:
    proc = monitor("--json", *args, stdin=stdin)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_per_worker_model_and_job_counts_equal_the_engine_telemetry(live_run: LiveRun) -> None:
    out = summary(str(live_run.log))
    assert out["unparseable"] == 0, "a worker wrote a line that is not a JSON event"
    lifetime = live_run.info.telemetry
    assert lifetime is not None
    for group in (out["workers"][WORKER], out["models"]["tiny"], out["total"]):
        assert group["generations"] == len(PROMPTS)
        for field in FIELDS:
            assert group[field] == getattr(lifetime, field), field
        assert group["accepted_per_position"] == lifetime.accepted_per_position
        assert group["drafted_per_position"] == lifetime.drafted_per_position
        assert group["tokens_per_verify"] == lifetime.tokens_per_verify
        assert group["acceptance"] == lifetime.acceptance
        assert group["jobs_finished"] == len(PROMPTS)
        assert group["jobs_started"] == len(PROMPTS) + 1  # and the rejected one
        assert group["failures_by_type"] == {"context": 1}
        assert group["refusals"] == group["requeues"] == 0
        # The start-up fallback precedes worker.registered: it still belongs to the worker.
        assert group["host_fallbacks_by_reason"] == {"fault_injection": 1}
    jobs = {r.job_id: r for r in live_run.results}
    assert set(out["jobs"]) == set(jobs)
    for job_id, job in out["jobs"].items():
        assert job["workers"] == [WORKER] and job["attempts"] == 1
        telemetry = jobs[job_id].telemetry
        if telemetry is None:  # the rejected job
            assert job["outcome"] == "failed" and job["failures"] == 1
            assert job["generations"] == 0
            continue
        assert job["outcome"] == "finished"
        for field in FIELDS:
            assert job[field] == getattr(telemetry, field), field


def test_unparseable_lines_are_counted_and_skipped(live_run: LiveRun, tmp_path: Path) -> None:
    clean = summary(str(live_run.log))
    noisy = tmp_path / "noisy.log"
    noisy.write_text("not json at all\n[1, 2]\n{\"no_event\": 1}\n"
                     + live_run.log.read_text() + "{truncated")
    out = summary(str(noisy))
    assert out["unparseable"] == 4
    assert out["workers"] == clean["workers"]
    assert out["records"] == clean["records"]


def test_globs_stdin_and_since(live_run: LiveRun, tmp_path: Path) -> None:
    text = live_run.log.read_text()
    (tmp_path / "a.log").write_text(text)
    (tmp_path / "b.log").write_text(text)
    both = summary(str(tmp_path / "*.log"))
    once = summary(str(live_run.log))
    assert both["total"]["generations"] == 2 * once["total"]["generations"]
    piped = summary("-", stdin=text)
    assert piped["workers"] == once["workers"]
    last = max(json.loads(line)["timestamp"] for line in text.splitlines() if line.startswith("{"))
    after = summary("--since", "2999-01-01T00:00:00Z", str(live_run.log))
    assert after["records"] == 0 and after["before_since"] > 0
    upto = summary("--since", last, str(live_run.log))
    assert 0 < upto["records"] < once["records"]


def test_fail_on_conditions_are_exit_codes(live_run: LiveRun) -> None:
    log = str(live_run.log)
    tripped = monitor("--json", "--fail-on", "host_fallbacks>0", log)
    assert tripped.returncode == 1
    assert "host_fallbacks>0 holds for total, m1" in tripped.stderr
    assert json.loads(tripped.stdout)["alerts"] == ["host_fallbacks>0 holds for total, m1"]
    clear = monitor("--fail-on", "replay_ratio>0.99", "--fail-on", "refusals>0", log)
    assert clear.returncode == 0, clear.stderr
    assert "per worker" in clear.stdout
    for bad in ("host_fallbacks", "nonsense>1", "acceptance<<1"):
        proc = monitor("--fail-on", bad, log)
        assert proc.returncode == 2 and "bad condition" in proc.stderr, bad
    missing = monitor(str(live_run.log) + ".absent")
    assert missing.returncode == 2 and "no log file matches" in missing.stderr


def test_follow_reads_growing_files_and_exits_on_an_alert(live_run: LiveRun,
                                                          tmp_path: Path) -> None:
    """The glob matches nothing when the monitor starts; the file appears, grows, and the
    monitor reports each state, then exits 1 once the condition holds."""
    lines = live_run.log.read_text().splitlines(keepends=True)
    first = next(i for i, line in enumerate(lines) if '"generation.finished"' in line) + 1
    proc = subprocess.Popen([SPECFLEET, "monitor", "--follow", "--json", "--interval", "0.2",
                             "--fail-on", f"generations>={len(PROMPTS)}",
                             str(tmp_path / "*.log")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        growing = tmp_path / "worker.log"
        growing.write_text("".join(lines[:first]))
        assert proc.stdout is not None
        while True:  # summaries every 0.2 s: wait for the one that has read the first part
            summary_line = proc.stdout.readline()
            assert summary_line, "the monitor exited before reading the first part"
            if json.loads(summary_line)["total"]["generations"] == 1:
                break
        assert proc.poll() is None, "the alert fired before its condition held"
        with growing.open("a") as fh:
            fh.write("".join(lines[first:]))
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err
    final = json.loads(out.strip().splitlines()[-1])
    assert final["total"]["generations"] == len(PROMPTS)
    assert final["alerts"] == [f"generations>={len(PROMPTS)} holds for total, {WORKER}"]


def test_since_takes_iso_times_and_durations() -> None:
    now = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
    assert parse_since("15m", now) == now - timedelta(minutes=15)
    assert parse_since("2h", now) == now - timedelta(hours=2)
    assert parse_since("90s", now) == now - timedelta(seconds=90)
    assert parse_since("2026-12-01T09:00:00Z") == datetime(2026, 12, 1, 9, tzinfo=UTC)
    with pytest.raises(ValueError, match="bad --since"):
        parse_since("yesterday")
