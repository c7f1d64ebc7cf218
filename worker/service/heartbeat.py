"""The heartbeat thread that keeps a worker's registration alive (the worker side of
``shared/registry.py``), also while its engine is busy in a long C call."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from shared import redis_faults
from shared.logs import get_logger
from shared.protocol import WorkerInfo
from shared.registry import FleetRegistry

log = get_logger("registry")


class Heartbeat(threading.Thread):
    """Refreshes a worker's registration every ``interval`` seconds, also while a job runs.

    Runs ``on_tick`` after each beat (the recovery sweep) and ``on_lost`` when it finds the
    worker had been declared lost by another monitor (it stalled past the TTL): the worker
    must then stop its current job, whose re-run has already been queued elsewhere.
    """

    def __init__(
        self,
        registry: FleetRegistry,
        info: Callable[[], WorkerInfo],
        interval: float,
        on_tick: Callable[[], None] | None = None,
        on_lost: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(name="specfleet-heartbeat", daemon=True)
        self._registry = registry
        self._info = info
        self._interval = interval
        self._on_tick = on_tick
        self._on_lost = on_lost
        self._stopped = threading.Event()

    def run(self) -> None:
        # A Redis that refuses for a while (down, out of memory, busy, read-only): one
        # ``redis.unavailable`` and one fault counted per spell, like ``ride_out``'s.
        down: tuple[redis_faults.Fault, float] | None = None
        while not self._stopped.wait(self._interval):
            try:
                declared_lost = not self._registry.heartbeat(self._info())
            except Exception as exc:  # a Redis hiccup must not kill the heartbeat
                fault = redis_faults.classify(exc)
                if fault is None:
                    log.warning("worker.heartbeat_failed", error=repr(exc))
                elif down is None or down[0] is not fault:
                    if down is not None:
                        redis_faults.ended(down[0], "heartbeat", time.monotonic() - down[1])
                    down = (fault, time.monotonic())
                    log.warning("redis.unavailable", operation="heartbeat", fault=str(fault),
                                error=str(exc))
                    redis_faults.started(fault, "heartbeat")
                continue
            if down is not None:
                seconds = time.monotonic() - down[1]
                log.info("redis.recovered", operation="heartbeat", fault=str(down[0]),
                         down_seconds=round(seconds, 2))
                redis_faults.ended(down[0], "heartbeat", seconds)
                down = None
            try:
                if declared_lost and self._on_lost:
                    self._on_lost()
                if self._on_tick:
                    self._on_tick()
            except Exception as exc:  # nor a failed sweep
                log.warning("worker.heartbeat_failed", error=repr(exc),
                            fault=str(redis_faults.classify(exc) or "") or None)

    def stop(self) -> None:
        self._stopped.set()
        self.join(timeout=self._interval + 5)
