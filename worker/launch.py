"""What a worker process is asked to run, parsed, and its device pinned, before llama.cpp loads.

A worker must pin its device (``CUDA_VISIBLE_DEVICES``) before llama.cpp initialises its
backends. The command line is parsed first, so everything parsing needs lives here, in a
module that imports nothing of llama.cpp or the engine: the options and their defaults, the
engine capacity they name, and the parsers of ``--device`` and ``--slots``. ``specfleet
worker`` reads them, pins, and only then imports the serving code
(``tests/test_process_imports.py`` checks a worker starts once, never re-executed).
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from typing import Final, Literal

from shared.protocol import MAX_DRAFT, CheckpointMode, SpecMethod

#: llama.cpp's own default ``--fit-target``: memory left free on the device.
DEFAULT_FIT_TARGET_MIB = 1024.0
#: The smallest per-slot context a fitted worker accepts (``--ctx-min``).
DEFAULT_CTX_MIN = 1024
#: Prefix checkpoints kept per slot by default (``--prefix-checkpoints``).
DEFAULT_CHECKPOINTS = 4
#: ``--slots auto``: the worker serves as many sequences as still fit ``--ctx-min`` each.
AUTO_SLOTS: Final = "auto"
#: The most slots a worker serves (llama.cpp's LLAMA_MAX_SEQ).
MAX_SLOTS = 256

#: Why a GPU worker refuses deterministic mode.
DETERMINISTIC_CPU_ONLY = (
    "deterministic mode is only guaranteed on the CPU backend (--device cpu): a GPU's "
    "kernels are chosen by batch shape inside llama.cpp's CUDA backend and cannot be pinned "
    "from here")

_DEVICE_RE = re.compile(r"^(cpu|cuda:(\d+))$")


@dataclass(frozen=True)
class DeviceRef:
    """A parsed ``--device`` value: ``cpu`` or ``cuda:N``."""

    kind: str
    index: int = 0

    @property
    def name(self) -> str:
        return "cpu" if self.kind == "cpu" else f"cuda:{self.index}"

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"


def parse_device(text: str) -> DeviceRef:
    """Parse ``cpu`` or ``cuda:N``; anything else is a ValueError naming the value."""
    m = _DEVICE_RE.match(text.strip().lower())
    if not m:
        raise ValueError(f"unknown device {text!r}: use 'cpu' or 'cuda:N' (e.g. cuda:0)")
    return DeviceRef("cpu") if m.group(1) == "cpu" else DeviceRef("cuda", int(m.group(2)))


def parse_slots(text: str) -> int | Literal["auto"]:
    """A ``--slots`` value: ``auto`` or a count in 1..MAX_SLOTS; anything else a ValueError."""
    value = text.strip().lower()
    if value == AUTO_SLOTS:
        return AUTO_SLOTS
    if value.isdigit() and 1 <= int(value) <= MAX_SLOTS:
        return int(value)
    raise ValueError(f"--slots must be 'auto' or a number 1..{MAX_SLOTS}, got {text!r}")


#: The settings a request may narrow but an engine is loaded with (they size its contexts and
#: memory): they belong to :class:`EngineCapacity`, never to ``EngineConfig.request_defaults``.
CAPACITY_FIELDS = frozenset({"method", "draft_max", "rollback_depth"})


@dataclass(frozen=True)
class EngineCapacity:
    """What an engine is loaded for; no request can widen it (``shared/capacity.py``).

    ``method`` is the drafter it loads for (``auto``: the plan resolves it from the model),
    ``draft_max`` the draft width N its contexts are sized for, ``rollback_depth`` the direct
    rollback snapshots D of a recurrent model (None = N). :func:`~worker.engine.plan.plan_engine`
    turns it into the concrete capacity a loaded worker publishes
    (:class:`~shared.protocol.WorkerCapacity`)."""

    method: SpecMethod = SpecMethod.AUTO
    #: None: the width the plan picks for the method it resolves and the slot count
    #: (:func:`~worker.engine.plan.default_draft_max`).
    draft_max: int | None = None
    rollback_depth: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.method, SpecMethod):  # "auto" would pass for it, then misplan
            raise TypeError(f"method must be a SpecMethod, got {self.method!r}")
        if self.draft_max is not None and not 1 <= self.draft_max <= MAX_DRAFT:
            raise ValueError(f"draft_max ({self.draft_max}) must satisfy "
                             f"1 <= draft_max <= {MAX_DRAFT}")
        check_rollback_depth(self.rollback_depth, self.draft_max or MAX_DRAFT)


def check_rollback_depth(rollback_depth: int | None, draft_max: int) -> None:
    """D must be 1..N: a depth beyond the width would keep snapshots no draft uses."""
    if rollback_depth is not None and not 1 <= rollback_depth <= draft_max:
        raise ValueError(f"rollback_depth ({rollback_depth}) must satisfy "
                         f"1 <= rollback_depth <= draft_max ({draft_max})")


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
    #: Greedy verify rows reduced on the device (EngineConfig.device_verify; None: on a GPU).
    device_verify: bool | None = None


def pin_device(device: DeviceRef) -> int:
    """Make ``device`` the only one llama.cpp can see; returns the GPU layer count to use.

    Must run before llama.cpp loads: it reads the visible devices once. A process that
    loaded it earlier with another value would serve on the wrong device, so that is refused
    (``specfleet worker`` pins before it imports the serving code;
    ``tests/test_process_imports.py`` checks the order).
    """
    wanted = str(device.index) if device.is_cuda else ""
    if "llama_cpp" in sys.modules and os.environ.get("CUDA_VISIBLE_DEVICES") != wanted:
        raise RuntimeError(f"llama.cpp was loaded before the device was pinned to "
                           f"{device.name}: pin first (worker/launch.py)")
    # CUDA numbers GPUs fastest-first unless told otherwise; NVML (which the fitter measures
    # through) numbers them by PCI bus: make cuda:N the same GPU for both.
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    os.environ["CUDA_VISIBLE_DEVICES"] = wanted
    return -1 if device.is_cuda else 0
