"""``make demo``: the whole product on one machine, start to finish, then a clean shutdown.

Finds or starts a Redis, starts one worker process on the embedded default model (Gemma 3
270M Q4_K_M from the ``demo`` extra), submits a small batch through the coordinator, streams
each job's tokens to the terminal as they are decoded, prints the speculative telemetry, writes
the batch results as JSONL and stops the worker with SIGTERM. Exits non-zero on any failure.
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
from pathlib import Path

from rich.console import Console
from rich.table import Table

from coordinator.client import Coordinator, JobResult
from coordinator.redis_local import RedisUnavailable, local_redis
from shared.protocol import FinalEvent, GenerationRequest, SpecSettings, TokenEvent
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


def _batch() -> list[GenerationRequest]:
    spec = SpecSettings(method="auto", draft_max=16, adaptive=True)
    return [GenerationRequest(model=MODEL_NAME, prompt=prompt, max_tokens=n, custom_id=cid,
                              speculative=spec) for cid, prompt, n in PROMPTS]


def _start_worker(model: Path, env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "coordinator.cli", "worker", "--model", str(model),
           "--model-name", MODEL_NAME, "--device", "cpu", "--draft-max", "16",
           "--threads", str(min(4, os.cpu_count() or 2)), "--name", "demo-worker-0"]
    with log_path.open("wb") as log:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


def _wait_registered(coordinator: Coordinator, proc: subprocess.Popen[bytes],
                     console: Console, log_path: Path) -> None:
    deadline = time.monotonic() + REGISTER_TIMEOUT_S
    with console.status("worker: fitting memory and loading Gemma 3 270M ..."):
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


def _stream(coordinator: Coordinator, requests: list[GenerationRequest],
            console: Console) -> list[JobResult]:
    handles = [coordinator.submit(r) for r in requests]
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


def run(console: Console) -> int:
    """Run the demo; returns the process exit code."""
    model = gemma_q4_path()
    workdir = Path(tempfile.mkdtemp(prefix="specfleet-demo-"))
    log_path = workdir / "worker.log"
    with local_redis() as url:
        prefix = f"specfleet-demo-{uuid.uuid4().hex[:8]}"
        env = {**os.environ, "REDIS_URL": url, "SPECFLEET_PREFIX": prefix}
        settings = Settings(redis_url=url, prefix=prefix)
        coordinator = Coordinator(settings)
        console.print(f"redis {url}  namespace {prefix}\nmodel {model}\n"
                      f"worker log (structured JSON) {log_path}")
        proc = _start_worker(model, env, log_path)
        try:
            _wait_registered(coordinator, proc, console, log_path)
            requests = _batch()
            results = _stream(coordinator, requests, console)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            for key in coordinator.connection.scan_iter(f"*{prefix}*"):
                coordinator.connection.delete(key)
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
