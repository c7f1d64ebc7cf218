"""``specfleet cancel``: stop a job (withdrawn if queued; stops within one step if running)."""

from __future__ import annotations

from typing import Annotated

import typer
from redis import RedisError

from coordinator.cli.app import app, environment_settings, fail, fail_redis
from coordinator.client import Coordinator
from shared.logs import configure_logging


@app.command()
def cancel(job_id: Annotated[str, typer.Argument(help="id printed by submit")]) -> None:
    """Cancel one job."""
    settings = environment_settings()
    configure_logging(settings.log_level, settings.log_format)
    try:
        withdrawn = Coordinator(settings).cancel(job_id)
    except (LookupError, ValueError) as exc:
        fail(str(exc), code=1)
    except RedisError as exc:
        fail_redis(settings, exc)
    print(f"{job_id}: " + ("withdrawn from its queue" if withdrawn
                           else "cancel requested (a running job stops within one step)"))
