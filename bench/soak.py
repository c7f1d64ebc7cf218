"""Fault soak: minutes of randomly timed faults against a small fleet, then every job and
every stream accounted.

One private ``redis-server`` (a free loopback port, its own directory), three workers
(``specfleet worker`` on the tiny dense test model, ``--threads 1 --slots 2``) and two
gateways (``specfleet serve``) are started. For ``--minutes`` the soak drives:

- batches through the gateways (``/v1/files`` + ``/v1/batches``), one after another, so one
  is always running (``--batch-lines`` each: one batch for the whole run would queue
  thousands of lines ahead of every stream, which shares their queue);
- ``--streams`` concurrent streaming clients: half the Python client (``JobHandle.stream``,
  resumed after an error from where it stopped, and after a hang-up by replaying the stream
  and dropping the events it has by ``seq``), half the gateway's SSE (``POST
  /v1/completions`` with ``stream``; after a cut, resumed on either gateway through
  ``/v1/specfleet/streams/{id}`` with ``Last-Event-ID``, text de-duplicated by event id);

and injects faults at random times from a seeded RNG (``--seed``; the kinds come from a
shuffled deck, so every kind recurs evenly): worker ``kill -9`` (restarted under the same
name), ``SIGSTOP`` past the worker TTL then ``SIGCONT``, worker ``SIGTERM`` (drains, then
restarted), Redis restart (down 1-8 s, same port and data directory), Redis OOM
(``maxmemory`` just below ``used_memory`` under ``noeviction`` for 8-12 s), ``DEBUG SLEEP``
1-5 s, gateway restart (``SIGTERM``, same port) and a client hanging up mid-stream; and,
only when ``--faults`` names it, a fleet restart (every worker ``SIGTERM``ed, 2-6 s with
none). One fault at a time; the next waits until the fleet is whole again.

Redis runs as production should (``docker/redis/redis.conf``): AOF on (``appendfsync
everysec``), no RDB, ``noeviction``; a restart is a clean ``SIGTERM`` (Redis fsyncs its AOF),
so queued jobs survive it. A restart without persistence loses every key, queued jobs and
their streams included: no client can ride that out, and the soak would only measure that.

A process that exits when no fault was aimed at it is restarted (as a supervisor would) and
counted as an unexpected exit. After the run, faults stop, clients finish their current
stream, the last batch is waited for (``--drain-seconds``), and then Redis itself is read:
every job a client was told about, every batch line, and every job stream found under the
prefix (jobs whose submit failed ambiguously). A table goes to stdout, the JSON summary to
``--out``; the exit status is 1 when any job was lost (no final event), finished in two
attempts, a stream was cut without an error event or stalled, a de-duplicated stream's
tokens (client) or characters (SSE) differ from its job's result, a process exited
unexpectedly, or a client of the soak itself raised. Reported without failing it: refused
submits, stream reads that ended in an error event (then resumed), streams whose text came in
one event (not streamed), ``SIGTERM`` exits other than 0.

    ./.venv/bin/python bench/soak.py --minutes 20 --seed 1 --out soak.json
    ./.venv/bin/python bench/soak.py --minutes 2            # smoke run

Not in CI (``make test``): it runs for minutes and its faults are random by design.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Generator, Iterator
from dataclasses import asdict, dataclass, field
from difflib import SequenceMatcher
from pathlib import Path
from typing import Any, cast

import httpx
import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coordinator.client import Coordinator, JobHandle  # noqa: E402
from coordinator.events import StreamCursor  # noqa: E402
from coordinator.redis_local import free_port  # noqa: E402
from shared.keys import STREAM_FIELD, Keys  # noqa: E402
from shared.logs import configure_logging  # noqa: E402
from shared.protocol import AnyEvent, FinalEvent, JobStatus, TokenEvent, parse_event  # noqa: E402
from shared.replies import text  # noqa: E402
from shared.settings import Settings  # noqa: E402
from worker.testmodels import build_tiny_models  # noqa: E402

MODEL = "soak"
BIN = Path(sys.executable).parent
WORKERS = ("w1", "w2", "w3")
GATEWAYS = ("g1", "g2")
HEARTBEAT_SECONDS = 0.5
TTL_SECONDS = 3.0
#: Longest silence a stream may keep (the gateway's keep-alive is 2 s): past it, "stalled".
STALL_SECONDS = 90.0
#: Longest a Python client waits for its job's end (a queue behind a batch included).
JOB_SECONDS = 900.0
#: Longest a resumed stream keeps trying to reach a gateway or Redis before giving up.
RESUME_SECONDS = 180.0
FAULT_KINDS = ("worker_kill9", "worker_sigstop", "worker_sigterm", "redis_restart",
               "redis_oom", "redis_sleep", "gateway_restart", "client_disconnect")
#: Kinds only ``--faults`` names: every worker stopped at once (SIGTERM, 2-6 s with none
#: registered): batch lines must wait for a worker, submits are refused meanwhile.
EXTRA_FAULT_KINDS = ("fleet_restart",)
#: Log events counted in the summary (any event logged at error level is counted too).
WATCHED_EVENTS = ("worker.lost", "worker.declared_lost", "worker.takeover", "redis.unavailable",
                  "redis.recovered", "worker.redis_gave_up", "job.failed", "job.refused",
                  "job.requeued", "stream.gap", "gateway.job_cancelled")


def log(message: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- processes ------------------------------------------------------------------------------
class Proc:
    """One child process that can be signalled, waited for and started again with the same
    command line, its output appended to one log file across lives."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], logfile: Path) -> None:
        self.name, self.cmd, self.env, self.logfile = name, cmd, env, logfile
        self.popen: subprocess.Popen[bytes] | None = None
        self.lives = 0

    def start(self) -> None:
        with self.logfile.open("ab") as out:
            self.popen = subprocess.Popen(self.cmd, env=self.env, stdout=out,
                                          stderr=subprocess.STDOUT)
        self.lives += 1

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            assert self.popen is not None
            self.popen.send_signal(sig)

    def wait(self, timeout: float) -> int | None:
        """The exit status, or None when still running after ``timeout`` seconds."""
        assert self.popen is not None
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout: float = 15) -> int | None:
        """SIGCONT (a stopped process cannot handle SIGTERM), SIGTERM, SIGKILL after
        ``timeout``; the exit status."""
        if self.popen is None:
            return None
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        rc = self.wait(timeout)
        if rc is None:
            self.popen.kill()
            rc = self.popen.wait()
        return rc

    def tail(self, lines: int = 8) -> list[str]:
        with contextlib.suppress(OSError):
            return self.logfile.read_text(errors="replace").splitlines()[-lines:]
        return []


class RedisNode(Proc):
    """The soak's Redis: AOF on, ``noeviction``, ``DEBUG`` allowed from loopback; stopped
    cleanly and started again on the same port and directory."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        data = workdir / "redis"
        data.mkdir(parents=True, exist_ok=True)
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("soak: redis-server is not installed")
        cmd = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(data),
               "--save", "", "--appendonly", "yes", "--appendfsync", "everysec",
               "--maxmemory-policy", "noeviction"]
        version = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout
        if "v=" in version and int(version.split("v=")[1].split(".")[0]) >= 7:
            cmd += ["--enable-debug-command", "local"]  # off by default since Redis 7
        super().__init__("redis", cmd, dict(os.environ), workdir / "logs" / "redis.log")

    def client(self, timeout: float = 5.0) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=timeout,
                           socket_connect_timeout=timeout)

    def start_and_wait(self, timeout: float = 60) -> None:
        self.start()
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(redis.RedisError):
                if self.client(1).ping():  # a loading Redis answers PING with LOADING
                    return
            if not self.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not come up: {self.tail()}")
            time.sleep(0.05)


# -- what was seen --------------------------------------------------------------------------
@dataclass
class StreamRecord:
    """One streamed job as its client saw it."""

    kind: str  # "client" (JobHandle.stream) or "sse"
    job_id: str | None
    gateway: str | None = None
    status: str | None = None  # of the final event the client saw
    shown: int = 0  # tokens (client) or characters (SSE) handed to the user
    #: Why a read of the stream ended without its end: "silent" (no error event), "error",
    #: "stall"; one entry per read.
    cuts: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    disconnects: int = 0  # hang-ups the soak made
    resumes: int = 0
    replayed: int = 0  # events received again on a resume and dropped (by seq or id)
    rewritten: int = 0  # token events appended twice by a retried write (same index)
    gap: int = 0  # tokens/characters a read skipped (an index or id beyond what was shown)
    chunks: int = 0  # events that brought new text (SSE) or tokens (client)
    gave_up: bool = False
    #: When each cut happened (``time.monotonic()``), to find the fault behind it.
    cut_at: list[float] = field(default_factory=list)
    #: What was shown, to compare with the job's result at the end (not in the summary).
    seen: list[int] | str = field(default_factory=list, repr=False)

    def cut(self, why: str) -> None:
        self.cuts.append(why)
        self.cut_at.append(time.monotonic())


class Ledger:
    """Everything the clients and the fault injector record, behind one lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.acked: dict[str, str] = {}  # job id -> who was told about it
        self.unacked: list[str] = []  # job ids of submits that raised (they may exist)
        self.refused: Counter[str] = Counter()  # submit/create failures by source and reason
        self.streams: list[StreamRecord] = []
        self.batches: list[str] = []
        self.batch_create_seconds: list[float] = []
        self.faults: list[dict[str, Any]] = []
        self.exits: list[dict[str, Any]] = []
        #: Exceptions of the soak's own clients (its bugs: its figures cannot be trusted).
        self.harness_errors: list[str] = []

    def ack(self, job_id: str, source: str) -> None:
        with self.lock:
            self.acked[job_id] = source

    def refuse(self, source: str, reason: str) -> None:
        with self.lock:
            self.refused[f"{source}: {reason[:120]}"] += 1


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


# -- the soak -------------------------------------------------------------------------------
class Soak:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.workdir = workdir
        (workdir / "logs").mkdir(parents=True, exist_ok=True)
        #: The in-process clients' own events (submits, outages ridden out, stream gaps).
        self.client_log = (workdir / "logs" / "clients.log").open("a", buffering=1)
        configure_logging("info", "json", stream=self.client_log)
        self.ledger = Ledger()
        self.stopping = threading.Event()  # clients: no new work
        self.faults_off = threading.Event()
        self.closing = threading.Event()  # the soak is stopping its processes
        self.redis = RedisNode(workdir)
        self.prefix = f"soak-{uuid.uuid4().hex[:8]}"
        self.settings = Settings(redis_url=self.redis.url, prefix=self.prefix,
                                 heartbeat_seconds=HEARTBEAT_SECONDS,
                                 worker_ttl_seconds=TTL_SECONDS, token_chunk=4)
        self.keys = Keys(self.prefix)
        env = {**os.environ, "REDIS_URL": self.redis.url, "SPECFLEET_PREFIX": self.prefix,
               "SPECFLEET_HEARTBEAT_SECONDS": str(HEARTBEAT_SECONDS),
               "SPECFLEET_WORKER_TTL_SECONDS": str(TTL_SECONDS),
               "SPECFLEET_TOKEN_CHUNK": "4", "SPECFLEET_LOG_LEVEL": "info",
               "SPECFLEET_SSE_KEEPALIVE_SECONDS": "2", "CUDA_VISIBLE_DEVICES": ""}
        model = build_tiny_models(workdir / "models").dense
        worker_env = {**env, "SPECFLEET_STEP_DELAY_SECONDS": str(args.step_delay)}
        self.workers = {
            name: Proc(name, [str(BIN / "specfleet"), "worker", "--model", str(model),
                              "--model-name", MODEL, "--name", name, "--threads", "1",
                              "--slots", str(args.slots), "--ctx", "512"],
                       worker_env, workdir / "logs" / f"{name}.log") for name in WORKERS}
        self.gateway_ports = {name: free_port() for name in GATEWAYS}
        self.gateways = {
            name: Proc(name, [str(BIN / "specfleet"), "serve", "--port", str(port)], env,
                       workdir / "logs" / f"{name}.log")
            for name, port in self.gateway_ports.items()}
        #: Processes a fault is working on: the supervisor leaves them alone.
        self.faulted: set[str] = set()
        self.supervisor_lock = threading.Lock()
        self.clients: list[StreamClient] = []

    def url(self, gateway: str) -> str:
        return f"http://127.0.0.1:{self.gateway_ports[gateway]}"

    def procs(self) -> dict[str, Proc]:
        return {**self.workers, **self.gateways}

    # -- start, supervise, stop -------------------------------------------------------------
    def start(self) -> None:
        self.redis.start_and_wait()
        for proc in self.procs().values():
            proc.start()
        if not self.wait_whole(300, starting=True):
            raise SystemExit(f"soak: the fleet did not start (logs in {self.workdir / 'logs'})")
        log(f"fleet up: redis :{self.redis.port}, workers {', '.join(WORKERS)} "
            f"(--slots {self.args.slots}), gateways "
            f"{', '.join(f'{g} :{p}' for g, p in self.gateway_ports.items())}")

    def whole(self) -> bool:
        """Redis answers, every worker is registered and every gateway is healthy."""
        try:
            client = self.redis.client(2)
            registered = all(client.exists(self.keys.worker(w)) for w in WORKERS)
        except redis.RedisError:
            return False
        if not registered:
            return False
        for gateway in GATEWAYS:
            try:
                if httpx.get(self.url(gateway) + "/health", timeout=3).status_code != 200:
                    return False
            except httpx.HTTPError:
                return False
        return True

    def wait_whole(self, timeout: float, starting: bool = False) -> bool:
        """Wait until :meth:`whole`; ``starting``: a process that exits fails the start."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.whole():
                return True
            for proc in self.procs().values():
                if starting and not proc.alive():
                    raise SystemExit(f"soak: {proc.name} exited at start: "
                                     + "\n".join(proc.tail(12)))
            time.sleep(0.5)
        return False

    @contextlib.contextmanager
    def faulting(self, name: str) -> Iterator[None]:
        with self.supervisor_lock:
            self.faulted.add(name)
        try:
            yield
        finally:
            with self.supervisor_lock:
                self.faulted.discard(name)

    def supervise(self) -> None:
        """Restart a worker or gateway that exited with no fault aimed at it (as systemd or
        compose would), recording the exit; until the soak stops its processes."""
        while not self.closing.wait(0.5):
            with self.supervisor_lock:
                for name, proc in self.procs().items():
                    if name in self.faulted or proc.alive() or self.closing.is_set():
                        continue
                    assert proc.popen is not None
                    rc = proc.popen.returncode
                    self.ledger.exits.append({"process": name, "rc": rc, "life": proc.lives,
                                              "at_s": round(self.elapsed(), 1),
                                              "log_tail": proc.tail()})
                    log(f"UNEXPECTED EXIT {name} rc={rc}: {proc.tail(3)}")
                    proc.start()

    def stop(self) -> None:
        with self.supervisor_lock:
            self.closing.set()
        for proc in self.procs().values():
            proc.signal(signal.SIGCONT)
        for proc in self.procs().values():
            proc.stop()
        self.redis.stop()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    # -- faults -----------------------------------------------------------------------------
    def inject(self) -> None:
        rng = random.Random(self.args.seed)
        kinds = [k for k in FAULT_KINDS + EXTRA_FAULT_KINDS if k in self.args.faults]
        deck: list[str] = []
        while not self.faults_off.is_set():
            gap = rng.uniform(0.5, 1.5) * self.args.fault_every
            if self.faults_off.wait(gap):
                return
            if not deck:
                deck = kinds[:]
                rng.shuffle(deck)
            kind = deck.pop()
            started = self.elapsed()
            log(f"fault {kind} ...")
            try:
                detail = getattr(self, f"_fault_{kind}")(rng)
            except Exception as exc:  # a fault that could not be injected is recorded
                detail = {"injection_error": _reason(exc)}
            recovered = self.wait_whole(120)
            record = {"kind": kind, "at_s": round(started, 1),
                      "seconds": round(self.elapsed() - started, 1),
                      "fleet_whole_again": recovered, **detail}
            self.ledger.faults.append(record)
            log(f"fault {kind} done: {detail}" + ("" if recovered else " (FLEET NOT WHOLE)"))

    def _restart(self, proc: Proc, sig: int, grace: float) -> dict[str, Any]:
        with self.faulting(proc.name):
            proc.signal(sig)
            t = time.monotonic()
            rc = proc.wait(grace)
            detail: dict[str, Any] = {"target": proc.name}
            if rc is None:
                detail["outlived_grace_seconds"] = grace
                proc.popen.kill()  # type: ignore[union-attr]
                rc = proc.wait(30)
            detail.update(rc=rc, exit_seconds=round(time.monotonic() - t, 1))
            proc.start()
        return detail

    def _fault_worker_kill9(self, rng: random.Random) -> dict[str, Any]:
        return self._restart(self.workers[rng.choice(WORKERS)], signal.SIGKILL, 30)

    def _fault_worker_sigterm(self, rng: random.Random) -> dict[str, Any]:
        return self._restart(self.workers[rng.choice(WORKERS)], signal.SIGTERM, 120)

    def _fault_gateway_restart(self, rng: random.Random) -> dict[str, Any]:
        return self._restart(self.gateways[rng.choice(GATEWAYS)], signal.SIGTERM, 60)

    def _fault_fleet_restart(self, rng: random.Random) -> dict[str, Any]:
        empty = rng.uniform(2, 6)
        with contextlib.ExitStack() as stack:
            for name in WORKERS:
                stack.enter_context(self.faulting(name))
            for proc in self.workers.values():
                proc.signal(signal.SIGTERM)
            rcs = {name: proc.wait(120) for name, proc in self.workers.items()}
            for proc in self.workers.values():
                if proc.alive():
                    proc.popen.kill()  # type: ignore[union-attr]
                    proc.wait(30)
            time.sleep(empty)
            for proc in self.workers.values():
                proc.start()
        return {"rc": rcs, "empty_seconds": round(empty, 1)}

    def _fault_worker_sigstop(self, rng: random.Random) -> dict[str, Any]:
        proc = self.workers[rng.choice(WORKERS)]
        seconds = TTL_SECONDS + rng.uniform(1, 4)
        proc.signal(signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            proc.signal(signal.SIGCONT)
        return {"target": proc.name, "stopped_seconds": round(seconds, 1)}

    def _fault_redis_restart(self, rng: random.Random) -> dict[str, Any]:
        down = rng.uniform(1, 8)
        t = time.monotonic()
        rc = self.redis.stop(timeout=60)
        time.sleep(down)
        self.redis.start_and_wait()
        return {"rc": rc, "down_seconds": round(time.monotonic() - t, 1)}

    def _fault_redis_oom(self, rng: random.Random) -> dict[str, Any]:
        hold = rng.uniform(8, 12)
        client = self.redis.client()
        used = int(client.info("memory")["used_memory"])
        limit = max(1 << 20, used - max(256 << 10, used // 20))
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", limit)
        try:
            time.sleep(hold)
        finally:
            client.config_set("maxmemory", 0)
        return {"used_memory": used, "maxmemory": limit, "held_seconds": round(hold, 1)}

    def _fault_redis_sleep(self, rng: random.Random) -> dict[str, Any]:
        seconds = rng.uniform(1, 5)
        self.redis.client(seconds + 10).execute_command("DEBUG", "SLEEP", f"{seconds:.2f}")
        return {"slept_seconds": round(seconds, 2)}

    def _fault_client_disconnect(self, rng: random.Random) -> dict[str, Any]:
        pick = rng.random()  # drawn whatever is busy, so the seed fixes every later draw
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            busy = [c for c in self.clients if c.mid_stream.is_set() and not c.drop.is_set()]
            if busy:
                victim = busy[int(pick * len(busy))]
                victim.drop.set()
                return {"target": victim.name}
            time.sleep(0.1)
        return {"target": None}

    # -- the run ----------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        self.t0 = time.monotonic()
        threads = [threading.Thread(target=self.supervise, name="supervisor", daemon=True)]
        batcher = BatchDriver(self)
        threads.append(threading.Thread(target=batcher.run, name="batches", daemon=True))
        for i in range(self.args.streams):
            cls = ClientStream if i % 2 == 0 else SseStream
            self.clients.append(cls(self, i))
        threads += [threading.Thread(target=c.run, name=c.name, daemon=True)
                    for c in self.clients]
        injector = threading.Thread(target=self.inject, name="faults", daemon=True)
        for t in threads:
            t.start()
        injector.start()
        end = self.t0 + self.args.minutes * 60
        while time.monotonic() < end:
            time.sleep(min(5.0, max(0.0, end - time.monotonic())))
        log("time is up: no more faults; draining")
        self.faults_off.set()
        injector.join()  # the fault in progress ends (and the fleet heals) first
        self.stopping.set()
        drain_end = time.monotonic() + self.args.drain_seconds
        for t in threads[1:]:
            t.join(timeout=max(0.0, drain_end - time.monotonic()))
        drained = not any(t.is_alive() for t in threads[1:])
        log("drained" if drained else "drain timed out")
        summary = Accounting(self).summary()
        summary["drained"] = drained
        return summary

    def request(self, rng: random.Random) -> tuple[list[int], int, float]:
        """A prompt, a budget and a temperature (half greedy, half sampled: a re-run after a
        crash must repeat a sampled job's tokens too, from the seed drawn at submit)."""
        prompt = [rng.randrange(1, 250) for _ in range(rng.randrange(2, 9))]
        return prompt, rng.randrange(24, self.args.max_tokens + 1), rng.choice((0.0, 0.8))


class StreamClient:
    """A loop of streamed jobs, one at a time, until the soak stops."""

    kind = ""

    def __init__(self, soak: Soak, index: int) -> None:
        self.soak = soak
        self.name = f"{self.kind}{index}"
        self.rng = random.Random(soak.args.seed * 1000 + index)
        self.drop = threading.Event()  # set by the client_disconnect fault
        self.mid_stream = threading.Event()  # some of the current job has been shown

    def run(self) -> None:
        while not self.soak.stopping.is_set():
            self.drop.clear()
            self.mid_stream.clear()
            try:
                self.one()
            except Exception as exc:  # a bug of the soak itself: recorded, and it goes on
                with self.soak.ledger.lock:
                    self.soak.ledger.harness_errors.append(f"{self.name}: {_reason(exc)}")
                time.sleep(1)

    def one(self) -> None:
        raise NotImplementedError


class ClientStream(StreamClient):
    """``Coordinator.submit`` + ``JobHandle.stream``, as an SDK user would."""

    kind = "client"

    def __init__(self, soak: Soak, index: int) -> None:
        super().__init__(soak, index)
        self.coordinator = Coordinator(soak.settings)

    def one(self) -> None:
        prompt, max_tokens, temperature = self.soak.request(self.rng)
        job_id = uuid.uuid4().hex
        try:
            handle = self.coordinator.submit(
                {"model": MODEL, "prompt_tokens": prompt, "max_tokens": max_tokens,
                 "sampling": {"temperature": temperature}}, job_id=job_id)
        except Exception as exc:
            with self.soak.ledger.lock:
                self.soak.ledger.unacked.append(job_id)
            self.soak.ledger.refuse("client submit", _reason(exc))
            time.sleep(1)
            return
        self.soak.ledger.ack(job_id, "client")
        record = StreamRecord("client", job_id)
        with self.soak.ledger.lock:
            self.soak.ledger.streams.append(record)
        self.follow(handle, record)

    def follow(self, handle: JobHandle, record: StreamRecord) -> None:
        seen_seq: set[int] = set()
        per_attempt: dict[int, list[int]] = {}
        shown: list[int] = []
        record.seen = shown
        finals: list[FinalEvent] = []
        cursor = StreamCursor(handle.job_id)
        deadline = time.monotonic() + RESUME_SECONDS
        while True:
            events = cast(Generator[AnyEvent, None, None],
                          handle.stream(timeout=JOB_SECONDS, cursor=cursor))
            try:
                for event in events:
                    if event.seq in seen_seq:
                        record.replayed += 1
                        continue
                    seen_seq.add(event.seq)
                    self._take(event, per_attempt, shown, record)
                    if isinstance(event, FinalEvent):
                        finals.append(event)
                    if self.drop.is_set() and not cursor.done:
                        break
                else:  # follow() ends only after the final event of the newest attempt
                    if not finals:
                        record.cut("silent")
                    else:
                        record.status = str(max(finals, key=lambda f: f.attempt).status)
                    record.shown = len(shown)
                    return
            except TimeoutError:
                record.cut("stall")
                record.gave_up = True
                return
            except Exception as exc:  # the client raised: the user sees an error
                record.cut("error")
                _note(record, _reason(exc))
                if time.monotonic() > deadline:
                    record.gave_up = True
                    return
                time.sleep(1)
                record.resumes += 1
                continue  # resumed by the same cursor, from the last entry it read
            finally:
                events.close()
            # hung up: read again from the start, dropping what was seen by its seq
            self.drop.clear()
            record.disconnects += 1
            time.sleep(self.rng.uniform(0, 2))
            cursor = StreamCursor(handle.job_id)
            record.resumes += 1

    def _take(self, event: AnyEvent, per_attempt: dict[int, list[int]], shown: list[int],
              record: StreamRecord) -> None:
        """Token events into the attempt's tokens (by index, as ``text_stream`` does); what
        an attempt has beyond what was shown is shown (a re-run repeats the same tokens)."""
        if not isinstance(event, TokenEvent):
            return
        got = per_attempt.setdefault(event.attempt, [])
        if event.index < len(got):
            record.rewritten += 1
            tail = event.tokens[len(got) - event.index:]
        else:
            record.gap += event.index - len(got)
            tail = event.tokens
        got.extend(tail)
        record.chunks += bool(tail)
        if len(got) > len(shown):
            shown.extend(got[len(shown):])
        if shown:
            self.mid_stream.set()


class SseStream(StreamClient):
    """``POST /v1/completions`` with ``stream`` on a gateway, resumed on either gateway."""

    kind = "sse"

    def __init__(self, soak: Soak, index: int) -> None:
        super().__init__(soak, index)
        self.http = httpx.Client(timeout=httpx.Timeout(STALL_SECONDS, connect=5))

    def one(self) -> None:
        prompt, max_tokens, temperature = self.soak.request(self.rng)
        gateway = self.rng.choice(GATEWAYS)
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": temperature, "stream": True}
        state = _SseState(StreamRecord("sse", None, gateway=gateway), self.soak.ledger)
        try:
            with self.http.stream("POST", self.soak.url(gateway) + "/v1/completions",
                                  json=body) as response:
                if response.status_code != 200:
                    response.read()
                    self.soak.ledger.refuse(
                        "sse submit", f"{response.status_code} "
                        f"retry-after={response.headers.get('retry-after')} "
                        f"{_error_message(response.content)}")
                    time.sleep(1)
                    return
                state.answered()
                ended = self.read(response, state)
        except httpx.TransportError as exc:
            if not state.accepted:  # refused before its headers
                self.soak.ledger.refuse("sse submit", _reason(exc))
                time.sleep(1)
                return
            ended = state.cut(exc)
        record = state.record
        if record.job_id is None:  # no chunk named the job: nothing to resume
            if not ended:
                _note(record, "cut before its first chunk (no completion id to resume)")
            return
        deadline = time.monotonic() + RESUME_SECONDS
        while not ended and time.monotonic() < deadline:
            time.sleep(self.rng.uniform(0, 1))
            record.resumes += 1
            ended = self.resume(state)
        record.gave_up = not ended
        record.shown = len(state.text)
        record.seen = state.text

    def resume(self, state: _SseState) -> bool:
        gateway = self.rng.choice(GATEWAYS)
        url = f"{self.soak.url(gateway)}/v1/specfleet/streams/cmpl-{state.record.job_id}"
        try:
            with self.http.stream("GET", url, headers={"Last-Event-ID": str(len(state.text))},
                                  ) as response:
                if response.status_code != 200:
                    response.read()
                    _note(state.record, f"resume {response.status_code} "
                          f"{_error_message(response.content)}")
                    return False
                return self.read(response, state)
        except httpx.TransportError as exc:
            if state.reading:
                return state.cut(exc)
            return False  # that gateway is down: try again

    def read(self, response: httpx.Response, state: _SseState) -> bool:
        """Read one response's events; True when the stream reached its end (``[DONE]``
        after a final chunk, or after an error that failed the job itself)."""
        state.reading = False
        event_id, data = None, None
        for line in response.iter_lines():
            state.reading = True
            if line.startswith(":"):
                continue  # keep-alive
            if line.startswith("id:"):
                event_id = line[3:].strip()
            elif line.startswith("data:"):
                data = line[5:].strip()
            elif line == "" and data is not None:
                if data == "[DONE]":
                    return state.done()
                state.take(event_id, json.loads(data))
                if state.text:
                    self.mid_stream.set()
                if self.drop.is_set():
                    self.drop.clear()
                    state.record.disconnects += 1
                    return False  # closing the response hangs up (the gateway cancels)
                event_id, data = None, None
        return state.cut(None)


#: Error codes of a stream's error event that mean the job itself failed (no resuming).
_JOB_ERRORS = frozenset({"job_failed", "context_length_exceeded", "job_rejected"})


class _SseState:
    """One SSE job's text as it is assembled across reads."""

    def __init__(self, record: StreamRecord, ledger: Ledger) -> None:
        self.record = record
        self.ledger = ledger
        self.text = ""
        self.error: str | None = None  # the code of an error event in this read
        self.reading = False
        self.accepted = False


    def answered(self) -> None:
        """The gateway took the request (a 200): from here on the stream is accounted."""
        self.accepted = True
        with self.ledger.lock:
            self.ledger.streams.append(self.record)

    def take(self, event_id: str | None, body: dict[str, Any]) -> None:
        """One event; text de-duplicated by its id (the characters sent up to its end)."""
        if "error" in body:
            self.error = str(body["error"].get("code"))
            _note(self.record, f"error event {self.error}: "
                  f"{str(body['error'].get('message'))[:100]}")
            return
        if self.record.job_id is None:
            self.record.job_id = body["id"].partition("-")[2]
            self.ledger.ack(self.record.job_id, "sse")
        choice = body["choices"][0]
        piece = choice.get("text") or ""
        if choice.get("finish_reason"):
            self.record.status = str(choice["finish_reason"])
        if event_id is None or not event_id.isdigit():
            _note(self.record, f"an event without a numeric id: {event_id!r}")
            self.text += piece
            return
        end = int(event_id)
        start = end - len(piece)
        if end <= len(self.text):
            self.record.replayed += bool(piece)
            return
        if start > len(self.text):  # a hole: the piece goes on where the text ends, so the
            self.record.gap += start - len(self.text)  # comparison counts what is missing
            start = len(self.text)
        self.text += piece[len(self.text) - start:]
        self.record.chunks += 1

    def done(self) -> bool:
        """``[DONE]``: the end, unless an error event before it was the gateway giving up
        on a job that goes on (then resumed)."""
        if self.error is None or self.error in _JOB_ERRORS:
            return True
        self.record.cut("error")
        self.error = None
        return False

    def cut(self, exc: BaseException | None) -> bool:
        """The body ended (or broke) before ``[DONE]``."""
        if isinstance(exc, httpx.ReadTimeout):
            self.record.cut("stall")
        else:
            self.record.cut("error" if self.error else "silent")
        if exc is not None:
            _note(self.record, _reason(exc))
        self.error = None
        return False


def _note(record: StreamRecord, text: str) -> None:
    """An error a stream met, kept (the first 20) for the summary's examples."""
    if len(record.errors) < 20:
        record.errors.append(text)


def _error_message(content: bytes) -> str:
    try:
        return str(json.loads(content)["error"]["message"])[:100]
    except (ValueError, KeyError, TypeError):
        return content[:100].decode(errors="replace")


class BatchDriver:
    """One batch after another through the gateways until the soak stops; the last one is
    waited for."""

    def __init__(self, soak: Soak) -> None:
        self.soak = soak
        self.rng = random.Random(soak.args.seed * 1000 - 1)
        self.http = httpx.Client(timeout=httpx.Timeout(300, connect=5))

    def run(self) -> None:
        number = 0
        while not self.soak.stopping.is_set():
            number += 1
            batch_id = self.create(number)
            if batch_id is not None:
                self.wait(batch_id)

    def create(self, number: int) -> str | None:
        lines = []
        for line in range(self.soak.args.batch_lines):
            prompt, max_tokens, temperature = self.soak.request(self.rng)
            lines.append(json.dumps({"custom_id": f"b{number}-{line}", "body": {
                "model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": temperature}}))
        content = ("\n".join(lines) + "\n").encode()
        while not self.soak.stopping.is_set():
            url = self.soak.url(self.rng.choice(GATEWAYS))
            try:
                upload = self.http.post(url + "/v1/files", data={"purpose": "batch"},
                                        files={"file": (f"soak-{number}.jsonl", content)})
                if upload.status_code != 200:
                    self.soak.ledger.refuse("batch upload", f"{upload.status_code} "
                                            f"{_error_message(upload.content)}")
                    time.sleep(2)
                    continue
                t = time.monotonic()
                created = self.http.post(url + "/v1/batches", json={
                    "input_file_id": upload.json()["id"], "endpoint": "/v1/completions",
                    "completion_window": "24h"})
            except httpx.HTTPError as exc:  # a create cut short may have made a batch:
                self.soak.ledger.refuse("batch create", _reason(exc))  # Redis tells at the end
                time.sleep(2)
                continue
            if created.status_code != 200:
                self.soak.ledger.refuse("batch create", f"{created.status_code} "
                                        f"{_error_message(created.content)}")
                time.sleep(2)
                continue
            batch_id = str(created.json()["id"])
            with self.soak.ledger.lock:
                self.soak.ledger.batches.append(batch_id)
                self.soak.ledger.batch_create_seconds.append(round(time.monotonic() - t, 2))
            log(f"batch {number} created: {batch_id} ({len(lines)} lines)")
            return batch_id
        return None

    def wait(self, batch_id: str) -> None:
        while True:
            try:
                status = self.http.get(
                    f"{self.soak.url(self.rng.choice(GATEWAYS))}/v1/batches/{batch_id}",
                    timeout=30).json().get("status")
                if status in ("completed", "failed", "expired", "cancelled"):
                    log(f"batch {batch_id} {status}")
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(2)


# -- accounting -----------------------------------------------------------------------------
class Accounting:
    """Reads Redis after the drain: every job's events, every batch's lines."""

    def __init__(self, soak: Soak) -> None:
        self.soak = soak
        self.r = soak.redis.client(30)
        self.keys = soak.keys

    def events(self, job_id: str) -> list[AnyEvent]:
        entries: list[tuple[bytes, dict[bytes, bytes]]] = self.r.xrange(  # type: ignore[assignment]
            self.keys.events(job_id))
        return [parse_event(fields[STREAM_FIELD.encode()]) for _, fields in entries]

    def waiting(self) -> set[str]:
        """Job ids still in a queue or a worker's in-flight list."""
        ids: set[str] = set()
        for pattern in (f"rq:queue:{self.soak.prefix}:*", f"{self.soak.prefix}:worker:*:inflight"):
            for key in self.r.scan_iter(match=pattern):
                if self.r.type(key) == b"list":
                    ids.update(text(v) for v in self.r.lrange(key, 0, -1))
        return ids

    def summary(self) -> dict[str, Any]:
        ledger = self.soak.ledger
        jobs: dict[str, str] = dict(ledger.acked)
        batches, batch_lines_unqueued = [], 0
        listed = [text(b) for b in self.r.zrange(self.keys.batches(), 0, -1)]
        for batch_id in listed:
            raw = {text(k): text(v) for k, v in self.r.hgetall(self.keys.batch(batch_id))
                   .items() if k != b"meta"}
            total = int(raw.get("total", 0))
            hex_id = batch_id.removeprefix("batch_")
            accounted = {int(k) for k in self.r.hkeys(self.keys.batch_results(batch_id))}
            for line in range(1, total + 1):
                job_id = f"{hex_id}-{line}"
                if line not in accounted and not self.r.exists(self.keys.events(job_id)):
                    batch_lines_unqueued += 1
                jobs.setdefault(job_id, "batch")
            batches.append({"id": batch_id, "status": raw.get("status"), "total": total,
                            "completed": int(raw.get("completed", 0)),
                            "failed": int(raw.get("failed", 0)),
                            "accounted": len(accounted),
                            "created_by_soak": batch_id in ledger.batches})
        orphans = []
        for key in self.r.scan_iter(match=f"{self.soak.prefix}:job:*:events"):
            job_id = text(key)[len(self.soak.prefix) + len(":job:"):-len(":events")]
            if job_id not in jobs:
                orphans.append(job_id)
                jobs[job_id] = "unacknowledged"
        waiting = self.waiting()
        outcome: Counter[str] = Counter()
        failures: Counter[str] = Counter()
        lost: list[dict[str, Any]] = []
        twice: list[dict[str, Any]] = []
        duplicate_finals = 0
        results: dict[str, FinalEvent] = {}
        token_events: dict[str, int] = {}  # of each job's newest attempt
        for job_id, source in jobs.items():
            events = self.events(job_id)
            finals = [e for e in events if isinstance(e, FinalEvent)]
            if not finals:
                if source != "unacknowledged":
                    lost.append({"job_id": job_id, "source": source,
                                 "still_waiting": job_id in waiting})
                continue
            newest = max(finals, key=lambda f: (f.attempt, f.seq))
            results[job_id] = newest
            token_events[job_id] = sum(1 for e in events if isinstance(e, TokenEvent)
                                       and e.attempt == newest.attempt)
            outcome[f"{source} {newest.status}"] += 1
            if newest.status is JobStatus.FAILED:
                failures[f"{source}: {(newest.error or '')[:100]}"] += 1
            finished = {f.attempt for f in finals if f.status is JobStatus.FINISHED}
            if len(finished) > 1:
                twice.append({"job_id": job_id, "source": source,
                              "attempts": sorted(finished)})
            duplicate_finals += len(finals) - len({f.attempt for f in finals})
        streams = self.streams(results, token_events)
        exits = [e for e in ledger.exits]
        summary: dict[str, Any] = {
            "setup": {"minutes": self.soak.args.minutes, "seed": self.soak.args.seed,
                      "workers": len(WORKERS), "slots": self.soak.args.slots,
                      "gateways": len(GATEWAYS), "streams": self.soak.args.streams,
                      "batch_lines": self.soak.args.batch_lines,
                      "heartbeat_seconds": HEARTBEAT_SECONDS, "ttl_seconds": TTL_SECONDS,
                      "step_delay_seconds": self.soak.args.step_delay,
                      "fault_every_seconds": self.soak.args.fault_every,
                      "redis": "AOF everysec, noeviction, clean restarts",
                      "load_average": os.getloadavg()},
            "jobs": {"submitted": sum(1 for s in jobs.values() if s != "unacknowledged"),
                     "by_source": dict(Counter(s for s in jobs.values()
                                               if s != "unacknowledged")),
                     "outcomes": dict(outcome), "failed_reasons": dict(failures),
                     "lost": len(lost), "lost_jobs": lost[:50],
                     "finished_twice": len(twice), "finished_twice_jobs": twice[:50],
                     "final_events_appended_twice": duplicate_finals,
                     "unacknowledged_submits": len(ledger.unacked),
                     "orphans_found_in_redis": len(orphans)},
            "batches": {"created": len(ledger.batches), "in_redis": len(batches),
                        "lines_never_queued": batch_lines_unqueued,
                        "create_seconds": ledger.batch_create_seconds, "list": batches},
            "streams": streams,
            "refused": dict(ledger.refused),
            "faults": {"by_kind": dict(Counter(f["kind"] for f in ledger.faults)),
                       "list": ledger.faults},
            "unexpected_exits": exits,
            "harness_errors": ledger.harness_errors[:50],
            "log_events": self.log_events(),
        }
        summary["failed_checks"] = [name for name, bad in (
            ("lost", summary["jobs"]["lost"]), ("finished_twice", len(twice)),
            ("streams_cut_silently", streams["cut_silently"]),
            ("streams_stalled", streams["stalled"]),
            ("tokens_duplicated", streams["duplicated"]), ("tokens_missing", streams["missing"]),
            ("unexpected_exits", len(exits)),
            ("harness_errors", len(ledger.harness_errors))) if bad]
        return summary

    def streams(self, results: dict[str, FinalEvent],
                token_events: dict[str, int]) -> dict[str, Any]:
        """Per kind of client: cuts, hang-ups, resumes, and what was shown against the job's
        result (a job that did not finish, or a stream given up on, is not compared); a
        stream whose text all came in one event although its job streamed several token
        events did not stream (its reader stopped trusting token events: ``stream.gap``)."""
        out: dict[str, Any] = {kind: Counter() for kind in ("client", "sse")}
        cuts_by_fault: Counter[str] = Counter()
        examples: list[dict[str, Any]] = []
        for rec in self.soak.ledger.streams:
            c = out[rec.kind]
            c["streams"] += 1
            for why in ("silent", "error", "stall"):
                c[{"silent": "cut_silently", "error": "cut_with_error",
                   "stall": "stalled"}[why]] += rec.cuts.count(why)
            for why, at in zip(rec.cuts, rec.cut_at, strict=True):
                cuts_by_fault[f"{why} during {self.fault_at(at - self.soak.t0)}"] += 1
            c["disconnects"] += rec.disconnects
            c["resumes"] += rec.resumes
            c["replayed_dropped"] += rec.replayed
            c["rewritten_chunks"] += rec.rewritten
            c["gave_up"] += rec.gave_up
            example = {k: v for k, v in asdict(rec).items() if k not in ("seen", "cut_at")}
            example["cut_at_s"] = [round(t - self.soak.t0, 1) for t in rec.cut_at]
            final = results.get(rec.job_id or "")
            if final is None or final.status is not JobStatus.FINISHED or rec.gave_up:
                c[f"not compared ({final.status if final else 'no final'})"] += 1
            else:
                expected: list[int] | str = (final.tokens if rec.kind == "client"
                                             else final.text)
                # what the two have in common, in order: the rest of what was shown was
                # duplicated (or wrong), the rest of the result missing
                same = sum(b.size for b in SequenceMatcher(
                    None, rec.seen, expected, autojunk=False).get_matching_blocks())
                d, m = len(rec.seen) - same, len(expected) - same
                c["compared"] += 1
                c["duplicated"] += d
                c["missing"] += m
                if d or m:
                    example.update(duplicated=d, missing=m)
                if rec.chunks <= 1 < token_events.get(rec.job_id or "", 0):
                    c["text_only_at_end"] += 1
                    example["text_only_at_end"] = True
            if rec.cuts or rec.errors or "duplicated" in example or "text_only_at_end" in example:
                examples.append(example)
        kinds = ("client", "sse")
        return {**{k: dict(out[k]) for k in kinds},
                **{name: sum(out[k][name] for k in kinds)
                   for name in ("cut_silently", "stalled", "duplicated", "missing",
                                "text_only_at_end")},
                "cuts_by_fault": dict(cuts_by_fault), "examples": examples[:100]}

    def fault_at(self, t: float) -> str:
        """The fault in progress at ``t`` seconds into the soak (or ended up to 5 s before:
        its effects linger a moment), else "no fault"."""
        for fault in self.soak.ledger.faults:
            if fault["at_s"] <= t <= fault["at_s"] + fault["seconds"] + 5:
                return str(fault["kind"])
        return "no fault"

    def log_events(self) -> dict[str, dict[str, int]]:
        """The watched events (and any at error level) in each process's log."""
        logs = {name: proc.logfile for name, proc in self.soak.procs().items()}
        logs["clients"] = self.soak.workdir / "logs" / "clients.log"
        counts: dict[str, dict[str, int]] = {}
        for name, logfile in logs.items():
            seen: Counter[str] = Counter()
            with contextlib.suppress(OSError):
                for line in logfile.read_text(errors="replace").splitlines():
                    try:
                        entry = json.loads(line)
                    except ValueError:
                        seen["(traceback)"] += "Traceback" in line
                        continue
                    if not isinstance(entry, dict):
                        continue
                    event = str(entry.get("event"))
                    if event in WATCHED_EVENTS or entry.get("level") in ("error", "critical"):
                        seen[event] += 1
            counts[name] = {k: v for k, v in seen.items() if v}
        return counts


# -- the table ------------------------------------------------------------------------------
def table(s: dict[str, Any]) -> str:
    j, st, f = s["jobs"], s["streams"], s["faults"]["by_kind"]
    setup = s["setup"]
    sigterm_rc = [x for x in s["faults"]["list"] if x["kind"] in ("worker_sigterm",
                                                                   "gateway_restart")
                  and x.get("rc") not in (0, None)]
    rows = [
        ("jobs submitted", j["submitted"], ", ".join(f"{k} {v}" for k, v in
                                                     sorted(j["by_source"].items()))),
        ("jobs ended", sum(j["outcomes"].values()),
         ", ".join(f"{k} {v}" for k, v in sorted(j["outcomes"].items()))),
        ("jobs lost (no final event)", j["lost"],
         f"{sum(1 for x in j['lost_jobs'] if x['still_waiting'])} still queued/in flight "
         + " ".join(x["job_id"] for x in j["lost_jobs"][:2])),
        ("jobs finished twice", j["finished_twice"],
         f"final events appended twice (same attempt): {j['final_events_appended_twice']} "
         + " ".join(x["job_id"] for x in j["finished_twice_jobs"][:2])),
        ("streams", st["client"].get("streams", 0) + st["sse"].get("streams", 0),
         f"client {st['client'].get('streams', 0)}, sse {st['sse'].get('streams', 0)}"),
        ("streams cut without an error", st["cut_silently"],
         f"client {st['client'].get('cut_silently', 0)}, sse {st['sse'].get('cut_silently', 0)}"),
        ("stream reads ended by an error", sum(st[k].get("cut_with_error", 0)
                                               for k in ("client", "sse")),
         f"client {st['client'].get('cut_with_error', 0)}, "
         f"sse {st['sse'].get('cut_with_error', 0)} (then resumed)"),
        ("streams stalled", st["stalled"], f"no byte for {STALL_SECONDS:.0f} s"),
        ("cuts and errors by fault", sum(st["cuts_by_fault"].values()),
         ", ".join(f"{k} {v}" for k, v in sorted(st["cuts_by_fault"].items()))),
        ("tokens duplicated", st["duplicated"], "client: tokens, sse: characters"),
        ("tokens missing", st["missing"], "client: tokens, sse: characters"),
        ("streams not streamed", st["text_only_at_end"],
         "all the text in one event (a reader that saw a stream.gap)"),
        ("client hang-ups / resumes", sum(st[k].get("disconnects", 0) for k in ("client", "sse")),
         f"resumes {sum(st[k].get('resumes', 0) for k in ('client', 'sse'))}"),
        ("submits refused", sum(s["refused"].values()),
         f"{len(s['refused'])} reasons (JSON: refused)"),
        ("batches", s["batches"]["created"],
         f"in Redis {s['batches']['in_redis']}, lines never queued "
         f"{s['batches']['lines_never_queued']}"),
        ("faults injected", sum(f.values()), ", ".join(f"{k} {v}" for k, v in sorted(f.items()))),
        ("SIGTERM exits non-zero", len(sigterm_rc),
         ", ".join(f"{f['target']} rc={f['rc']}" for f in sigterm_rc[:6])),
        ("unexpected process exits", len(s["unexpected_exits"]),
         ", ".join(f"{e['process']} rc={e['rc']}" for e in s["unexpected_exits"][:6])),
        ("soak's own errors", len(s["harness_errors"]), "; ".join(s["harness_errors"][:2])),
    ]
    width = max(len(r[0]) for r in rows)
    head = (f"fault soak: {setup['minutes']} min, seed {setup['seed']}, "
            f"{setup['workers']} workers x {setup['slots']} slots, {setup['gateways']} "
            f"gateways, {setup['streams']} streams, load {setup['load_average'][0]:.1f}")
    lines = [head, "-" * len(head)]
    lines += [f"{name:<{width}}  {value:>6}  {note}" for name, value, note in rows]
    verdict = ("PASS" if not s["failed_checks"]
               else "FAIL: " + ", ".join(s["failed_checks"]))
    return "\n".join([*lines, verdict])


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=20.0, help="how long faults run")
    parser.add_argument("--seed", type=int, default=1, help="seeds the faults and the clients")
    parser.add_argument("--streams", type=int, default=6,
                        help="concurrent streaming clients (even: client, odd: SSE)")
    parser.add_argument("--slots", type=int, default=2, help="slots per worker")
    parser.add_argument("--batch-lines", type=int, default=100, help="lines per batch")
    parser.add_argument("--max-tokens", type=int, default=96, help="largest budget of a job")
    parser.add_argument("--step-delay", type=float, default=0.02,
                        help="seconds per decode step (slows the tiny model so a job spans "
                             "faults)")
    parser.add_argument("--fault-every", type=float, default=15.0,
                        help="mean seconds between faults (uniform 0.5x-1.5x)")
    parser.add_argument("--faults", default=",".join(FAULT_KINDS),
                        help="comma-separated fault kinds to inject (default: all but "
                             f"{', '.join(EXTRA_FAULT_KINDS)})")
    parser.add_argument("--drain-seconds", type=float, default=300.0,
                        help="longest wait for the last streams and batch after the faults")
    parser.add_argument("--out", type=Path, help="write the JSON summary here")
    parser.add_argument("--workdir", type=Path,
                        help="logs, models and Redis data here (default: a temporary "
                             "directory, kept when the soak fails)")
    args = parser.parse_args()
    unknown = set(args.faults.split(",")) - set(FAULT_KINDS + EXTRA_FAULT_KINDS)
    if unknown:
        parser.error(f"--faults: unknown kinds {', '.join(sorted(unknown))}; "
                     f"known: {', '.join(FAULT_KINDS + EXTRA_FAULT_KINDS)}")
    args.faults = args.faults.split(",")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="specfleet-soak-"))
    signal.signal(signal.SIGTERM, _interrupted)  # stopped: its processes are stopped too
    signal.signal(signal.SIGINT, _interrupted)
    soak = Soak(args, workdir)
    try:
        soak.start()
        summary = soak.run()
    finally:
        soak.stop()
    summary["workdir"] = str(workdir)
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    print(table(summary))
    if summary["failed_checks"] or args.workdir:
        log(f"logs kept in {workdir / 'logs'}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if summary["failed_checks"] else 0


if __name__ == "__main__":
    sys.exit(main())
