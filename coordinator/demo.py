"""``make demo``: the whole product on one machine, start to finish, then a clean shutdown.

Finds or starts a Redis, starts one worker process on the embedded default model (Gemma 3
270M Q4_K_M from the ``demo`` extra), submits a small batch through the coordinator, streams
each job's tokens to the terminal as they are decoded, prints the speculative telemetry, writes
the batch results as JSONL and stops the worker with SIGTERM. Exits non-zero on any failure.
Whatever happened, it deletes every Redis key it created (its jobs, results, queues and
namespace), so a shared Redis is left as the demo found it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import suppress
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.queue import Queue
from rq.results import Result
from rq.serializers import JSONSerializer

from coordinator.client import Coordinator
from coordinator.processes import stop_processes
from coordinator.redis_local import RedisUnavailable, local_redis
from shared.protocol import FinalEvent, GenerationRequest, SpecMethod, SpecSettings, TokenEvent
from shared.redact import redact
from shared.results import JobResult
from shared.settings import Settings
from worker.testmodels.gemma import gemma_q4_path

MODEL_NAME = "gemma3-270m"
REGISTER_TIMEOUT_S = 300.0
CODE_BLOCK = '''def moving_average(values, window):
    """Average of each window of consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    for i in range(len(values) - window + 1):
        chunk = values[i:i + window]
        out.append(sum(chunk) / window)
    return out
'''
PROMPTS: list[tuple[str, str, int]] = [
    ("rename", "Rewrite this Python function, renaming `values` to `samples` and changing "
               f"nothing else:\n\n```python\n{CODE_BLOCK}```\n\n```python\n", 120),
    ("prose", "Lighthouses were first built on rocky coasts because", 80),
    ("list", "The planets of the solar system, in order from the Sun:\n1. Mercury\n", 40),
]


def _batch(prompts: list[tuple[str, str, int]]) -> list[GenerationRequest]:
    spec = SpecSettings(method=SpecMethod.AUTO, draft_max=16, adaptive=True)
    return [GenerationRequest(model=MODEL_NAME, prompt=prompt, max_tokens=n, custom_id=cid,
                              speculative=spec) for cid, prompt, n in prompts]


def _start_worker(model: Path, env: dict[str, str], log_path: Path,
                  prefix: str) -> subprocess.Popen[bytes]:
    # Named inside the demo's namespace, so rq's worker keys are cleaned up with it.
    cmd = [sys.executable, "-m", "coordinator.cli", "worker", "--model", str(model),
           "--model-name", MODEL_NAME, "--device", "cpu", "--draft-max", "16",
           "--threads", str(min(4, os.cpu_count() or 2)), "--name", f"{prefix}-worker-0"]
    with log_path.open("wb") as log:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


def _wait_registered(coordinator: Coordinator, proc: subprocess.Popen[bytes],
                     console: Console, log_path: Path) -> None:
    deadline = time.monotonic() + REGISTER_TIMEOUT_S
    with console.status("worker: fitting memory and loading the model ..."):
        while not coordinator.registry.live_workers(MODEL_NAME):
            if proc.poll() is not None:
                tail = log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"the worker exited with code {proc.returncode}:\n{tail}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the worker did not register in {REGISTER_TIMEOUT_S:.0f} s")
            time.sleep(0.2)
    info = coordinator.registry.live_workers(MODEL_NAME)[0]
    console.print(f"[green]worker {info.name}[/] ready: device {info.device}, "
                  f"fitted context {info.n_ctx} tokens")


def _stream(coordinator: Coordinator, requests: list[GenerationRequest], console: Console,
            submitted: list[str]) -> list[JobResult]:
    """Submit the batch (recording each job id in ``submitted`` for the clean-up, even if a
    later step fails) and stream every job's tokens in turn."""
    handles = []
    for request in requests:
        handles.append(coordinator.submit(request))
        submitted.append(handles[-1].job_id)
    console.print(f"submitted a batch of {len(handles)} requests to queue "
                  f"[bold]{coordinator.keys.queue(MODEL_NAME)}[/]\n")
    results = []
    for request, handle in zip(requests, handles, strict=True):
        console.rule(f"{request.custom_id}  (job {handle.job_id[:8]})")
        for event in handle.stream(timeout=600):
            if isinstance(event, TokenEvent):
                console.out(event.text, end="", highlight=False)
            elif isinstance(event, FinalEvent):
                result = JobResult.from_final(event)
        console.out("")
        if (t := result.telemetry) is not None:
            console.print(f"[dim]{t.spec_method}: {t.accepted}/{t.drafted} drafts accepted "
                          f"({t.acceptance:.1%}), {t.tokens_per_verify:.2f} tokens per verify "
                          f"decode, {t.effective_tokens_per_second:.1f} tok/s effective[/]")
        results.append(result)
    return results


def _telemetry_table(requests: list[GenerationRequest], results: list[JobResult]) -> Table:
    table = Table(title="speculative telemetry per job")
    for col in ("request", "status", "tokens", "accepted", "tok/verify", "tok/s", "eff. tok/s"):
        table.add_column(col, justify="right")
    for req, r in zip(requests, results, strict=True):
        t = r.telemetry
        if t is None:
            table.add_row(req.custom_id, str(r.status), *["-"] * 5)
            continue
        table.add_row(req.custom_id, str(r.status), str(t.generated_tokens),
                      f"{t.accepted}/{t.drafted} ({t.acceptance:.0%})",
                      f"{t.tokens_per_verify:.2f}", f"{t.tokens_per_second:.1f}",
                      f"{t.effective_tokens_per_second:.1f}")
    return table


def _clean_up(coordinator: Coordinator, job_ids: list[str]) -> None:
    """Leave Redis as the demo found it, through rq's own deletions: each job's hash and its
    results (``rq:job:*``, ``rq:results:*``, kept for the result TTL otherwise), the queues
    and their ``rq:queues`` entries (kept forever otherwise), then the demo's namespace
    (event streams, registry, rq's per-queue registries and its worker's keys)."""
    conn = coordinator.connection
    for job_id in job_ids:
        conn.delete(Result.get_key(job_id))
        with suppress(NoSuchJobError):  # its TTL already removed it
            Job.fetch(job_id, connection=conn, serializer=JSONSerializer).delete()
    for queue in Queue.all(connection=conn, serializer=JSONSerializer):
        if queue.name.startswith(f"{coordinator.settings.prefix}:"):  # every tier, priority
            queue.delete(delete_jobs=True)
    for key in conn.scan_iter(f"*{coordinator.settings.prefix}*"):
        conn.delete(key)


def run(console: Console, model: Path | None = None,
        prompts: list[tuple[str, str, int]] = PROMPTS, workdir: Path | None = None,
        prefix: str | None = None) -> int:
    """Run the demo; returns the process exit code.

    The defaults are ``make demo``'s (Gemma, the three prompts, a fresh temporary directory
    and namespace); tests run the same demo on a tiny model and short prompts.
    """
    model = model or gemma_q4_path()
    workdir = workdir or Path(tempfile.mkdtemp(prefix="specfleet-demo-"))
    log_path = workdir / "worker.log"
    prefix = prefix or f"specfleet-demo-{uuid.uuid4().hex[:8]}"
    with local_redis() as url:
        env = {**os.environ, "REDIS_URL": url, "SPECFLEET_PREFIX": prefix}
        settings = Settings(redis_url=url, prefix=prefix)
        coordinator = Coordinator(settings)
        console.print(f"redis {redact(url)}  namespace {prefix}\nmodel {model}\n"
                      f"worker log (structured JSON) {log_path}")
        proc = _start_worker(model, env, log_path, prefix)
        submitted: list[str] = []
        try:
            _wait_registered(coordinator, proc, console, log_path)
            requests = _batch(prompts)
            results = _stream(coordinator, requests, console, submitted)
        finally:
            stop_processes([proc], timeout=60)
            _clean_up(coordinator, submitted)
    console.print(_telemetry_table(requests, results))
    out = workdir / "results.jsonl"
    out.write_text("".join(json.dumps({"custom_id": req.custom_id, **r.to_json()}) + "\n"
                           for req, r in zip(requests, results, strict=True)))
    console.print(f"batch results: {out}\nworker stopped (exit code {proc.returncode})")
    failed = [r for r in results if str(r.status) != "finished"]
    return 1 if failed or proc.returncode not in (0, -signal.SIGTERM) else 0


def main() -> None:
    console = Console()
    try:
        code = run(console)
    except (RedisUnavailable, RuntimeError, FileNotFoundError) as exc:
        console.print(f"[red]demo failed:[/] {exc}")
        code = 1
    sys.exit(code)


if __name__ == "__main__":
    main()
