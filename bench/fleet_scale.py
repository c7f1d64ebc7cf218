"""The fleet at scale: exact Redis commands and bytes per job, per token and per idle worker.

For every N in ``--workers`` and G in ``--gateways`` this starts a private ``redis-server``
(a free port, no persistence), N ``specfleet worker`` processes on a tiny test model
(``--threads 1``, ``--slots``), G ``specfleet serve`` gateways, and then measures three
phases with Redis's own counters (``CONFIG RESETSTAT`` before each, ``INFO commandstats``,
``stats``, ``cpu`` and ``clients`` after), so every count is exact, not estimated:

- idle, workers only: commands/s and per worker per second (heartbeats, sweeps, the
  doorbell waits of idle workers); then again with every worker listed as a prefix holder
  of the model (``Keys.holders``, what prefix-affinity routing builds up over time: an idle
  worker's take looks at every other holder's own queues);
- idle, gateways up: what G idle gateways add (their batch pump, hub);
- load: one batch of ``--lines`` lines (``/v1/files`` + ``/v1/batches`` on the first gateway)
  and ``--streams`` streaming clients (``--requests`` each, ``stream: true`` round-robin over
  the gateways) at once. Reported: jobs/s, tokens/s, p50/p99 queue wait (rq's
  ``enqueued_at`` -> ``started_at``), p50/p99 submit-to-first-token (``enqueued_at`` -> the
  first token event's time, every job) and the streaming clients' own time to first token,
  commands and bytes per job and per generated token, the per-command breakdown, Redis CPU,
  connections, and worker/gateway RSS. Lost jobs (a line not completed, a stream without its
  end) are counted and make the run fail.

Counts per job, per token and per idle second do not depend on the machine's load; timings
(jobs/s, waits, CPU) do, and on a small shared box they measure the box, not the fleet.
``commandstats`` counts the commands a Lua script runs as well as the ``EVALSHA`` that ran
it (both are shown; the inner ones are what costs Redis CPU). The bench's own ``INFO`` and
``CONFIG`` calls are left out of the totals; its batch status poll (one ``GET
/v1/batches/{id}`` a second) is in them.

    .venv/bin/python bench/fleet_scale.py [--workers 1,8,32] [--gateways 1,4] [--lines 64]
        [--streams 8] [--requests 2] [--max-tokens 16] [--slots 2] [--idle-seconds 10]

Progress goes to stderr; stdout gets one JSON document (every run) and a Markdown table.
Needs the dev extras (``httpx``) and ``redis-server`` on PATH; docs/scale.md has its figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import psutil
from redis import Redis
from redis.exceptions import RedisError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coordinator.processes import stop_processes  # noqa: E402
from coordinator.redis_local import free_port  # noqa: E402
from shared.keys import STREAM_FIELD, Keys  # noqa: E402
from shared.protocol import parse_event  # noqa: E402
from worker.testmodels import build_tiny_models  # noqa: E402

MODEL = "tiny"
CTX = 512
PROMPT = "the fleet at scale: "
SPECFLEET = str(Path(sys.executable).parent / "specfleet")
#: The bench's own calls, left out of every total.
OWN_COMMANDS = {"info", "config|resetstat", "config", "client|list", "client"}


@dataclass
class Counters:
    """One phase's Redis counters: calls by command, bytes in and out, CPU seconds."""

    calls: dict[str, int] = field(default_factory=dict)
    usec: dict[str, int] = field(default_factory=dict)
    net_in: int = 0
    net_out: int = 0
    cpu: float = 0.0
    clients: int = 0
    at: float = 0.0

    @staticmethod
    def read(conn: Redis) -> Counters:
        info = conn.info("everything")
        calls, usec = {}, {}
        for key, value in info.items():
            if key.startswith("cmdstat_"):
                name = key.removeprefix("cmdstat_")
                if name not in OWN_COMMANDS:
                    calls[name] = int(value["calls"])
                    usec[name] = int(value["usec"])
        return Counters(calls, usec, int(info["total_net_input_bytes"]),
                        int(info["total_net_output_bytes"]),
                        float(info["used_cpu_sys"]) + float(info["used_cpu_user"]),
                        int(info["connected_clients"]), time.monotonic())

    def since(self, before: Counters) -> Counters:
        names = set(self.calls) | set(before.calls)
        return Counters({n: self.calls.get(n, 0) - before.calls.get(n, 0) for n in names},
                        {n: self.usec.get(n, 0) - before.usec.get(n, 0) for n in names},
                        self.net_in - before.net_in, self.net_out - before.net_out,
                        self.cpu - before.cpu, self.clients, self.at - before.at)

    @property
    def total(self) -> int:
        return sum(self.calls.values())

    def top(self, per: float, n: int = 8) -> dict[str, float]:
        """The ``n`` commands with the most calls, as calls per ``per`` (a job, a second)."""
        ranked = sorted(((c, k) for k, c in self.calls.items() if c > 0), reverse=True)[:n]
        return {k: round(c / per, 3) for c, k in ranked}


@contextmanager
def measured(conn: Redis) -> Iterator[list[Counters]]:
    """Reset Redis's counters, yield a list that holds the phase's delta once it ends."""
    conn.config_resetstat()
    before = Counters.read(conn)
    out: list[Counters] = []
    yield out
    out.append(Counters.read(conn).since(before))


class Fleet:
    """A private Redis, N workers and G gateways, all child processes of this bench."""

    def __init__(self, workdir: Path, model: Path) -> None:
        self.workdir = workdir
        self.model = model
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.prefix = f"scale-{uuid.uuid4().hex[:8]}"
        self.redis: subprocess.Popen[bytes] | None = None
        self.workers: list[subprocess.Popen[bytes]] = []
        self.gateways: list[tuple[subprocess.Popen[bytes], int]] = []
        self.env = {**os.environ, "REDIS_URL": self.url, "SPECFLEET_PREFIX": self.prefix,
                    "SPECFLEET_LOG_LEVEL": "warning", "CUDA_VISIBLE_DEVICES": ""}

    def _log(self, name: str) -> Any:
        return (self.workdir / f"{name}.log").open("ab")

    def start_redis(self) -> Redis:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("bench: redis-server is not installed")
        self.redis = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir), "--maxclients", "10000"],
            stdout=self._log("redis"), stderr=subprocess.STDOUT)
        conn = Redis.from_url(self.url, socket_timeout=30)
        deadline = time.monotonic() + 15
        while True:
            try:
                conn.ping()
                return conn
            except (OSError, RedisError):
                pass
            if time.monotonic() > deadline:
                raise SystemExit("bench: the private redis-server did not start")
            time.sleep(0.05)

    def start_workers(self, conn: Redis, n: int, slots: int) -> None:
        keys = Keys(self.prefix)
        for i in range(len(self.workers), n):
            name = f"w{i:03d}"
            self.workers.append(subprocess.Popen(
                [SPECFLEET, "worker", "--model", str(self.model), "--model-name", MODEL,
                 "--name", name, "--threads", "1", "--slots", str(slots), "--ctx", str(CTX)],
                env=self.env, stdout=self._log(name), stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 60 + 10 * n
        while conn.zcard(keys.workers()) < n:
            for i, proc in enumerate(self.workers):
                if proc.poll() is not None:
                    raise SystemExit(f"bench: worker w{i:03d} exited ({proc.returncode}): "
                                     + (self.workdir / f"w{i:03d}.log").read_text()[-2000:])
            if time.monotonic() > deadline:
                raise SystemExit("bench: the workers did not all register")
            time.sleep(0.2)

    def start_gateways(self, g: int, n: int) -> list[str]:
        for i in range(g):
            port = free_port()
            proc = subprocess.Popen([SPECFLEET, "serve", "--port", str(port)], env=self.env,
                                    stdout=self._log(f"g{i}"), stderr=subprocess.STDOUT)
            self.gateways.append((proc, port))
        urls = [f"http://127.0.0.1:{port}" for _, port in self.gateways]
        deadline = time.monotonic() + 120
        for (proc, _), url in zip(self.gateways, urls, strict=True):
            while True:
                if proc.poll() is not None:
                    raise SystemExit(f"bench: a gateway exited ({proc.returncode})")
                try:
                    health = httpx.get(f"{url}/health", timeout=5).json()
                    if health.get("models", {}).get(MODEL) == n:
                        break
                except (httpx.HTTPError, ValueError):
                    pass
                if time.monotonic() > deadline:
                    raise SystemExit("bench: a gateway did not come up")
                time.sleep(0.2)
        return urls

    def stop_gateways(self) -> None:
        stop_processes([p for p, _ in self.gateways], timeout=20)
        self.gateways = []

    def stop(self) -> None:
        self.stop_gateways()
        stop_processes(self.workers, timeout=30)
        if self.redis is not None:
            stop_processes([self.redis])


def rss_mib(procs: list[subprocess.Popen[bytes]]) -> dict[str, float]:
    """Median and largest resident set of ``procs`` in MiB."""
    sizes = []
    for proc in procs:
        try:
            sizes.append(psutil.Process(proc.pid).memory_info().rss / 2**20)
        except psutil.Error:
            continue
    if not sizes:
        return {}
    return {"median": round(statistics.median(sizes), 1), "max": round(max(sizes), 1)}


def idle(conn: Redis, seconds: float, n: int, what: str) -> dict[str, Any]:
    with measured(conn) as out:
        time.sleep(seconds)
    c = out[0]
    per_s = c.total / c.at
    print(f"  idle ({what}): {per_s:.1f} commands/s", file=sys.stderr)
    return {"commands_per_s": round(per_s, 2), "per_worker_per_s": round(per_s / n, 3),
            "bytes_in_per_s": round(c.net_in / c.at), "redis_cpu_pct": round(100 * c.cpu / c.at, 2),
            "connections": c.clients, "top_per_s": c.top(c.at)}


def stream_client(url: str, requests: int, max_tokens: int, ttfts: list[float],
                  failures: list[str]) -> None:
    """``requests`` streaming completions one after another; the time to each first text."""
    with httpx.Client(timeout=300) as client:
        for _ in range(requests):
            t0 = time.monotonic()
            first = None
            done = False
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "stream": True}
            with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                if response.status_code != 200:
                    failures.append(f"stream status {response.status_code}")
                    continue
                for line in response.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        break
                    chunk = json.loads(line[6:])
                    if first is None and chunk["choices"] and chunk["choices"][0].get("text"):
                        first = time.monotonic() - t0
            if not done:
                failures.append("a stream ended without [DONE]")
            elif first is not None:
                ttfts.append(first)


def run_batch(url: str, lines: int, max_tokens: int) -> dict[str, Any]:
    """One batch of ``lines`` completions through the gateway; its final record."""
    content = "".join(json.dumps({"custom_id": f"line-{i}", "method": "POST",
                                  "url": "/v1/completions",
                                  "body": {"model": MODEL, "prompt": f"{PROMPT}{i}",
                                           "max_tokens": max_tokens}}) + "\n"
                      for i in range(lines))
    with httpx.Client(base_url=url, timeout=60) as client:
        upload = client.post("/v1/files", data={"purpose": "batch"},
                             files={"file": ("lines.jsonl", content.encode())})
        upload.raise_for_status()
        batch = client.post("/v1/batches", json={"input_file_id": upload.json()["id"],
                                                 "endpoint": "/v1/completions",
                                                 "completion_window": "24h"})
        batch.raise_for_status()
        record = batch.json()
        while record["status"] not in ("completed", "failed", "expired", "cancelled"):
            time.sleep(1.0)
            record = client.get(f"/v1/batches/{record['id']}").json()
    return record


def _rq_time(raw: bytes | None) -> float | None:
    if not raw:
        return None
    text = raw.decode()
    for fmt in ("%Y-%m-%dT%H:%M:%S.%fZ", "%Y-%m-%dT%H:%M:%SZ"):
        try:
            return datetime.strptime(text, fmt).replace(tzinfo=UTC).timestamp()
        except ValueError:
            continue
    return None


def jobs_seen(conn: Redis, prefix: str) -> list[dict[str, Any]]:
    """Every job of the phase (its event stream): tokens, status, queue wait, first token."""
    keys = Keys(prefix)
    field = STREAM_FIELD.encode()
    found = []
    for key in conn.scan_iter(match=keys.events("*"), count=1000):
        job_id = key.decode().removeprefix(f"{prefix}:job:").removesuffix(":events")
        entries: list[tuple[bytes, dict[bytes, bytes]]] = conn.xrange(key)  # type: ignore[assignment]
        events = [parse_event(fields[field]) for _, fields in entries if field in fields]
        stamps: list[bytes | None] = conn.hmget(  # type: ignore[assignment]
            f"rq:job:{job_id}", ["enqueued_at", "started_at"])
        enqueued, started = (_rq_time(v) for v in stamps)
        first = next((e.ts for e in events if e.type == "token"), None)
        final = next((e for e in events if e.type == "final"), None)
        found.append({
            "status": str(final.status) if final else None,
            "tokens": len(final.tokens) if final else 0,
            "queue_wait": started - enqueued if started and enqueued else None,
            "first_token": first - enqueued if first and enqueued else None})
    return found


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(1000 * ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)], 1)


def load(fleet: Fleet, conn: Redis, urls: list[str], args: argparse.Namespace,
         idle_per_s: float) -> dict[str, Any]:
    """The batch and the streams at once; ``idle_per_s`` (the idle fleet's rate) gives the
    commands above what the fleet spends idle over the same seconds (a lower bound of what
    the jobs cost: busy workers do not idle-poll)."""
    old = list(conn.scan_iter(match=Keys(fleet.prefix).events("*")))
    if old:  # the previous run's jobs
        conn.delete(*old)
    ttfts: list[float] = []
    failures: list[str] = []
    record: dict[str, Any] = {}
    with measured(conn) as out:
        clients = [threading.Thread(target=stream_client, args=(
            urls[i % len(urls)], args.requests, args.max_tokens, ttfts, failures))
            for i in range(args.streams)]
        for t in clients:
            t.start()
        record = run_batch(urls[0], args.lines, args.max_tokens)
        for t in clients:
            t.join()
    c = out[0]
    jobs = jobs_seen(conn, fleet.prefix)
    tokens = sum(j["tokens"] for j in jobs)
    counts = record.get("request_counts", {})
    expected = args.lines + args.streams * args.requests
    finished = sum(1 for j in jobs if j["status"] == "finished")
    lost = expected - finished + len(failures)
    waits = [j["queue_wait"] for j in jobs if j["queue_wait"] is not None]
    firsts = [j["first_token"] for j in jobs if j["first_token"] is not None]
    scripts = sum(c.calls.get(k, 0) for k in ("evalsha", "eval", "fcall"))
    result = {
        "jobs": len(jobs), "expected_jobs": expected, "finished": finished, "lost": lost,
        "batch_status": record.get("status"), "batch_counts": counts,
        "failures": failures[:5], "tokens": tokens, "seconds": round(c.at, 2),
        "jobs_per_s": round(len(jobs) / c.at, 2), "tokens_per_s": round(tokens / c.at, 1),
        "queue_wait_ms": {"p50": pct(waits, 0.5), "p99": pct(waits, 0.99)},
        "submit_to_first_token_ms": {"p50": pct(firsts, 0.5), "p99": pct(firsts, 0.99)},
        "stream_client_ttft_ms": {"p50": pct(ttfts, 0.5), "p99": pct(ttfts, 0.99)},
        "commands": c.total, "commands_per_s": round(c.total / c.at),
        "commands_per_job": round(c.total / max(1, len(jobs)), 1),
        "commands_per_job_above_idle": round((c.total - idle_per_s * c.at) / max(1, len(jobs)),
                                             1),
        "commands_per_token": round(c.total / max(1, tokens), 2),
        "script_calls_per_job": round(scripts / max(1, len(jobs)), 2),
        "bytes_in_per_job": round(c.net_in / max(1, len(jobs))),
        "bytes_out_per_job": round(c.net_out / max(1, len(jobs))),
        "bytes_in_per_token": round(c.net_in / max(1, tokens), 1),
        "redis_cpu_pct": round(100 * c.cpu / c.at, 1),
        "redis_cpu_ms_per_job": round(1000 * c.cpu / max(1, len(jobs)), 3),
        "connections": c.clients,
        "per_job": c.top(max(1, len(jobs)), 14),
        "usec_per_call": {k: round(c.usec[k] / c.calls[k], 2) for k in c.top(1, 14)},
        "worker_rss_mib": rss_mib(fleet.workers),
        "gateway_rss_mib": rss_mib([p for p, _ in fleet.gateways]),
    }
    print(f"  load: {len(jobs)} jobs, {tokens} tokens in {c.at:.1f}s, "
          f"{result['commands_per_job']} commands/job, lost {lost}", file=sys.stderr)
    return result


def run_size(workdir: Path, model: Path, n: int, gateways: list[int],
             args: argparse.Namespace) -> list[dict[str, Any]]:
    fleet = Fleet(workdir / f"n{n}", model)
    fleet.workdir.mkdir(parents=True, exist_ok=True)
    runs = []
    try:
        conn = fleet.start_redis()
        t0 = time.monotonic()
        fleet.start_workers(conn, n, args.slots)
        print(f"N={n}: {n} workers registered in {time.monotonic() - t0:.0f}s", file=sys.stderr)
        time.sleep(2 * float(os.environ.get("SPECFLEET_HEARTBEAT_SECONDS", "2")))
        workers_idle = idle(conn, args.idle_seconds, n, "workers only")
        # Prefix-affinity routing lists every worker a job was routed to as a holder of its
        # model; an idle worker looks at each other holder's own queues on every take.
        # Here every worker is one, as in a fleet that routing has touched for a while.
        keys = Keys(fleet.prefix)
        conn.zadd(keys.holders(MODEL), {f"w{i:03d}": CTX for i in range(n)})
        time.sleep(2 * float(os.environ.get("SPECFLEET_HEARTBEAT_SECONDS", "2")))
        holders_idle = idle(conn, args.idle_seconds, n, "every worker a holder")
        conn.delete(keys.holders(MODEL))
        time.sleep(2 * float(os.environ.get("SPECFLEET_HEARTBEAT_SECONDS", "2")))
        for g in gateways:
            urls = fleet.start_gateways(g, n)
            gateways_idle = idle(conn, args.idle_seconds, n, f"{g} gateways")
            print(f"N={n} G={g}:", file=sys.stderr)
            runs.append({"workers": n, "gateways": g, "idle_workers_only": workers_idle,
                         "idle_every_worker_a_holder": holders_idle,
                         "idle_with_gateways": gateways_idle,
                         "gateway_idle_per_s": round((gateways_idle["commands_per_s"]
                                                      - workers_idle["commands_per_s"]) / g, 2),
                         "load": load(fleet, conn, urls, args,
                                      gateways_idle["commands_per_s"])})
            fleet.stop_gateways()
    finally:
        fleet.stop()
    return runs


def table(runs: list[dict[str, Any]]) -> str:
    head = ("| N | G | jobs | lost | jobs/s | tok/s | queue wait p50/p99 ms | submit→1st token "
            "p50/p99 ms | stream TTFT p50/p99 ms | cmds/job | cmds/token | bytes in/job | "
            "bytes out/job | Redis cmds/s | Redis CPU % | idle cmds/s/worker | idle cmds/s/"
            "gateway | conns | worker RSS MiB | gateway RSS MiB | cmds/job above idle | "
            "idle cmds/s/worker, all holders |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in runs:
        ld = r["load"]
        rows.append(
            f"| {r['workers']} | {r['gateways']} | {ld['jobs']} | {ld['lost']} | "
            f"{ld['jobs_per_s']} | {ld['tokens_per_s']} | {ld['queue_wait_ms']['p50']}/"
            f"{ld['queue_wait_ms']['p99']} | {ld['submit_to_first_token_ms']['p50']}/"
            f"{ld['submit_to_first_token_ms']['p99']} | {ld['stream_client_ttft_ms']['p50']}/"
            f"{ld['stream_client_ttft_ms']['p99']} | {ld['commands_per_job']} | "
            f"{ld['commands_per_token']} | {ld['bytes_in_per_job']} | {ld['bytes_out_per_job']}"
            f" | {ld['commands_per_s']} | {ld['redis_cpu_pct']} | "
            f"{r['idle_workers_only']['per_worker_per_s']} | {r['gateway_idle_per_s']} | "
            f"{ld['connections']} | {ld['worker_rss_mib'].get('median')} | "
            f"{ld['gateway_rss_mib'].get('median')} | {ld['commands_per_job_above_idle']} | "
            f"{r['idle_every_worker_a_holder']['per_worker_per_s']} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="1,8,32", help="fleet sizes N, comma-separated")
    parser.add_argument("--gateways", default="1,4", help="gateway counts G, comma-separated")
    parser.add_argument("--lines", type=int, default=64, help="batch lines per run")
    parser.add_argument("--streams", type=int, default=8, help="streaming clients")
    parser.add_argument("--requests", type=int, default=2, help="requests per streaming client")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--slots", type=int, default=2, help="slots per worker")
    parser.add_argument("--idle-seconds", type=float, default=10.0)
    args = parser.parse_args()
    sizes = [int(x) for x in args.workers.split(",")]
    gateways = [int(x) for x in args.gateways.split(",")]
    with tempfile.TemporaryDirectory(prefix="specfleet-scale-") as tmp:
        model = build_tiny_models(Path(tmp) / "models").dense
        runs = [run for n in sizes for run in run_size(Path(tmp), model, n, gateways, args)]
    setup: dict[str, Any] = dict(vars(args))
    setup.update(cpus=os.cpu_count(), load_average=[round(x, 2) for x in os.getloadavg()])
    print(json.dumps({"setup": setup, "runs": runs}, indent=2))
    print(table(runs))
    if any(r["load"]["lost"] for r in runs):
        raise SystemExit("bench: jobs were lost")


if __name__ == "__main__":
    main()
