"""The tier rule of tests/conftest.py, on real test modules: a test that starts a worker
fleet (here through the service tests' ``fleet`` fixture) is ``slow``, one that runs in
process is not, so ``make test-fast`` leaves out exactly the first kind."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
FLEET = "service/test_end_to_end.py"  # every test uses the fleet fixture (worker processes)
IN_PROCESS = "test_layers.py"


def test_a_test_is_slow_exactly_when_it_uses_a_worker_fleet() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "-m", "slow", FLEET, IN_PROCESS], cwd=TESTS, capture_output=True, text=True,
        timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    slow = {Path(line.split("::")[0]).relative_to(TESTS.name).as_posix()
            for line in proc.stdout.splitlines() if "::" in line}
    assert slow == {FLEET}
    # the in-process module was collected too, and left out of the slow tier
    deselected = re.search(r"\((\d+) deselected\)", proc.stdout)
    assert deselected and int(deselected[1]) >= 5, proc.stdout
