"""``specfleet fit``: measure a model on a device and print the context a worker would fit.

Operators run it before starting a worker (what context does this card give me, what does
compact rollback save); scripts use ``--json``. An impossible fit exits non-zero with the
reason and the breakdown on stderr.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError
from rich.console import Console

from coordinator.cli import options as opt
from coordinator.cli.app import app, fail
from shared.logs import configure_logging
from shared.protocol import CheckpointMode, SpecMethod, SpecSettings, describe_validation_error
from worker.fitter import DEFAULT_CTX_MIN, DEFAULT_FIT_TARGET_MIB, FitError, fit_worker
from worker.fitter.fit import parse_slots
from worker.fitter.report import render_table
from worker.llm import LlamaError


@app.command()
def fit(
    model: Annotated[Path, typer.Option(help="GGUF model file")],
    device: Annotated[str, typer.Option(help="cpu or cuda:N")] = "cpu",
    budget_mib: Annotated[float | None, typer.Option(
        help="memory to fit into, overriding what the device reports")] = None,
    fit_target_mib: Annotated[float, typer.Option(
        help="margin left free on the device")] = DEFAULT_FIT_TARGET_MIB,
    slots: opt.Slots = "1",
    spec: Annotated[SpecMethod, typer.Option(help="drafting method")] = SpecMethod.AUTO,
    draft_max: Annotated[int, typer.Option(help="draft width ceiling N")] = 8,
    rollback_depth: Annotated[int | None, typer.Option(help="direct rollback depth D")] = None,
    checkpoint: Annotated[CheckpointMode, typer.Option(help="compact-rollback checkpoint storage")]
    = CheckpointMode.DEVICE,
    ctx_min: Annotated[int, typer.Option(min=1, help="refuse to fit less context")]
    = DEFAULT_CTX_MIN,
    ctx: opt.FixedCtx = None,
    allow_ctx_above_train: opt.AllowCtxAboveTrain = False,
    threads: Annotated[int, typer.Option(min=1, help="CPU threads")] = 2,
    as_json: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
) -> None:
    """Fit the largest context for MODEL on DEVICE and print the measured breakdown.

    With ``--ctx`` it checks that fixed context instead, exactly as ``specfleet worker --ctx``
    will at start-up."""
    configure_logging(level="warning")
    try:
        settings = SpecSettings(method=spec, draft_max=draft_max, rollback_depth=rollback_depth)
    except ValidationError as exc:
        fail(describe_validation_error(exc))
    try:
        result = fit_worker(str(model), device=device, budget_mib=budget_mib,
                            fit_target_mib=fit_target_mib, slots=parse_slots(slots),
                            spec=settings,
                            ctx_min=ctx_min, n_threads=threads, checkpoint=checkpoint,
                            n_ctx=ctx, allow_ctx_above_train=allow_ctx_above_train)
    except (FitError, LlamaError, ValueError) as exc:
        fail(str(exc))
    if as_json:
        print(result.report.model_dump_json())
    else:
        Console(width=120).print(render_table(result.report))
