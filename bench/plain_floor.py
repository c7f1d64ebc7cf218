"""Plain greedy decoding against its floor: llama.cpp's own llama-bench on the same model.

Three rates of one-token-at-a-time greedy decoding of Gemma 3 270M Q4_K_M, interleaved by
round (the order flips every round):

- ``llama_bench``: ``llama-bench -p 0 -n N`` (pure llama.cpp, no sampling), with repacked
  weights and without (``--repack 1`` / ``0``): what llama-server would decode at;
- ``bare``: a ctypes loop over ``worker.llm`` (decode one token, argmax, repeat), loaded as
  the engine loads the model;
- ``engine``: ``SpeculativeEngine.generate`` with speculation off, the prompt's prefill
  subtracted (a one-token generation of the same prompt, timed alone).

``bare`` against ``llama_bench`` is what our loading and calling of llama.cpp costs or saves;
``engine`` against ``bare`` is our per-token overhead. The llama-bench binary comes from
``--llama-bench`` or beside ``$SPECFLEET_LLAMA_SERVER`` (docs/benchmarks.md builds both).

    ./.venv/bin/python bench/plain_floor.py [--tokens 128] [--reps 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from peer_server import SERVER_ENV  # noqa: E402

from shared.logs import configure_logging  # noqa: E402
from shared.protocol import SpecMethod, SpecSettings  # noqa: E402
from worker.engine.engine import EngineConfig, SpeculativeEngine  # noqa: E402
from worker.launch import EngineCapacity  # noqa: E402
from worker.llm import Batch, Context, ContextSpec, Model, ModelSpec  # noqa: E402
from worker.testmodels.gemma import gemma_q4_path  # noqa: E402

PROMPT = list(range(2, 34))


def llama_bench(binary: str, model: str, tokens: int, threads: int, repack: int) -> float:
    """llama-bench's mean tg rate over 3 repetitions."""
    out = subprocess.run(
        [binary, "-m", model, "-p", "0", "-n", str(tokens), "-t", str(threads), "-r", "3",
         "--repack", str(repack), "-o", "json"], capture_output=True, text=True, check=True,
        env={**os.environ, "LD_LIBRARY_PATH": str(Path(binary).parent)}).stdout
    return float(json.loads(out)[0]["avg_ts"])


def bare_loop(context: Context, batch: Batch, tokens: int) -> float:
    context.clear()
    context.decode(batch.set(PROMPT, 0, True))
    token = context.argmax(len(PROMPT) - 1)
    t0 = time.perf_counter()
    for i in range(tokens):
        context.decode(batch.set([token], len(PROMPT) + i, True))
        token = context.argmax(0)
    return tokens / (time.perf_counter() - t0)


def engine_rate(engine: SpeculativeEngine, tokens: int) -> float:
    plain = SpecSettings(method=SpecMethod.NONE)
    t0 = time.perf_counter()
    engine.generate(PROMPT, 1, plain)
    prefill = time.perf_counter() - t0
    t1 = time.perf_counter()
    engine.generate(PROMPT, tokens + 1, plain)
    return tokens / (time.perf_counter() - t1 - prefill)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-bench", help="llama-bench binary (default: beside "
                    f"${SERVER_ENV})")
    args = ap.parse_args()
    configure_logging(level="warning")
    model = str(gemma_q4_path())
    server = os.environ.get(SERVER_ENV)
    binary = args.llama_bench or (str(Path(server).with_name("llama-bench")) if server else None)
    with Model(ModelSpec(model)) as loaded, \
            Context(loaded, ContextSpec(n_ctx=1024, n_batch=64, n_ubatch=64,
                                        n_threads=args.threads)) as context, \
            SpeculativeEngine(EngineConfig(model, n_ctx=1024, slots=1, n_threads=args.threads,
                                           capacity=EngineCapacity(SpecMethod.NONE))) as engine:
        batch = Batch(64)
        runs: dict[str, Callable[[], float]] = {
            "bare": lambda: bare_loop(context, batch, args.tokens),
            "engine": lambda: engine_rate(engine, args.tokens),
        }
        if binary and Path(binary).is_file():
            for repack in (0, 1):
                runs[f"llama_bench_repack{repack}"] = (
                    lambda r=repack: llama_bench(binary, model, args.tokens, args.threads, r))
        else:
            print("llama-bench not found: ours only", file=sys.stderr)
        rates: dict[str, list[float]] = {name: [] for name in runs}
        for rep in range(args.reps):
            for name in (list(runs) if rep % 2 == 0 else list(runs)[::-1]):
                try:
                    rates[name].append(runs[name]())
                except subprocess.CalledProcessError as exc:
                    print(f"{name}: failed ({exc.returncode})", file=sys.stderr)
            print(f"[{rep + 1}/{args.reps}] " + ", ".join(
                f"{n} {r[-1]:.1f}" for n, r in rates.items() if r), file=sys.stderr, flush=True)
    medians = {name: round(statistics.median(r), 1) for name, r in rates.items() if r}
    summary: dict[str, object] = {"tokens": args.tokens, "threads": args.threads,
                                  "tok_s": medians}
    for peer in ("llama_bench_repack0", "llama_bench_repack1"):
        if peer in medians:
            summary[f"bare_vs_{peer}"] = round(medians["bare"] / medians[peer], 3)
    summary["engine_vs_bare"] = round(medians["engine"] / medians["bare"], 3)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
