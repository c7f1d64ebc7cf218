"""Real ``specfleet worker`` processes for the service tests (started, killed, stopped)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

from helpers import SPECFLEET
from rq.job import Job
from rq.job import JobStatus as RqStatus
from rq.serializers import JSONSerializer

from coordinator.client import Coordinator
from coordinator.processes import stop_processes
from shared.protocol import AnyEvent, ProgressEvent, TokenEvent
from shared.settings import Settings

MODEL_NAME = "tiny"
CTX = 512


class Fleet:
    """Starts and stops real worker processes for one test."""

    #: Fleets with processes started and not yet stopped: a failing test's report carries
    #: the tail of each one's worker logs (tests/conftest.py), which go with the temporary
    #: directory otherwise (a CI run shows a stream's timeout and nothing of the worker's).
    running: ClassVar[list[Fleet]] = []

    def __init__(self, settings: Settings, model: Path, logs: Path) -> None:
        self.settings = settings
        self.model = model
        self.logs = logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def env(self, step_delay: float, extra: dict[str, str]) -> dict[str, str]:
        s = self.settings
        return {**os.environ, "REDIS_URL": s.redis_url, "SPECFLEET_PREFIX": s.prefix,
                "SPECFLEET_HEARTBEAT_SECONDS": str(s.heartbeat_seconds),
                "SPECFLEET_WORKER_TTL_SECONDS": str(s.worker_ttl_seconds),
                "SPECFLEET_TOKEN_CHUNK": str(s.token_chunk),
                "SPECFLEET_TOKEN_FLUSH_SECONDS": str(s.token_flush_seconds),
                "SPECFLEET_STEP_DELAY_SECONDS": str(step_delay),
                # each test's workers time their own row costs: no curve from an earlier run
                "SPECFLEET_COST_CACHE_DIR": str(self.logs / "rowcosts"),
                "CUDA_VISIBLE_DEVICES": "", **extra}

    def start(self, name: str, *, step_delay: float = 0.0, wait: bool = True,
              extra_env: dict[str, str] | None = None, args: tuple[str, ...] = ("--ctx", str(CTX)),
              model_name: str = MODEL_NAME) -> int:
        """Start ``specfleet worker`` named ``name`` serving ``model_name``; returns its pid
        once it is registered.

        ``args`` default to a fixed context; pass fitter options instead to fit one."""
        cmd = [SPECFLEET, "worker", "--model", str(self.model), "--model-name", model_name,
               "--name", name, "--threads", "1", *args]
        log = (self.logs / f"{name}.log").open("ab")
        if self not in Fleet.running:
            Fleet.running.append(self)
        self.procs[name] = subprocess.Popen(cmd, env=self.env(step_delay, extra_env or {}),
                                            stdout=log, stderr=subprocess.STDOUT)
        if wait:
            self.wait_registered(name)
        return self.procs[name].pid

    def wait_registered(self, name: str, timeout: float = 60) -> None:
        coordinator = Coordinator(self.settings)
        deadline = time.monotonic() + timeout
        while not coordinator.registry.is_alive(name):
            proc = self.procs[name]
            if proc.poll() is not None:
                raise AssertionError(f"worker {name} exited ({proc.returncode}): "
                                     f"{(self.logs / f'{name}.log').read_text()[-2000:]}")
            assert time.monotonic() < deadline, f"worker {name} did not register"
            time.sleep(0.05)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        self.procs[name].send_signal(sig)

    def kill_runner(self, events: Iterator[AnyEvent]) -> str:
        """SIGKILL the worker running a job as soon as its first tokens are out; its name.

        ``events`` is the job's stream, read up to those tokens and left there, so that the
        test can read on into the attempt that recovery starts.
        """
        victim = None
        for event in events:
            if isinstance(event, ProgressEvent) and event.stage == "started":
                victim = event.worker
            if isinstance(event, TokenEvent):
                break
        assert victim is not None, "the job's stream showed no worker starting it"
        self.kill(victim)
        return victim

    def alive(self, name: str) -> bool:
        return self.procs[name].poll() is None

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text()

    def dump_stacks(self, grace: float = 1.0) -> None:
        """SIGUSR1 every worker still running: each writes all its threads' stacks to its log
        and serves on, so a failed test shows where a worker hung (a shutdown that never
        ended left only its last log line)."""
        running = [proc for proc in self.procs.values() if proc.poll() is None]
        for proc in running:
            proc.send_signal(signal.SIGUSR1)
        if running:
            time.sleep(grace)

    def log_tails(self, chars: int = 6000) -> list[tuple[str, str]]:
        """Each worker's name (and whether it runs) with the last ``chars`` of its log."""
        tails = []
        for name, proc in self.procs.items():
            path = self.logs / f"{name}.log"
            text = path.read_text(errors="replace")[-chars:] if path.exists() else ""
            state = "running" if proc.poll() is None else f"exited {proc.returncode}"
            tails.append((f"{name} ({state}, pid {proc.pid})", text))
        return tails

    def stop_all(self) -> None:
        stop_processes(self.procs.values())
        if self in Fleet.running:
            Fleet.running.remove(self)


def wait_rq_ended(coordinator: Coordinator, job_id: str, timeout: float = 10.0) -> None:
    """Wait for rq's record of a finished job: the worker writes it (status finished, the
    run out of the started registry, in one transaction) just after its final event, so a
    test that has the final event may get there first."""
    deadline = time.monotonic() + timeout
    job = Job.fetch(job_id, connection=coordinator.connection, serializer=JSONSerializer)
    while job.get_status() is not RqStatus.FINISHED:
        assert time.monotonic() < deadline, f"rq still reports {job.get_status()}"
        time.sleep(0.05)
