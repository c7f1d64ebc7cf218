"""``specfleet worker``: serve one model on one device, or a device group, from the Redis queues
until SIGTERM."""

from __future__ import annotations

import os
from typing import Annotated, Literal

import typer
from redis import RedisError

from coordinator.cli import options as opt
from coordinator.cli.app import app, environment_settings, fail, fail_redis
from shared.logs import configure_logging
from shared.outage import RedisOutage
from shared.protocol import CheckpointMode
from shared.redact import RedisURL
from worker.launch import (
    DEFAULT_CHECKPOINTS,
    DEFAULT_CTX_MIN,
    DEFAULT_FIT_TARGET_MIB,
    DETERMINISTIC_CPU_ONLY,
    EngineCapacity,
    WorkerOptions,
    parse_device_group,
    parse_mib_list,
    parse_slots,
    pin_device,
)
from worker.threads import OMP_WAIT_POLICY, ThreadWait, apply_wait, choose_wait, usable_cores


@app.command()
@opt.drafting_options("load")
def worker(
    model: opt.ModelFile,
    model_name: Annotated[str | None, typer.Option(help="name clients submit to "
                                                   "(default: the file name without .gguf)")]
    = None,
    device: opt.Device = "cpu",
    rpc: opt.Rpc = None,
    split_mode: opt.SplitModeOption = "layer",
    tensor_split: opt.TensorSplit = None,
    budget_mib: opt.BudgetMib = None,
    fit_target_mib: opt.FitTargetMib = f"{DEFAULT_FIT_TARGET_MIB:g}",
    ctx_min: opt.CtxMin = DEFAULT_CTX_MIN,
    redis: opt.RedisUrl = None,
    name: Annotated[str | None, typer.Option(help="worker name (default: host-device-pid)")]
    = None,
    ctx: opt.FixedCtx = None,
    allow_ctx_above_train: opt.AllowCtxAboveTrain = False,
    checkpoint: opt.Checkpoint = CheckpointMode.DEVICE,
    threads: opt.Threads = opt.DEFAULT_THREADS,
    slots: opt.Slots = "1",
    prefix_cache: opt.PrefixCache = "on",
    prefix_checkpoints: opt.PrefixCheckpoints = DEFAULT_CHECKPOINTS,
    metrics_port: Annotated[int | None, typer.Option(min=0, max=65535, help="serve Prometheus "
                                                     "/metrics on this port (0: a free one, "
                                                     "published in the registration)")] = None,
    deterministic: Annotated[bool, typer.Option(
        "--deterministic", help="greedy output independent of batch width, slots, draft "
        "length and worker (CPU only; slower: docs/engine.md, 'Deterministic mode')")] = False,
    device_verify: Annotated[str, typer.Option(
        "--device-verify", help="'on': greedy verify rows reduced to their top two on the "
        "device, no logits row read by Python; 'off': every row read; 'auto': on where the "
        "layers run on a GPU (docs/engine.md, 'Verify on the device')")] = "auto",
    verify_buckets: Annotated[str, typer.Option(
        "--verify-buckets", help="'on': steps that verify drafts padded to a few row counts "
        "so a GPU replays their decode graphs, drafts priced at them; 'off': rows as drafted; "
        "'auto': on where the layers run on a GPU (docs/engine.md, 'Replayable shapes')")]
    = "auto",
    embeddings: Annotated[int, typer.Option(
        "--embeddings", min=0, metavar="TOKENS", help="serve embeddings (/v1/embeddings) "
        "from an embedding context of TOKENS (rounded up to a multiple of 64) beside the "
        "target: the longest input, and what one embedding decode pools; fitted with the "
        "rest (docs/http.md, 'Embeddings'); 0: none")] = 0,
    *,
    drafting: opt.Drafting,
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
        group = parse_device_group(device, rpc, split_mode, tensor_split)
        budgets = parse_mib_list("--budget-mib", budget_mib, group) if budget_mib else None
        targets = parse_mib_list("--fit-target-mib", fit_target_mib, group)
    except ValueError as exc:
        fail(str(exc))
    if deterministic and group.offload:
        fail(DETERMINISTIC_CPU_ONLY + " (without --rpc)" if group.host_is_device
             else DETERMINISTIC_CPU_ONLY)
    try:
        capacity = EngineCapacity(**drafting.capacity())
    except ValueError as exc:
        fail(str(exc))
    options = WorkerOptions(
        model_path=str(model), model_name=model_name or model.name.removesuffix(".gguf"),
        device=group, name=name, n_ctx=ctx, allow_ctx_above_train=allow_ctx_above_train,
        budget_mib=budgets,
        fit_target_mib=targets, ctx_min=ctx_min, threads=threads, capacity=capacity,
        checkpoint=checkpoint, metrics_port=metrics_port, slots=_slots(slots),
        prefix_cache=_on_off("--prefix-cache", prefix_cache),
        prefix_checkpoints=prefix_checkpoints, deterministic=deterministic,
        device_verify=_on_off_auto("--device-verify", device_verify),
        verify_buckets=_on_off_auto("--verify-buckets", verify_buckets),
        embedding_tokens=embeddings)
    # Pinned before the serving code is imported: it loads llama.cpp, which reads the
    # visible devices once (docs/architecture.md, "Processes").
    n_gpu_layers = pin_device(group)
    # ... and so is the threads' wait policy (libgomp reads it as llama.cpp loads).
    apply_wait(choose_wait(ThreadWait(settings.thread_wait), threads, usable_cores(),
                           os.environ.get(OMP_WAIT_POLICY)))
    from worker.fitter import FitError  # noqa: PLC0415
    from worker.service.runner import serve  # noqa: PLC0415

    try:
        serve(options, settings, group, n_gpu_layers)
    except (RedisError, RedisOutage) as exc:
        fail_redis(settings, exc)
    except (FitError, RuntimeError, ValueError) as exc:
        fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)


def _on_off(flag: str, text: str) -> bool:
    if text not in ("on", "off"):
        fail(f"{flag} takes 'on' or 'off', got {text!r}")
    return text == "on"


def _on_off_auto(flag: str, text: str) -> bool | None:
    """``auto`` is None: the engine's plan decides from where the layers run."""
    if text not in ("on", "off", "auto"):
        fail(f"{flag} takes 'on', 'off' or 'auto', got {text!r}")
    return None if text == "auto" else text == "on"


def _slots(text: str) -> int | Literal["auto"]:
    try:
        return parse_slots(text)
    except ValueError as exc:
        fail(str(exc))
