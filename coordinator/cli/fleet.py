"""``specfleet fleet``: the live workers, what they serve, and how much work is waiting."""

from __future__ import annotations

import json
import time
from typing import Annotated

import typer
from redis import RedisError
from rich.console import Console
from rich.table import Table

from coordinator.cli.app import app, environment_settings, fail_redis
from coordinator.client import Coordinator
from shared.logs import configure_logging


@app.command()
def fleet(
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
) -> None:
    """List live workers (model, device, fitted context, current job) and queue depths; first
    requeue the jobs of any worker that died (what live workers' heartbeats do, and with none
    alive nothing else does)."""
    settings = environment_settings()
    configure_logging(settings.log_level, settings.log_format)
    try:
        coordinator = Coordinator(settings)
        coordinator.recover()
        workers = coordinator.fleet()
        models = sorted({w.model_name for w in workers} | coordinator.known_models())
        queues = {m: coordinator.queue_depths(m) for m in models}
    except RedisError as exc:
        fail_redis(settings, exc)
    if as_json:
        print(json.dumps({"workers": [w.model_dump(mode="json") for w in workers],
                          "queues": queues}))
        return
    table = Table("worker", "model", "device", "ctx/slot", "busy", "spec", "jobs", "heartbeat")
    now = time.time()
    for w in workers:
        table.add_row(w.name, w.model_name, w.device, str(w.n_ctx),
                      f"{len(w.current_jobs)}/{w.slots}", ",".join(w.spec_methods),
                      ", ".join(w.current_jobs) or "-", f"{now - w.heartbeat_at:.1f}s ago")
    console = Console()
    console.print(table)
    templates = {m: sorted({w.chat_template_source or "none" for w in workers
                            if w.model_name == m}) for m in models}
    for model, depths in queues.items():
        waiting = {q: n for q, n in depths.items() if n}
        chat = f" (chat template: {', '.join(templates[model])})" if templates[model] else ""
        console.print(f"{model}: " + (", ".join(f"{q} {n} queued" for q, n in waiting.items())
                                      or "nothing queued") + chat)
