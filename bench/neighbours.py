"""A CPU worker beside busy neighbours: plain decode tok/s alone, beside one busy core, and
beside a second decoding worker on the same cores, per thread-pool setting, in one run.

Gemma 3 270M Q4_K_M, greedy plain decoding through ``SpeculativeEngine.generate`` (what a
worker runs), ``--threads`` llama.cpp threads. Each measurement is a fresh process
(``--child``), so each setting's environment is read by the OpenMP runtime at its start, as a
worker's is. Neighbours:

- ``alone``: nothing else started by the bench;
- ``busy_core``: one ``yes > /dev/null`` (one core kept busy, as another tenant's job);
- ``second_worker``: a second decoding process with the same setting, generating in a loop.

Settings (``--settings``): ``default`` (llama.cpp's OpenMP thread pool as built, libgomp's
default wait policy: spin ~300k iterations at each barrier before sleeping), ``passive``
(``OMP_WAIT_POLICY=PASSIVE``: sleep at once), ``spin`` (``GOMP_SPINCOUNT`` = ``--spin``),
``one_thread`` (``--threads 1``). Rounds interleave the settings and the neighbours, so load
drift falls on all of them alike. Reported: tok/s (median over rounds) and each neighbour's
slowdown against ``alone`` of the same setting, plus ``vs_default_alone`` (what the setting
costs on a quiet host).

    ./.venv/bin/python bench/neighbours.py [--tokens 96] [--rounds 3] [--threads 2]
        [--settings default,passive,spin,one_thread] [--spin 10000] [--markdown]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = list(range(2, 34))
NEIGHBOURS = ("alone", "busy_core", "second_worker")


def setting_env(name: str, spin: int) -> tuple[dict[str, str], int | None]:
    """The environment and the thread count (None: ``--threads``) of setting ``name``."""
    if name == "default":
        return {}, None
    if name == "passive":
        return {"OMP_WAIT_POLICY": "PASSIVE"}, None
    if name == "spin":
        return {"GOMP_SPINCOUNT": str(spin)}, None
    if name == "one_thread":
        return {}, 1
    raise SystemExit(f"unknown setting {name!r}")


def child(tokens: int, threads: int, forever: bool) -> None:
    """Load the engine, warm it, then time ``tokens`` of plain greedy decoding (``forever``:
    decode in a loop until killed, as a neighbour)."""
    sys.path.insert(0, str(ROOT))
    from shared.logs import configure_logging
    from shared.protocol import SpecMethod, SpecSettings
    from worker.engine.engine import EngineConfig, SpeculativeEngine
    from worker.launch import EngineCapacity
    from worker.testmodels.gemma import gemma_q4_path

    configure_logging(level="error")
    engine = SpeculativeEngine(EngineConfig(
        str(gemma_q4_path()), n_ctx=512, slots=1, n_threads=threads,
        capacity=EngineCapacity(SpecMethod.NONE)))
    plain = SpecSettings(method=SpecMethod.NONE)
    engine.generate(PROMPT, 8, plain)
    print("ready", flush=True)
    while forever:
        engine.generate(PROMPT, tokens, plain)
    t0 = time.perf_counter()
    done = len(engine.generate(PROMPT, tokens, plain).tokens)
    print(json.dumps({"tok_s": done / (time.perf_counter() - t0)}), flush=True)


def _spawn(env: dict[str, str], tokens: int, threads: int, forever: bool) -> subprocess.Popen[str]:
    args = [sys.executable, __file__, "--child", "--tokens", str(tokens), "--threads",
            str(threads)] + (["--forever"] if forever else [])
    return subprocess.Popen(args, env={**os.environ, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)


def _wait_ready(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line.strip() != "ready":
        raise SystemExit(f"a decode process did not start (exit {proc.wait()})")


def measure(neighbour: str, env: dict[str, str], tokens: int, threads: int) -> float:
    """One decode's tok/s beside ``neighbour``."""
    beside: subprocess.Popen[str] | subprocess.Popen[bytes] | None = None
    if neighbour == "busy_core":
        beside = subprocess.Popen(["yes"], stdout=subprocess.DEVNULL)
    elif neighbour == "second_worker":
        beside = _spawn(env, tokens, threads, forever=True)
        _wait_ready(beside)
    try:
        proc = _spawn(env, tokens, threads, forever=False)
        _wait_ready(proc)
        assert proc.stdout is not None
        out = proc.stdout.readline()
        proc.wait(timeout=600)
        return float(json.loads(out)["tok_s"])
    finally:
        if beside is not None:
            beside.kill()
            beside.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--settings", default="default,passive,spin,one_thread")
    ap.add_argument("--spin", type=int, default=10000, help="GOMP_SPINCOUNT of 'spin'")
    ap.add_argument("--neighbours", default=",".join(NEIGHBOURS),
                    help="comma list of " + ", ".join(NEIGHBOURS) + " ('alone' is always run)")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--forever", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.tokens, args.threads, args.forever)
        return
    settings = args.settings.split(",")
    neighbours = ["alone", *(n for n in args.neighbours.split(",") if n != "alone")]
    unknown = set(neighbours) - set(NEIGHBOURS)
    if unknown:
        raise SystemExit(f"unknown neighbours {sorted(unknown)}: pick from {NEIGHBOURS}")
    rates: dict[str, dict[str, list[float]]] = {s: {n: [] for n in neighbours} for s in settings}
    load = [os.getloadavg()[0]]
    for r in range(args.rounds):
        order = settings if r % 2 == 0 else settings[::-1]
        for name in order:
            env, threads = setting_env(name, args.spin)
            for neighbour in neighbours:
                rate = measure(neighbour, env, args.tokens, threads or args.threads)
                rates[name][neighbour].append(rate)
                print(f"round {r + 1} {name:>10} {neighbour:>13}: {rate:6.1f} tok/s",
                      file=sys.stderr)
    load.append(os.getloadavg()[0])
    base = statistics.median(rates[settings[0]]["alone"])
    summary: dict[str, dict[str, float]] = {}
    for name in settings:
        alone = statistics.median(rates[name]["alone"])
        row = {"vs_default_alone": alone / base}
        for neighbour in neighbours:
            tok_s = statistics.median(rates[name][neighbour])
            row[f"{neighbour}_tok_s"] = tok_s
            if neighbour != "alone":
                row[f"{neighbour}_slowdown"] = alone / tok_s
        summary[name] = row
    result = {"threads": args.threads, "tokens": args.tokens, "rounds": args.rounds,
              "spin": args.spin, "load_before_after": load, "settings": summary,
              "rates": rates}
    print(json.dumps(result, indent=2))
    if args.markdown and len(neighbours) == len(NEIGHBOURS):
        print("\n| setting | alone tok/s | beside a busy core | beside a second worker "
              "| alone vs default |\n|---|---|---|---|---|")
        for name, row in summary.items():
            print(f"| {name} | {row['alone_tok_s']:.1f} | {row['busy_core_tok_s']:.1f} "
                  f"({row['busy_core_slowdown']:.1f}x slower) | "
                  f"{row['second_worker_tok_s']:.1f} ({row['second_worker_slowdown']:.1f}x "
                  f"slower) | {row['vs_default_alone']:.2f} |")


if __name__ == "__main__":
    main()
