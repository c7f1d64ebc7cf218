"""Scaling from zero: a burst of requests against a fleet with no worker at all, and an
autoscaler that starts workers from the per-model demand gauge alone.

One Redis, one gateway (``specfleet serve``), the tiny chat model declared through the
gateway (``POST /v1/specfleet/models``: its path, contexts and slots) and no worker. At t=0 a
burst arrives at once: ``--requests`` streamed chat completions and a batch of
``--batch-lines`` lines. The autoscaler (a thread of this script, as an operator's would be)
reads nothing but ``GET /metrics``: every ``--tick`` seconds it takes
``specfleet:model_demand_slots`` (running + queued + waiting for a worker), wants
``ceil(demand / slots)`` workers (at most ``--max-workers``), starts the missing ones with
the options the declaration holds, and stops them all once demand has been 0 for ``--idle``
seconds: the fleet goes back to zero.

Reported (JSON on stdout, a markdown table with ``--markdown``, progress on stderr):

- time to first token from zero: per streamed request, from its send (no worker anywhere)
  to its first content chunk; min, median, max;
- lines lost: streamed requests that failed or ended without text, plus batch lines not
  completed (must be 0);
- the worker count over time: each tick's demand, waiting requests, queued jobs, loading and
  live workers, and the workers the autoscaler had started;
- the host's load average before and after (run it under ``flock /tmp/specfleet-bench.lock``).

    ./.venv/bin/python bench/scale_from_zero.py [--requests 24] [--batch-lines 30]
        [--slots 4] [--max-workers 3] [--max-tokens 16] [--markdown]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coordinator.processes import stop_processes  # noqa: E402
from coordinator.redis_local import free_port, local_redis  # noqa: E402
from worker.testmodels.tiny import write_dense_llama  # noqa: E402

BIN = Path(sys.executable).parent
MODEL = "tiny-zero"
CTX = 512


def log(message: str) -> None:
    print(f"[scale_from_zero] {message}", file=sys.stderr, flush=True)


def gauges(url: str) -> dict[str, float]:
    """The per-model gauges of ``MODEL`` on the gateway's /metrics (name -> value)."""
    body = httpx.get(url + "/metrics", timeout=10).text
    return {s.name.removeprefix("specfleet:"): s.value
            for family in text_string_to_metric_families(body) for s in family.samples
            if s.labels == {"model": MODEL}}


class Autoscaler(threading.Thread):
    """Starts workers of the declared model from the demand gauge, stops them when idle."""

    def __init__(self, url: str, env: dict[str, str], logs: Path, args: argparse.Namespace,
                 t0: float) -> None:
        super().__init__(name="autoscaler", daemon=True)
        self.url, self.env, self.logs, self.args, self.t0 = url, env, logs, args, t0
        declared = httpx.get(url + "/v1/specfleet/models", timeout=10).json()["data"]
        self.entry = next(e for e in declared if e["name"] == MODEL)
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        self.timeline: list[dict[str, Any]] = []
        self.stopping = threading.Event()
        self.idle_since: float | None = None
        #: Workers that exited on their own (a crash: its log tail goes to stderr), and those
        #: the autoscaler stopped.
        self.crashed: set[str] = set()
        self.retired: set[str] = set()

    def _start_worker(self) -> None:
        e = self.entry
        name = f"z{len(self.workers)}-{uuid.uuid4().hex[:4]}"
        cmd = [str(BIN / "specfleet"), "worker", "--model", e["model"], "--model-name", MODEL,
               "--name", name, "--threads", str(self.args.threads),
               "--ctx", str(max(e["contexts"])), "--slots", str(e["slots"])]
        log_file = (self.logs / f"{name}.log").open("wb")
        self.workers[name] = subprocess.Popen(cmd, env=self.env, stdout=log_file,
                                              stderr=subprocess.STDOUT)

    def run(self) -> None:
        while not self.stopping.wait(self.args.tick):
            try:
                g = gauges(self.url)
            except httpx.HTTPError as exc:
                log(f"metrics unreadable: {exc}")
                continue
            demand = int(g.get("model_demand_slots", 0))
            self._note_crashes()
            running = {n: w for n, w in self.workers.items() if w.poll() is None}
            wanted = min(self.args.max_workers, math.ceil(demand / self.entry["slots"]))
            now = time.monotonic()
            if demand:
                self.idle_since = None
            elif running and self.idle_since is None:
                self.idle_since = now
            if wanted > len(running):
                for _ in range(wanted - len(running)):
                    self._start_worker()
            elif running and self.idle_since is not None \
                    and now - self.idle_since >= self.args.idle:
                self.retired |= running.keys()
                stop_processes(running.values(), timeout=30)  # back to zero
                self.idle_since = None
            self.timeline.append({
                "t": round(now - self.t0, 2), "demand_slots": demand,
                "waiting_requests": int(g.get("model_waiting_requests", 0)),
                "queued_jobs": int(g.get("model_queued_jobs", 0)),
                "loading_workers": int(g.get("model_starting_workers", 0)),
                "live_workers": int(g.get("workers_live", 0)),
                "started_workers": sum(1 for w in self.workers.values() if w.poll() is None)})

    def _note_crashes(self) -> None:
        for name, worker in self.workers.items():
            if worker.poll() is not None and name not in self.crashed | self.retired:
                self.crashed.add(name)
                log(f"worker {name} exited ({worker.returncode}): "
                    f"{(self.logs / f'{name}.log').read_text()[-1500:]}")

    def stop(self) -> None:
        self.stopping.set()
        self.join(timeout=30)
        stop_processes(self.workers.values(), timeout=30)


async def stream_once(client: httpx.AsyncClient, url: str, i: int,
                      max_tokens: int, t0: float) -> dict[str, Any]:
    """One streamed chat completion sent at the burst: its time to first token and text."""
    body = {"model": MODEL, "stream": True, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": f"Request {i}: say something"}]}
    first: float | None = None
    text, error = "", None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            data = json.loads(line[6:])
            if "error" in data:
                error = data["error"]
                continue
            delta = data["choices"][0]["delta"].get("content") if data["choices"] else None
            if delta:
                first = first if first is not None else time.monotonic() - t0
                text += delta
    return {"status": response.status_code, "ttft_s": first, "chars": len(text),
            "error": error}


async def burst(url: str, args: argparse.Namespace, t0: float) -> list[dict[str, Any]]:
    limits = httpx.Limits(max_connections=args.requests + 8)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        return list(await asyncio.gather(*(stream_once(client, url, i, args.max_tokens, t0)
                                           for i in range(args.requests))))


def create_batch(url: str, lines: int, max_tokens: int) -> str:
    body = "\n".join(json.dumps({"custom_id": f"line-{n}", "method": "POST",
                                 "url": "/v1/completions",
                                 "body": {"model": MODEL, "prompt": f"Line {n}:",
                                          "max_tokens": max_tokens}})
                     for n in range(lines)).encode()
    upload = httpx.post(url + "/v1/files", files={"file": ("in.jsonl", body)},
                        data={"purpose": "batch"}, timeout=30).json()
    batch = httpx.post(url + "/v1/batches", timeout=30, json={
        "input_file_id": upload["id"], "endpoint": "/v1/completions",
        "completion_window": "24h"}).json()
    return str(batch["id"])


def wait_batch(url: str, batch_id: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        batch = httpx.get(url + f"/v1/batches/{batch_id}", timeout=30).json()
        if batch["status"] in ("completed", "failed", "expired", "cancelled"):
            return dict(batch)
        if time.monotonic() > deadline:
            return dict(batch)
        time.sleep(0.25)


def run(args: argparse.Namespace, redis: str, tmp: Path) -> dict[str, Any]:
    model_path = write_dense_llama(tmp / "tiny-chat.gguf", chat=True)
    prefix = f"zero{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "REDIS_URL": redis, "SPECFLEET_PREFIX": prefix,
           "SPECFLEET_LOG_LEVEL": "warning", "CUDA_VISIBLE_DEVICES": "",
           "SPECFLEET_WAIT_FOR_WORKER_SECONDS": str(args.timeout),
           "SPECFLEET_COST_CACHE_DIR": str(tmp / "rowcosts")}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    gateway = subprocess.Popen([str(BIN / "specfleet"), "serve", "--port", str(port)], env=env,
                               stdout=(tmp / "gateway.log").open("wb"),
                               stderr=subprocess.STDOUT)
    scaler: Autoscaler | None = None
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if gateway.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"bench: the gateway did not start: "
                                 f"{(tmp / 'gateway.log').read_text()[-2000:]}")
            time.sleep(0.1)
        declared = httpx.post(url + "/v1/specfleet/models", timeout=30, json={
            "name": MODEL, "model": str(model_path), "contexts": [CTX], "slots": args.slots,
            "device": "cpu"})
        declared.raise_for_status()
        assert gauges(url).get("workers_live", 0) == 0
        log(f"declared {MODEL}, no worker; burst of {args.requests} streams + a batch of "
            f"{args.batch_lines} lines")
        t0 = time.monotonic()
        scaler = Autoscaler(url, env, tmp, args, t0)
        scaler.start()
        batch_id = create_batch(url, args.batch_lines, args.max_tokens)
        streams = asyncio.run(burst(url, args, t0))
        batch = wait_batch(url, batch_id, args.timeout)
        log(f"burst served; waiting for the fleet to go back to zero (idle {args.idle} s)")
        back = time.monotonic() + args.idle + 30
        while time.monotonic() < back and (not scaler.timeline or
                                           scaler.timeline[-1]["started_workers"]):
            time.sleep(args.tick)
        time.sleep(2 * args.tick)
    finally:
        if scaler is not None:
            scaler.stop()
        stop_processes([gateway], timeout=30)
    ttfts = sorted(s["ttft_s"] for s in streams if s["ttft_s"] is not None)
    lost_streams = sum(1 for s in streams if s["status"] != 200 or s["error"] or not s["chars"])
    counts = batch["request_counts"]
    return {
        "ttft_from_zero_s": {"min": round(ttfts[0], 3) if ttfts else None,
                             "median": round(statistics.median(ttfts), 3) if ttfts else None,
                             "max": round(ttfts[-1], 3) if ttfts else None},
        "streams": {"sent": len(streams), "lost": lost_streams},
        "batch": {"status": batch["status"], "lines": counts["total"],
                  "completed": counts["completed"], "failed": counts["failed"],
                  "lost": counts["total"] - counts["completed"]},
        "lines_lost": lost_streams + counts["total"] - counts["completed"],
        "workers_started": len(scaler.workers) if scaler else 0,
        "workers_crashed": sorted(scaler.crashed) if scaler else [],
        "timeline": scaler.timeline if scaler else [],
    }


def markdown(result: dict[str, Any]) -> str:
    t = result["ttft_from_zero_s"]
    rows = [
        "| figure | value |", "|---|---|",
        f"| time to first token from zero (min / median / max) | {t['min']} / {t['median']} / "
        f"{t['max']} s |",
        f"| streamed requests lost | {result['streams']['lost']} of "
        f"{result['streams']['sent']} |",
        f"| batch lines lost | {result['batch']['lost']} of {result['batch']['lines']} "
        f"({result['batch']['status']}) |",
        f"| workers started | {result['workers_started']} |",
        f"| load average before / after | {result['load_before']} / {result['load_after']} |",
        "", "| t (s) | demand slots | waiting | queued | loading | live | started |",
        "|---|---|---|---|---|---|---|"]
    last: tuple[Any, ...] | None = None
    for tick in result["timeline"]:
        row = (tick["demand_slots"], tick["waiting_requests"], tick["queued_jobs"],
               tick["loading_workers"], tick["live_workers"], tick["started_workers"])
        if row != last:  # only the ticks where something changed
            rows.append(f"| {tick['t']} | " + " | ".join(str(v) for v in row) + " |")
            last = row
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=24, help="streamed requests")
    parser.add_argument("--batch-lines", type=int, default=30, help="lines of the batch")
    parser.add_argument("--slots", type=int, default=4, help="slots per worker (declared)")
    parser.add_argument("--max-workers", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="threads per worker")
    parser.add_argument("--tick", type=float, default=0.5, help="autoscaler period, s")
    parser.add_argument("--idle", type=float, default=5.0,
                        help="seconds of no demand before the fleet is stopped")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="longest a request waits for a worker, and for its answer")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="specfleet-zero-") as tmp, local_redis() as redis:
        result = run(args, redis, Path(tmp))
    result["load_before"] = " ".join(f"{v:.2f}" for v in load_before)
    result["load_after"] = " ".join(f"{v:.2f}" for v in os.getloadavg())
    result["setup"] = {k: v for k, v in vars(args).items() if k != "markdown"}
    print(markdown(result) if args.markdown else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
