"""How much Redis memory does a job, a token chunk and a batch line cost? (sizing ``maxmemory``)

A real ``specfleet worker`` on the project's tiny dense model serves real jobs of several
lengths and a real batch (``specfleet batch submit --wait``), with the deployment's default
stream settings (``SPECFLEET_TOKEN_CHUNK`` 8, flushes of 50 ms); then ``MEMORY USAGE`` (every
element counted: ``SAMPLES 0``) of every key each left behind is summed by what the key is.
Per token chunk is the slope of a job's event stream against its entries, between the
shortest and the longest job; per batch line, the batch's own keys (the batch hash, its
results and jobs hashes, the uploaded file) over its lines, on top of each line's job.

    ./.venv/bin/python bench/redis_memory.py [--lines N] [--tokens 16,256,960]

Uses ``REDIS_URL`` (or 127.0.0.1:6379, or a private server) under a fresh key prefix, which
it deletes afterwards; prints a table (bytes) and, with ``--json``, the same as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

from redis import Redis
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coordinator.client import Coordinator  # noqa: E402
from coordinator.processes import stop_processes  # noqa: E402
from coordinator.redis_local import local_redis  # noqa: E402
from shared.settings import Settings  # noqa: E402
from worker.testmodels import build_tiny_models  # noqa: E402

MODEL = "tiny"
PROMPT = [4, 2, 4, 2, 7, 1, 8, 3]
BIN = Path(sys.executable).parent
#: An execution's (or any other) 32-hex-digit id inside a key name.
_HEX = re.compile(r"[0-9a-f]{32}")


def _usage(conn: Redis, key: bytes) -> int:
    return int(conn.memory_usage(key, samples=0) or 0)


def _job_keys(conn: Redis, job_id: str) -> dict[str, int]:
    """Bytes of every key a job left, by what the key is (the prefix and ids left out)."""
    found: dict[str, int] = defaultdict(int)
    for key in conn.scan_iter(f"*{job_id}*", count=1000):
        kind = _HEX.sub("X", key.decode().replace(job_id, "ID")).split(":", 1)[1]
        found[kind] += _usage(conn, key)
    return dict(found)


def _recorded(conn: Redis, job_id: str) -> None:
    """Wait until rq's records of the run are written too (just after the final event)."""
    deadline = time.monotonic() + 30
    while Job.fetch(job_id, connection=conn, serializer=JSONSerializer).get_status() \
            is not JobStatus.FINISHED:
        if time.monotonic() > deadline:
            raise SystemExit(f"bench: rq never recorded job {job_id} finished")
        time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=200, help="lines of the batch")
    parser.add_argument("--tokens", default="16,256,960",
                        help="max_tokens of the single jobs (comma-separated)")
    parser.add_argument("--json", action="store_true", help="also print the figures as JSON")
    args = parser.parse_args()
    lengths = [int(t) for t in args.tokens.split(",")]
    with tempfile.TemporaryDirectory() as tmp, local_redis() as url:
        models = build_tiny_models(Path(tmp))
        settings = Settings(redis_url=url, prefix=f"bench{uuid.uuid4().hex[:10]}")
        env = {**os.environ, "REDIS_URL": url, "SPECFLEET_PREFIX": settings.prefix,
               "CUDA_VISIBLE_DEVICES": ""}
        worker = subprocess.Popen(
            [str(BIN / "specfleet"), "worker", "--model", str(models.dense), "--model-name",
             MODEL, "--ctx", "1024", "--threads", "1", "--name", "bench-w"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        conn = Redis.from_url(url)
        try:
            coordinator = Coordinator(settings)
            while not coordinator.registry.live_workers(MODEL):
                if worker.poll() is not None:
                    raise SystemExit("bench: the worker exited during start-up")
                time.sleep(0.1)
            figures = _measure(conn, coordinator, env, Path(tmp), lengths, args.lines)
        finally:
            stop_processes([worker])
            keys = list(conn.scan_iter(f"*{settings.prefix}*", count=1000))
            if keys:
                conn.delete(*keys)
    _print(figures)
    if args.json:
        print(json.dumps(figures))


def _measure(conn: Redis, coordinator: Coordinator, env: dict[str, str], tmp: Path,
             lengths: list[int], lines: int) -> dict[str, object]:
    jobs: list[dict[str, Any]] = []
    for n in lengths:
        handle = coordinator.submit({"model": MODEL, "prompt_tokens": PROMPT, "max_tokens": n,
                                     "speculative": {"method": "none"}})
        result = handle.result(timeout=300)
        _recorded(conn, handle.job_id)
        stream = coordinator.keys.events(handle.job_id)
        jobs.append({"max_tokens": n, "tokens": len(result.tokens),
                     "stream_entries": int(conn.xlen(stream)),
                     "keys": _job_keys(conn, handle.job_id)})
    short, long = jobs[0], jobs[-1]
    stream_kind = "job:ID:events"
    per_entry = ((long["keys"][stream_kind] - short["keys"][stream_kind])
                 / max(1, long["stream_entries"] - short["stream_entries"]))
    source = tmp / "batch.jsonl"
    source.write_text("".join(json.dumps({"custom_id": f"line-{i}", "body": {
        "model": MODEL, "prompt_tokens": PROMPT, "max_tokens": 16,
        "speculative": {"method": "none"}}}) + "\n" for i in range(lines)))
    proc = subprocess.run([str(BIN / "specfleet"), "batch", "submit", str(source), "--model",
                           MODEL, "--wait"], env=env, capture_output=True, text=True,
                          timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"bench: the batch failed: {proc.stderr[-2000:]}")
    batch = json.loads(proc.stdout.splitlines()[-1])
    batch_keys: dict[str, int] = defaultdict(int)
    for key in conn.scan_iter(f"*{batch['id']}*", count=1000):
        batch_keys[key.decode().replace(batch["id"], "ID").split(":", 1)[1]] += _usage(conn, key)
    file_id = batch["input_file_id"]
    batch_keys["file:ID"] = sum(_usage(conn, k) for k in conn.scan_iter(f"*{file_id}*"))
    line_job = _job_keys(conn, _first_line_job(conn, coordinator, batch["id"]))
    return {"jobs": jobs, "bytes_per_stream_entry": round(per_entry),
            "batch": {"lines": lines, "keys": dict(batch_keys),
                      "bytes_per_line": round(sum(batch_keys.values()) / lines),
                      "line_job_keys": line_job,
                      "bytes_per_line_with_its_job": round(sum(batch_keys.values()) / lines
                                                           + sum(line_job.values()))}}


def _first_line_job(conn: Redis, coordinator: Coordinator, batch_id: str) -> str:
    """The job id of one of the batch's lines (its jobs hash: line -> job id)."""
    for raw in conn.hvals(coordinator.keys.batch_jobs(batch_id)):
        record = json.loads(raw)
        if isinstance(record, dict) and record.get("job_id"):
            return str(record["job_id"])
    raise SystemExit("bench: the batch recorded no job ids")


def _print(f: dict[str, object]) -> None:
    jobs = f["jobs"]
    assert isinstance(jobs, list)
    kinds = sorted({k for j in jobs for k in j["keys"]})
    print(f"{'job (max_tokens / tokens / stream entries)':44}" + "".join(f"{k:>22}"
                                                                        for k in kinds)
          + f"{'total':>10}")
    for j in jobs:
        label = f"{j['max_tokens']} / {j['tokens']} / {j['stream_entries']}"
        print(f"{label:44}" + "".join(f"{j['keys'].get(k, 0):>22}" for k in kinds)
              + f"{sum(j['keys'].values()):>10}")
    print(f"bytes per stream entry (token chunk of 8): {f['bytes_per_stream_entry']}")
    batch = f["batch"]
    assert isinstance(batch, dict)
    print(f"batch of {batch['lines']} lines: " + ", ".join(
        f"{k} {v}" for k, v in sorted(batch["keys"].items())))
    print(f"bytes per batch line: {batch['bytes_per_line']} (batch keys), "
          f"{batch['bytes_per_line_with_its_job']} with its job's keys "
          f"({sum(batch['line_job_keys'].values())})")


if __name__ == "__main__":
    main()
