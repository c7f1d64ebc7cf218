"""Worker start-up before any job: pin the device, fit (or check) the context, load, reserve.

Kept apart from the serving loop (``loop.py``) because it is the part that decides what a
worker *can* do (its capacity); the loop only decides what it does next. Start-up order
matters: the device is pinned (``CUDA_VISIBLE_DEVICES``) before llama.cpp loads, and checkpoint
memory is reserved before any request can take the headroom.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field, replace
from typing import Literal

from shared.protocol import CheckpointMode, FitReport
from shared.settings import Settings
from worker.engine.config import EngineCapacity
from worker.engine.engine import SpeculativeEngine
from worker.engine.prefix_cache import DEFAULT_CHECKPOINTS
from worker.fitter import DEFAULT_CTX_MIN, DEFAULT_FIT_TARGET_MIB, fit_worker, reserve_checkpoints
from worker.fitter.devices import DeviceRef


@dataclass(frozen=True)
class WorkerOptions:
    """What ``specfleet worker`` was asked to serve, and how."""

    model_path: str
    model_name: str
    device: str = "cpu"
    name: str | None = None
    n_ctx: int | None = None  # None: fit the context to the device's memory
    allow_ctx_above_train: bool = False  # a fixed n_ctx beyond the model's training context
    budget_mib: float | None = None
    fit_target_mib: float = DEFAULT_FIT_TARGET_MIB
    ctx_min: int = DEFAULT_CTX_MIN
    threads: int = 2
    #: What the engine loads for (method, N, D); every request says its own drafter knobs.
    capacity: EngineCapacity = field(default_factory=EngineCapacity)
    checkpoint: CheckpointMode = CheckpointMode.DEVICE
    metrics_port: int | None = None  # Prometheus /metrics port; 0 = a free one; None = off
    slots: int | Literal["auto"] = 1  # sequences served at once; auto = most that fit ctx_min
    #: Reuse prompt prefixes across requests, with this many prefix checkpoints per slot
    #: where the model's state cannot be trimmed (worker/engine/prefix_cache.py).
    prefix_cache: bool = True
    prefix_checkpoints: int = DEFAULT_CHECKPOINTS
    #: Width-invariant greedy decoding (EngineConfig.deterministic); CPU only.
    deterministic: bool = False


def pin_device(device: DeviceRef) -> int:
    """Make ``device`` the only one llama.cpp can see; returns the GPU layer count to use.

    Must run before llama.cpp initialises its backends (``serve`` re-executes the process
    when llama.cpp was already imported with another device visible).
    """
    # CUDA numbers GPUs fastest-first unless told otherwise; NVML (which the fitter measures
    # through) numbers them by PCI bus: make cuda:N the same GPU for both.
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    os.environ["CUDA_VISIBLE_DEVICES"] = str(device.index) if device.is_cuda else ""
    return -1 if device.is_cuda else 0


def reexec_if_pinned_too_late(device: DeviceRef) -> None:
    """llama.cpp reads CUDA_VISIBLE_DEVICES when it loads: restart the process if too late."""
    wanted = str(device.index) if device.is_cuda else ""
    if "llama_cpp" in sys.modules and os.environ.get("CUDA_VISIBLE_DEVICES") != wanted:
        os.environ["CUDA_VISIBLE_DEVICES"] = wanted
        # orig_argv keeps "-m coordinator.cli": re-running argv[0] as a script would put
        # coordinator/cli/ first on sys.path and shadow the ``worker`` package.
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def load_engine(options: WorkerOptions, n_gpu_layers: int,
                settings: Settings) -> tuple[SpeculativeEngine, FitReport]:
    """One path for every worker: measure, fit the context (or check the fixed ``--ctx``),
    load the engine once, and reserve its checkpoint memory before any request can take the
    headroom.

    A fixed context is no shortcut: it is refused the same way a fit is (a device that
    cannot be served, a context above training or beyond memory), and its report is the
    same, so ``specfleet fleet`` shows every worker's fit as it was really reserved.
    """
    fit = fit_worker(options.model_path, device=options.device, budget_mib=options.budget_mib,
                     fit_target_mib=options.fit_target_mib, slots=options.slots,
                     capacity=options.capacity, ctx_min=options.ctx_min, n_threads=options.threads,
                     checkpoint=options.checkpoint, n_ctx=options.n_ctx,
                     allow_ctx_above_train=options.allow_ctx_above_train,
                     prefix_cache=options.prefix_cache,
                     prefix_checkpoints=options.prefix_checkpoints,
                     deterministic=options.deterministic)
    engine = SpeculativeEngine(replace(fit.config, n_gpu_layers=n_gpu_layers,
                                       fail_device_checkpoint=settings.fail_device_checkpoint))
    try:
        return engine, reserve_checkpoints(engine, fit)
    except BaseException:
        engine.close()
        raise
