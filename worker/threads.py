"""How a worker's llama.cpp threads wait for each other: spinning, or asleep.

llama.cpp's CPU backend (built with OpenMP, as llama-cpp-python builds it) meets its threads at
a barrier after every operation of a decode, hundreds of times a token. libgomp's default lets
a thread that arrives first spin for ~300k iterations before it sleeps: on cores of its own,
the fastest hand-over. On a core it shares, a spinning thread burns the time slice the thread
it waits for needs, so one busy neighbour costs far more than its share. ``bench/neighbours.py``
measured plain Gemma 270M decoding on 2 threads of a 2-core host (docs/benchmarks.md):

============  =====  ==================  =======================
wait          alone  beside a busy core  beside a second worker
============  =====  ==================  =======================
active        47.9   2.6x slower         3.3x slower (once 25x)
passive       41.7   1.7x slower         1.7x slower
============  =====  ==================  =======================

So a worker whose threads take every core it may run on (``--threads`` at least the CPUs of
its affinity mask: any neighbour then preempts one of them) waits ``passive``, and one with
cores to spare keeps the spin (``active``): :func:`choose_wait`, unless
``SPECFLEET_THREAD_WAIT`` or the process's own ``OMP_WAIT_POLICY`` says otherwise. The policy
is read by libgomp once, when llama.cpp loads, so :func:`apply_wait` runs before that
(``specfleet worker`` calls it beside the device pinning) and refuses to run after it. The
registration says what was chosen (``WorkerInfo.threads``, ``thread_wait``).
"""

from __future__ import annotations

import os
import sys
from enum import StrEnum

#: The variable libgomp reads (the OpenMP standard's).
OMP_WAIT_POLICY = "OMP_WAIT_POLICY"


class ThreadWait(StrEnum):
    """``SPECFLEET_THREAD_WAIT``: ``auto`` decides by cores (:func:`choose_wait`)."""

    AUTO = "auto"
    ACTIVE = "active"
    PASSIVE = "passive"


def usable_cores() -> int:
    """CPUs this process may run on (its affinity mask, as ``taskset`` or a container's
    cpuset sets it), else every CPU of the host."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def choose_wait(setting: ThreadWait, threads: int, cores: int,
                inherited: str | None = None) -> ThreadWait:
    """The wait policy of a worker with ``threads`` llama.cpp threads on ``cores`` CPUs: what
    ``setting`` names, else the process's own ``OMP_WAIT_POLICY`` (``inherited``), else
    ``passive`` when the threads take every core and ``active`` when some are spare."""
    if setting is not ThreadWait.AUTO:
        return setting
    if inherited is not None and inherited.strip().lower() in ("active", "passive"):
        return ThreadWait(inherited.strip().lower())
    return ThreadWait.PASSIVE if threads >= cores else ThreadWait.ACTIVE


def apply_wait(wait: ThreadWait) -> None:
    """Set ``wait`` for the llama.cpp this process is about to load. Loaded already with
    another policy, it is refused: libgomp would never read the new one."""
    if wait is ThreadWait.AUTO:
        raise ValueError("apply a chosen wait policy (choose_wait), not 'auto'")
    wanted = wait.value.upper()
    if "llama_cpp" in sys.modules and os.environ.get(OMP_WAIT_POLICY) != wanted:
        raise RuntimeError(f"llama.cpp was loaded before its threads' wait policy was set to "
                           f"{wait.value}: set it first (worker/threads.py)")
    os.environ[OMP_WAIT_POLICY] = wanted


def current_wait() -> str | None:
    """The policy this process's llama.cpp threads wait by (``active``/``passive``), as the
    registration reports it; None where nothing set one (libgomp's default: it spins)."""
    value = os.environ.get(OMP_WAIT_POLICY, "").strip().lower()
    return value if value in ("active", "passive") else None
