"""A worker's threads wait the way worker/threads.py decides: asleep when they take every core
they may run on (a neighbour then preempts one, and a spinning partner burns its slice), spinning
when cores are spare; an operator's setting, or OMP_WAIT_POLICY, wins."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from worker.threads import OMP_WAIT_POLICY, ThreadWait, apply_wait, choose_wait, usable_cores


@pytest.mark.parametrize(("setting", "threads", "cores", "inherited", "chosen"), [
    (ThreadWait.AUTO, 2, 2, None, ThreadWait.PASSIVE),
    (ThreadWait.AUTO, 4, 2, None, ThreadWait.PASSIVE),
    (ThreadWait.AUTO, 2, 16, None, ThreadWait.ACTIVE),
    (ThreadWait.AUTO, 2, 2, "active", ThreadWait.ACTIVE),     # the operator's environment
    (ThreadWait.AUTO, 2, 16, " PASSIVE ", ThreadWait.PASSIVE),
    (ThreadWait.AUTO, 2, 2, "bogus", ThreadWait.PASSIVE),     # not a policy: decided by cores
    (ThreadWait.ACTIVE, 2, 2, "passive", ThreadWait.ACTIVE),  # SPECFLEET_THREAD_WAIT first
    (ThreadWait.PASSIVE, 1, 16, None, ThreadWait.PASSIVE),
])
def test_the_wait_policy_is_chosen_by_cores_unless_set(
        setting: ThreadWait, threads: int, cores: int, inherited: str | None,
        chosen: ThreadWait) -> None:
    assert choose_wait(setting, threads, cores, inherited) is chosen


def test_the_cores_are_the_affinity_masks() -> None:
    """A worker pinned to one CPU (taskset, a container's cpuset) counts one core."""
    script = "from worker.threads import usable_cores; print(usable_cores())"
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no CPU affinity on this platform")
    cpu = min(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, "-c",
                          f"import os; os.sched_setaffinity(0, {{{cpu}}}); {script}"],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "1"
    assert usable_cores() == len(os.sched_getaffinity(0))


def test_a_policy_cannot_be_set_once_llama_cpp_has_loaded() -> None:
    """libgomp read the policy when llama.cpp loaded: a later one would never apply."""
    script = ("import os, llama_cpp\n"
              "from worker.threads import ThreadWait, apply_wait\n"
              "os.environ.pop('OMP_WAIT_POLICY', None)\n"
              "apply_wait(ThreadWait.PASSIVE)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={k: v for k, v in os.environ.items() if k != OMP_WAIT_POLICY})
    assert done.returncode != 0 and "loaded before" in done.stderr
    with pytest.raises(ValueError, match="auto"):
        apply_wait(ThreadWait.AUTO)
