"""``specfleet monitor --live`` reads no log: it follows every job's events as the workers
publish them (Redis pub/sub, the jobs' channels at once) and summarises them as it would the
logs, so its counts equal the jobs' own telemetry; a job its worker refused is a failure of
the type the job's error event gave."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

from helpers import SPECFLEET
from service.workers import MODEL_NAME, Fleet

from coordinator.client import Coordinator
from shared.settings import Settings

from .conftest import REJECTED_PROMPT, make_settings

PROMPTS = [[5, 17, 42, 99, 3, 250, 8, 61], [7, 7, 31, 2, 99, 64]]
FIELDS = ("drafts", "drafted", "accepted", "target_decodes", "generated_tokens",
          "prompt_tokens", "replay_events", "replay_tokens")


def _watch(fleet: Fleet) -> subprocess.Popen[str]:
    """The monitor, once it is subscribed (it says so on stderr)."""
    proc = subprocess.Popen([SPECFLEET, "monitor", "--live", "--json", "--interval", "60",
                             "--for", "120"], env=fleet.env(0.0, {}), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    line = proc.stderr.readline()
    assert "following the fleet's jobs live" in line, line + proc.stderr.read()
    return proc


def test_live_counts_equal_the_jobs_telemetry(dense_model: Path, tmp_path: Path) -> None:
    settings: Settings = make_settings()
    fleet = Fleet(settings, dense_model, tmp_path)
    try:
        fleet.start("w1", args=("--ctx", "256", "--spec", "ngram"))
        watch = _watch(fleet)
        coordinator = Coordinator(settings)
        results = [coordinator.submit({"model": MODEL_NAME, "prompt_tokens": p,
                                       "max_tokens": 40}).result(timeout=60) for p in PROMPTS]
        refused = coordinator.submit({"model": MODEL_NAME, "prompt": REJECTED_PROMPT * 3,
                                      "max_tokens": 100}).result(timeout=60)
        assert refused.status == "failed"
        watch.send_signal(signal.SIGINT)  # the last summary, then exit
        out, err = watch.communicate(timeout=60)
    finally:
        fleet.stop_all()
    assert watch.returncode == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    total = summary["total"]
    assert summary["unparseable"] == 0
    assert total["generations"] == len(PROMPTS) and total["jobs_finished"] == len(PROMPTS)
    assert total["jobs_started"] == len(PROMPTS) + 1
    assert total["failures_by_type"] == {"context": 1}, summary
    assert list(summary["workers"]) == ["w1"]
    for field in FIELDS:
        assert total[field] == sum(getattr(r.telemetry, field) for r in results), field
    jobs = summary["jobs"]
    assert set(jobs) == {r.job_id for r in [*results, refused]}
    assert jobs[refused.job_id]["outcome"] == "failed"
