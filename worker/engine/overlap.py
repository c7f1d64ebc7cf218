"""Host work that does not need a step's outputs, run while the device computes them.

llama.cpp queues a decode on a GPU and returns (``llama_context::decode`` ends with its
``synchronize()`` commented out: the outputs are waited for when they are read), so until the
engine reads the verify's rows the host is free. The serving loop has such work every step:
the previous step's token events, a Redis round trip each (``TokenChunker.flush_due``).
Run there, it costs the step nothing while it takes less than the decode (vLLM's async
scheduling overlaps the same way).

On a CPU the decode is computed inside ``llama_decode`` by llama.cpp's threads: there is
nothing to overlap, and work run beside those threads would slow them (one busy core beside a
2-thread decode made it 6-25x slower, docs/benchmarks.md). There the work runs after the
decode, as it always did. Either way the seconds it took are not the decode's: a step's
``decode`` time is what the host waited on the device.
"""

from __future__ import annotations

from collections.abc import Callable
from time import perf_counter
from typing import Protocol

from worker.llm import Context

#: Work the caller hands a step to run while it decodes.
HostWork = Callable[[], None]


def no_work() -> None:
    """A step with nothing to overlap."""


class Overlap(Protocol):
    """When ``during`` runs against the decode the target has queued."""

    def wait(self, target: Context, during: HostWork) -> float:
        """Run ``during`` and wait for ``target``'s queued decode; the seconds ``during``
        took."""
        ...


class Serial:
    """The decode first, then the work (a CPU: nothing to overlap)."""

    def wait(self, target: Context, during: HostWork) -> float:
        target.synchronize()
        t0 = perf_counter()
        during()
        return perf_counter() - t0


class Overlapped:
    """The work while the decode runs, then the wait for what is left of it (a GPU)."""

    def wait(self, target: Context, during: HostWork) -> float:
        t0 = perf_counter()
        during()
        spent = perf_counter() - t0
        target.synchronize()
        return spent


SERIAL = Serial()
OVERLAPPED = Overlapped()


def make_overlap(offloaded: bool) -> Overlap:
    """Overlapped where the layers run on a GPU (``Model.offloaded``), serial elsewhere."""
    return OVERLAPPED if offloaded else SERIAL
