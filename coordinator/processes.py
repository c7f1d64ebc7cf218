"""Stopping child processes (workers, redis-server, a gateway) one way everywhere.

SIGTERM first, so a worker requeues its job and deregisters and Redis flushes; SIGKILL only
for a process that outlives the grace period, so a hung child never hangs its parent.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterable


def stop_processes(procs: Iterable[subprocess.Popen], timeout: float = 10) -> None:
    """SIGTERM every live process, then wait for each; one that outlives ``timeout`` is killed.

    All get their SIGTERM first so that their shutdowns overlap instead of adding up.
    """
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
