"""``bench/gpu_check.py`` is what the first GPU host of a session runs, with minutes of device
time to spare: a script that broke between GPU sessions costs that time. With ``--device
cpu`` it runs the same plumbing here, and every check the CPU can run must pass."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import run_bench

#: Each check's status on a CPU host: the GPU-only ones say skipped.
ON_A_CPU = {"environment": "pass", "fit-vs-nvml": "pass", "pinning": "skipped",
            "device-checkpoint": "pass", "sampling": "pass", "greedy": "pass",
            "device-rows": "pass", "deterministic": "skipped", "service": "pass",
            "decode-timing": "pass", "slots": "skipped", "device-verify": "skipped",
            "device-draws": "skipped", "spec-targets": "skipped", "device-group": "pass"}


def test_the_gpu_check_runs_its_plumbing_on_a_cpu(tmp_path: Path) -> None:
    report = tmp_path / "report.md"
    done = run_bench("gpu_check.py", "--device", "cpu", "--model", "tiny", "--skip",
                     "slots,device-verify",
                     "--jobs", "2", "--tokens", "24", "--threads", "1", "--report", str(report))
    failed = report.read_text() if report.exists() else done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == ON_A_CPU, failed
    assert done.returncode == 0
    assert "| greedy | pass |" in report.read_text()
