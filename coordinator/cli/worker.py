"""``specfleet worker``: serve one model on one device from the Redis queues until SIGTERM."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer
from pydantic import ValidationError
from redis import RedisError

from coordinator.cli import options as opt
from coordinator.cli.app import app, environment_settings, fail, fail_redis
from shared.logs import configure_logging
from shared.outage import RedisOutage
from shared.protocol import CheckpointMode, SpecMethod, SpecSettings, describe_validation_error
from shared.redact import RedisURL
from shared.settings import REDIS_URL_VARIABLES
from worker.fitter import DEFAULT_CTX_MIN, DEFAULT_FIT_TARGET_MIB, FitError
from worker.fitter.fit import parse_slots
from worker.service.runner import serve
from worker.service.startup import WorkerOptions


@app.command()
def worker(
    model: Annotated[Path, typer.Option(help="GGUF model file")],
    model_name: Annotated[str | None, typer.Option(help="name clients submit to "
                                                   "(default: the file name without .gguf)")]
    = None,
    device: Annotated[str, typer.Option(help="cpu or cuda:N (pinned before llama.cpp loads)")]
    = "cpu",
    budget_mib: Annotated[float | None, typer.Option(help="memory to fit into, MiB "
                                                     "(default: the device's free memory)")]
    = None,
    fit_target_mib: Annotated[float, typer.Option(help="margin the fitter leaves free, MiB")]
    = DEFAULT_FIT_TARGET_MIB,
    ctx_min: Annotated[int, typer.Option(min=1, help="refuse to start with less context")]
    = DEFAULT_CTX_MIN,
    redis: Annotated[str | None, typer.Option(
        help="Redis URL", envvar=list(REDIS_URL_VARIABLES))] = None,
    name: Annotated[str | None, typer.Option(help="worker name (default: host-device-pid)")]
    = None,
    ctx: opt.FixedCtx = None,
    allow_ctx_above_train: opt.AllowCtxAboveTrain = False,
    spec: Annotated[SpecMethod, typer.Option(help="drafting method capacity")] = SpecMethod.AUTO,
    draft_max: Annotated[int, typer.Option(help="draft width ceiling N")] = 8,
    rollback_depth: Annotated[int | None, typer.Option(help="direct rollback depth D")] = None,
    checkpoint: Annotated[CheckpointMode, typer.Option(help="compact-rollback checkpoint storage")]
    = CheckpointMode.DEVICE,
    threads: Annotated[int, typer.Option(min=1, help="CPU threads")] = 2,
    slots: opt.Slots = "1",
    metrics_port: Annotated[int | None, typer.Option(min=0, max=65535, help="serve Prometheus "
                                                     "/metrics on this port (0: a free one, "
                                                     "published in the registration)")] = None,
) -> None:
    """Run a resident-model worker: fit, load once, register, take jobs, heartbeat.

    The fitter measures the model and picks the largest context that fits the device (or
    ``--budget-mib``), or checks a fixed ``--ctx`` against the same measurement; either way
    checkpoint memory is reserved before taking work.
    """
    settings = environment_settings()
    if redis is not None:
        settings = settings.model_copy(update={"redis_url": RedisURL(redis)})
    configure_logging(settings.log_level, settings.log_format)
    if not model.is_file():
        fail(f"model file not found: {model}")
    try:
        spec_settings = SpecSettings(method=spec, draft_max=draft_max,
                                     rollback_depth=rollback_depth)
    except ValidationError as exc:
        fail(describe_validation_error(exc))
    options = WorkerOptions(
        model_path=str(model), model_name=model_name or model.name.removesuffix(".gguf"),
        device=device, name=name, n_ctx=ctx, allow_ctx_above_train=allow_ctx_above_train,
        budget_mib=budget_mib,
        fit_target_mib=fit_target_mib, ctx_min=ctx_min, threads=threads, spec=spec_settings,
        checkpoint=checkpoint, metrics_port=metrics_port, slots=_slots(slots))
    try:
        serve(options, settings)
    except (RedisError, RedisOutage) as exc:
        fail_redis(settings, exc)
    except (FitError, RuntimeError, ValueError) as exc:
        fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)


def _slots(text: str) -> int | Literal["auto"]:
    try:
        return parse_slots(text)
    except FitError as exc:
        fail(str(exc))
