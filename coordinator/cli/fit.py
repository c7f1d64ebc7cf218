"""``specfleet fit``: measure a model on a device and print the context a worker would fit.

Operators run it before starting a worker (what context does this card give me, what does
compact rollback save, how does a group of devices share the model); scripts use ``--json``.
An impossible fit exits non-zero with the reason and the breakdown on stderr.
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console

from coordinator.cli import options as opt
from coordinator.cli.app import app, fail
from shared.logs import configure_logging
from shared.protocol import CheckpointMode
from worker.fitter import FitError, fit_worker
from worker.fitter.report import render_table
from worker.launch import (
    DEFAULT_CTX_MIN,
    DEFAULT_FIT_TARGET_MIB,
    EngineCapacity,
    parse_device_group,
    parse_mib_list,
    parse_slots,
)
from worker.llm import LlamaError


@app.command()
@opt.drafting_options("load")
def fit(
    model: opt.ModelFile,
    device: opt.Device = "cpu",
    rpc: opt.Rpc = None,
    split_mode: opt.SplitModeOption = "layer",
    tensor_split: opt.TensorSplit = None,
    budget_mib: opt.BudgetMib = None,
    fit_target_mib: opt.FitTargetMib = f"{DEFAULT_FIT_TARGET_MIB:g}",
    slots: opt.Slots = "1",
    checkpoint: opt.Checkpoint = CheckpointMode.DEVICE,
    ctx_min: opt.CtxMin = DEFAULT_CTX_MIN,
    ctx: opt.FixedCtx = None,
    allow_ctx_above_train: opt.AllowCtxAboveTrain = False,
    threads: opt.Threads = opt.DEFAULT_THREADS,
    as_json: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
    *,
    drafting: opt.Drafting,
) -> None:
    """Fit the largest context for MODEL on DEVICE and print the measured breakdown.

    With ``--ctx`` it checks that fixed context instead, exactly as ``specfleet worker --ctx``
    will at start-up. Over a device group (a ``--device`` list, ``--rpc``) every device is
    fitted and shown in its own column."""
    configure_logging(level="warning")
    try:
        group = parse_device_group(device, rpc, split_mode, tensor_split)
        capacity = EngineCapacity(**drafting.capacity())
        result = fit_worker(
            str(model), device=group,
            budget_mib=parse_mib_list("--budget-mib", budget_mib, group) if budget_mib else None,
            fit_target_mib=parse_mib_list("--fit-target-mib", fit_target_mib, group),
            slots=parse_slots(slots), capacity=capacity, ctx_min=ctx_min, n_threads=threads,
            checkpoint=checkpoint, n_ctx=ctx, allow_ctx_above_train=allow_ctx_above_train)
    except (FitError, LlamaError, ValueError) as exc:  # ValueError: N and D out of range
        fail(str(exc))
    if as_json:
        print(result.report.model_dump_json())
    else:
        # A column per device (RPC devices have long names): wider for a group.
        width = 120 + 26 * (len(result.report.devices) - 1)
        Console(width=width).print(render_table(result.report))
