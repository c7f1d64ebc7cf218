"""``specfleet top``: a live view of the fleet from Redis (``--once --json`` for scripts).

Per worker: device, model, busy/total slots, fitted context, tok/s, acceptance, replays/s,
host fallbacks, prefix-cache hit rate, current job and heartbeat age; per model and tier:
queue depth and how long the head of the queue has waited; and the workers declared lost
lately, from the fleet's event stream (whichever process swept them). Rates are the workers' own
lifetime telemetry (published with every heartbeat), per second of generation: see
coordinator/metrics.py.
"""

from __future__ import annotations

import json
import time
from typing import Annotated

import typer
from redis import RedisError
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from coordinator.cli.app import app, environment_settings, fail_redis
from coordinator.client import Coordinator
from coordinator.metrics import FleetSnapshot, fleet_snapshot
from shared.logs import configure_logging
from shared.outage import RedisOutage, ride_out


def render(snapshot: FleetSnapshot) -> Group:
    """The two tables of one snapshot."""
    workers = Table("worker", "model", "device", "slots", "ctx", "tok/s", "accept",
                    "replays/s", "fallbacks", "prefix hits", "job", "heartbeat",
                    title="workers")
    for w in snapshot.workers:
        workers.add_row(w.name, w.model, w.device, f"{w.busy_slots}/{w.slots}", str(w.n_ctx),
                        f"{w.tokens_per_second:.1f}", f"{w.acceptance:.3f}",
                        f"{w.replays_per_second:.2f}", str(w.host_fallbacks),
                        f"{w.prefix_hit_rate:.0%}", " ".join(w.current_jobs) or "-",
                        f"{w.heartbeat_age_seconds:.1f}s")
    queues = Table("model", "tier", "queued", "oldest wait", title="queues")
    for q in snapshot.queues:
        queues.add_row(q.model, q.tier, str(q.depth), f"{q.oldest_wait_seconds:.1f}s")
    if not snapshot.lost:
        return Group(workers, queues)
    lost = Table("worker", "model", "jobs held", "requeued", "found by", "at",
                 title="workers declared lost (newest first)")
    for row in snapshot.lost:
        lost.add_row(row.worker, row.model or "-", str(len(row.jobs)), str(len(row.requeued)),
                     row.by or "a client", row.timestamp)
    return Group(workers, queues, lost)


@app.command()
def top(
    once: Annotated[bool, typer.Option("--once", help="print one snapshot and exit")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="JSON (one object a snapshot)")]
    = False,
    interval: Annotated[float, typer.Option(min=0.1, help="seconds between refreshes")] = 2.0,
) -> None:
    """Watch the fleet: workers, their speed and speculation, queues and waiting times."""
    settings = environment_settings()
    configure_logging(settings.log_level, settings.log_format)
    coordinator = Coordinator(settings)

    def snap() -> FleetSnapshot:  # a Redis blip is waited out, the view carries on
        return ride_out(lambda: fleet_snapshot(coordinator), settings.redis_outage_seconds,
                        "top.snapshot")
    try:
        snapshot = snap()
        if as_json:
            while True:
                print(json.dumps(snapshot.to_json()), flush=True)
                if once:
                    return
                time.sleep(interval)
                snapshot = snap()
        if once:
            # Piped output has no terminal width: do not squeeze names into 80 columns.
            console = Console()
            Console(width=None if console.is_terminal else 160).print(render(snapshot))
            return
        with Live(render(snapshot), auto_refresh=False) as live:
            while True:
                time.sleep(interval)
                live.update(render(snap()), refresh=True)
    except (RedisError, RedisOutage) as exc:
        fail_redis(settings, exc)
    except KeyboardInterrupt:
        return
