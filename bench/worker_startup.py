"""How soon is a worker ready? Seconds from launching ``specfleet worker`` on Gemma 3 270M
Q4_K_M to its registration in Redis (the moment a submit can reach it), per configuration,
with its row-cost cache empty (the first start on a host: the curve is timed) and then warm
(a restart or a scale-up: the curve is read), interleaved round by round.

Each start also reports what the worker's own log says it spent on the curve
(``engine.cost_curve``: timed or read, seconds) and the host's load around it; a start during
which other processes used more than a third of a core is flagged (``busy``), since a
2-thread decode collapses beside a busy core. The worker stops (SIGTERM) once registered.

    ./.venv/bin/python bench/worker_startup.py [--reps 3] [--threads 2]
        [--config "--slots 4" --config "--slots 8 --spec suffix --draft-max 64" ...]

JSON on stdout (every start, and per configuration and cache state the median), a markdown
table with ``--markdown``, progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coordinator.client import Coordinator  # noqa: E402
from coordinator.processes import stop_processes  # noqa: E402
from coordinator.redis_local import local_redis  # noqa: E402
from shared.settings import Settings  # noqa: E402
from worker.testmodels.gemma import gemma_q4_path  # noqa: E402

BIN = Path(sys.executable).parent
CONFIGS = ("--slots 4", "--slots 8", "--slots 1 --spec suffix --draft-max 64",
           "--slots 8 --spec suffix --draft-max 64")
#: Other processes' cores above which a start is flagged busy.
BUSY_CORES = 0.33


def _others(before: Any, own: float, wall: float) -> float:
    after = psutil.cpu_times()
    busy = (sum(after) - after.idle) - (sum(before) - before.idle)
    return max(0.0, busy - own) / wall if wall > 0 else 0.0


def start_once(redis: str, args: str, cache: Path, threads: int, logs: Path) -> dict[str, Any]:
    """One launch of a worker until it registers; its figures."""
    prefix = f"startup{uuid.uuid4().hex[:8]}"
    settings = Settings(redis_url=redis, prefix=prefix)
    log_path = logs / f"{prefix}.log"
    env = {**os.environ, "REDIS_URL": redis, "SPECFLEET_PREFIX": prefix,
           "SPECFLEET_COST_CACHE_DIR": str(cache), "CUDA_VISIBLE_DEVICES": ""}
    cmd = [str(BIN / "specfleet"), "worker", "--model", str(gemma_q4_path()), "--model-name",
           "gemma", "--threads", str(threads), *shlex.split(args)]
    coordinator = Coordinator(settings)
    load = os.getloadavg()[0]
    cpu_before = psutil.cpu_times()
    t0 = time.perf_counter()
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        child = psutil.Process(proc.pid)
        own = 0.0
        while not coordinator.registry.live_workers("gemma"):
            if proc.poll() is not None:
                raise SystemExit(f"bench: the worker exited: {log_path.read_text()[-2000:]}")
            times = child.cpu_times()
            own = times.user + times.system + times.children_user + times.children_system
            time.sleep(0.02)
        seconds = time.perf_counter() - t0
        others = _others(cpu_before, own, seconds)
    finally:
        stop_processes([proc], timeout=60)
        for key in coordinator.connection.scan_iter(f"*{prefix}*"):
            coordinator.connection.delete(key)
    curve = next((json.loads(line) for line in log_path.read_text().splitlines()
                  if '"engine.cost_curve"' in line), {})
    return {"config": args, "seconds": round(seconds, 3), "curve": curve.get("source"),
            "curve_seconds": curve.get("seconds"), "load_before": round(load, 2),
            "others_cores": round(others, 2), "busy": others > BUSY_CORES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--config", action="append", help="worker options (repeatable)")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    configs = args.config or list(CONFIGS)
    runs: list[dict[str, Any]] = []
    with local_redis() as redis, tempfile.TemporaryDirectory(prefix="startup-") as tmp:
        logs = Path(tmp)
        for rep in range(args.reps):
            for config in configs:
                cache = logs / f"cache-{rep}-{configs.index(config)}"
                for state in ("empty", "warm"):  # the first start fills the cache
                    run = {**start_once(redis, config, cache, args.threads, logs),
                           "cache": state, "round": rep}
                    runs.append(run)
                    print(json.dumps(run), file=sys.stderr, flush=True)
    summary = []
    for config in configs:
        for state in ("empty", "warm"):
            mine = [r["seconds"] for r in runs if r["config"] == config and r["cache"] == state]
            summary.append({"config": config, "cache": state,
                            "median_seconds": round(statistics.median(mine), 2),
                            "max_seconds": max(mine),
                            "busy_starts": sum(r["busy"] for r in runs if r["config"] == config
                                               and r["cache"] == state)})
    print(json.dumps({"runs": runs, "summary": summary}, indent=1))
    if args.markdown:
        print("\n| worker options | cost cache | median s | max s | busy starts |")
        print("|---|---|---:|---:|---:|")
        for row in summary:
            print(f"| `{row['config']}` | {row['cache']} | {row['median_seconds']} | "
                  f"{row['max_seconds']} | {row['busy_starts']} |")


if __name__ == "__main__":
    main()
