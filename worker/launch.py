"""What a worker process is asked to run, parsed, and its device pinned, before llama.cpp loads.

A worker must pin its device (``CUDA_VISIBLE_DEVICES``) before llama.cpp initialises its
backends. The command line is parsed first, so everything parsing needs lives here, in a
module that imports nothing of llama.cpp or the engine: the options and their defaults, the
engine capacity they name, and the parsers of ``--device`` and ``--slots``. ``specfleet
worker`` reads them, pins, and only then imports the serving code
(``tests/test_process_imports.py`` checks a worker starts once, never re-executed).

A worker may span several devices (:class:`DeviceGroup`: ``--device cuda:0,cuda:1``, ``--rpc
HOST:PORT,...``, ``--split-mode``, ``--tensor-split``); every combination llama.cpp cannot
honour is refused here, naming the flag, before anything loads (docs/fitter.md, "Device
groups").
"""

from __future__ import annotations

import math
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
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
#: ``HOST:PORT`` of an RPC device: a name or IPv4 address, or a bracketed IPv6 address.
_ENDPOINT_RE = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")


@dataclass(frozen=True)
class DeviceRef:
    """One device a worker uses: ``cpu`` (the host), ``cuda:N``, or an RPC server
    (``endpoint`` ``HOST:PORT``, named ``RPC[HOST:PORT]`` as llama.cpp names the server)."""

    kind: str
    index: int = 0
    endpoint: str = ""

    @property
    def name(self) -> str:
        if self.kind == "rpc":
            return f"RPC[{self.endpoint}]"
        return "cpu" if self.kind == "cpu" else f"cuda:{self.index}"

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def is_rpc(self) -> bool:
        return self.kind == "rpc"


def parse_device(text: str) -> DeviceRef:
    """Parse ``cpu`` or ``cuda:N``; anything else is a ValueError naming the value."""
    m = _DEVICE_RE.match(text.strip().lower())
    if not m:
        raise ValueError(f"unknown device {text!r}: use 'cpu' or 'cuda:N' (e.g. cuda:0)")
    return DeviceRef("cpu") if m.group(1) == "cpu" else DeviceRef("cuda", int(m.group(2)))


def parse_rpc(text: str) -> tuple[DeviceRef, ...]:
    """``--rpc HOST:PORT,...``: the RPC servers, in the order given."""
    found: list[DeviceRef] = []
    for item in text.split(","):
        m = _ENDPOINT_RE.match(item.strip())
        if not m or not 1 <= int(m.group(2)) <= 65535:
            raise ValueError(f"--rpc takes HOST:PORT[,HOST:PORT...] (port 1..65535), "
                             f"got {item.strip()!r}")
        ref = DeviceRef("rpc", endpoint=f"{m.group(1)}:{int(m.group(2))}")
        if ref in found:
            raise ValueError(f"--rpc lists {ref.endpoint} twice")
        found.append(ref)
    return tuple(found)


class SplitMode(StrEnum):
    """How llama.cpp splits a model over a group (``llama_split_mode``): whole layers in
    proportion to ``--tensor-split``, rows of every matrix (CUDA only), or everything on the
    first device."""

    LAYER = "layer"
    ROW = "row"
    NONE = "none"


@dataclass(frozen=True)
class DeviceGroup:
    """The devices a worker's model spans, in the model's device order.

    ``devices`` starts with the host (``cpu``) on a CPU worker, whose memory is then one of
    the fitted devices; otherwise with the CUDA devices of ``--device``. RPC servers follow in
    ``--rpc`` order. The layers go to :attr:`offload` (every device but the host), in that
    order, by ``tensor_split`` (None: llama.cpp's default, by each device's free memory).
    """

    devices: tuple[DeviceRef, ...]
    split_mode: SplitMode = SplitMode.LAYER
    tensor_split: tuple[float, ...] | None = None

    @classmethod
    def of(cls, device: DeviceRef) -> DeviceGroup:
        return cls((device,))

    @property
    def name(self) -> str:
        """``cpu``, ``cuda:0``, or the members joined with commas (the registered device)."""
        return ",".join(d.name for d in self.devices)

    @property
    def offload(self) -> tuple[DeviceRef, ...]:
        """The devices that hold layers, in the model's order (none: a CPU worker)."""
        return tuple(d for d in self.devices if d.kind != "cpu")

    @property
    def host_is_device(self) -> bool:
        """A CPU worker: host memory is one of the fitted devices (beside GPUs it is not)."""
        return self.devices[0].kind == "cpu"

    @property
    def is_cuda(self) -> bool:
        return any(d.is_cuda for d in self.devices)

    @property
    def cuda_indices(self) -> tuple[int, ...]:
        """The CUDA devices, ascending: what ``CUDA_VISIBLE_DEVICES`` shows the process."""
        return tuple(sorted(d.index for d in self.devices if d.is_cuda))


def exclusive_devices(device: str, host: str) -> set[str]:
    """The devices a worker registered with ``device`` (a :attr:`DeviceGroup.name`) on
    ``host`` holds alone: its CUDA devices (on that host) and its RPC servers (wherever they
    are: a server serves one client's buffers). The host's CPU is shared by design (its
    threads' wait policy is what makes that fair: ``worker/threads.py``)."""
    held: set[str] = set()
    for member in device.split(","):
        member = member.strip()
        if member.startswith("cuda:"):
            held.add(f"{member} on {host}")
        elif member.startswith("RPC[") and member.endswith("]"):
            held.add(member)
    return held


def parse_device_group(device: str = "cpu", rpc: str | None = None,
                       split_mode: str = SplitMode.LAYER.value,
                       tensor_split: str | None = None) -> DeviceGroup:
    """``--device``, ``--rpc``, ``--split-mode`` and ``--tensor-split`` as one group; every
    combination llama.cpp would not honour is a ValueError naming the flag."""
    members = [parse_device(item) for item in device.split(",")]
    if len(members) > 1 and any(m.kind == "cpu" for m in members):
        raise ValueError(f"--device {device!r}: cpu cannot be listed with CUDA devices (the "
                         "host is always there; list the GPUs, or cpu alone)")
    for m in members:
        if members.count(m) > 1:
            raise ValueError(f"--device lists {m.name} twice")
    members += parse_rpc(rpc) if rpc else ()
    try:
        mode = SplitMode(split_mode.strip().lower())
    except ValueError:
        raise ValueError(f"--split-mode must be layer, row or none, got {split_mode!r}") from None
    group = DeviceGroup(tuple(members), mode)
    offload = group.offload
    if mode is not SplitMode.LAYER and len(offload) < 2:
        raise ValueError(f"--split-mode {mode.value} needs a group of two or more devices "
                         f"(--device cuda:0,cuda:1 or --rpc), this worker has {group.name}")
    if mode is SplitMode.ROW and not all(d.is_cuda for d in offload):
        raise ValueError("--split-mode row splits matrix rows over CUDA devices only: "
                         + ", ".join(d.name for d in offload if not d.is_cuda)
                         + " cannot take rows (use --split-mode layer)")
    if tensor_split is None:
        return group
    if mode is SplitMode.NONE:
        raise ValueError("--tensor-split does not apply with --split-mode none (the whole "
                         "model is on the group's first device)")
    return DeviceGroup(group.devices, mode, _tensor_split(tensor_split, offload))


def _tensor_split(text: str, offload: Sequence[DeviceRef]) -> tuple[float, ...]:
    """One non-negative proportion per device that takes layers, not all zero."""
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"--tensor-split takes numbers like 3,1, got {text!r}") from None
    if len(values) != len(offload):
        raise ValueError(f"--tensor-split has {len(values)} value(s) for {len(offload)} "
                         f"device(s) that take layers ({', '.join(d.name for d in offload)})")
    if any(not math.isfinite(v) or v < 0 for v in values) or not any(values):
        raise ValueError(f"--tensor-split takes non-negative proportions, not all zero, "
                         f"got {text!r}")
    return values


def parse_mib_list(flag: str, text: str, group: DeviceGroup) -> tuple[float, ...]:
    """A MiB figure per device (``--budget-mib``, ``--fit-target-mib``): one number for every
    device of ``group``, or one per device in the group's order (the host first on a CPU
    worker)."""
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"{flag} takes MiB, one number or one per device, got {text!r}") from None
    if len(values) == 1:
        return values * len(group.devices)
    if len(values) != len(group.devices):
        raise ValueError(f"{flag} has {len(values)} values for {len(group.devices)} devices "
                         f"({group.name}): give one, or one per device")
    return values


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
    #: ``cpu``/``cuda:N``, or the parsed group (``--device`` list, ``--rpc``, split options).
    device: str | DeviceGroup = "cpu"
    name: str | None = None
    n_ctx: int | None = None  # None: fit the context to the device's memory
    allow_ctx_above_train: bool = False  # a fixed n_ctx beyond the model's training context
    #: One figure for every device, or one per device of the group (:func:`parse_mib_list`).
    budget_mib: float | tuple[float, ...] | None = None
    fit_target_mib: float | tuple[float, ...] = DEFAULT_FIT_TARGET_MIB
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
    #: Verify steps padded to row counts a GPU replays (EngineConfig.verify_buckets; None:
    #: on a GPU).
    verify_buckets: bool | None = None
    #: Tokens of the embedding context (EngineConfig.embedding_tokens; 0: no embeddings).
    embedding_tokens: int = 0


def pin_device(device: DeviceRef | DeviceGroup) -> int:
    """Make the device's GPUs the only ones llama.cpp can see; returns the GPU layer count.

    Must run before llama.cpp loads: it reads the visible devices once. A process that
    loaded it earlier with another value would serve on the wrong device, so that is refused
    (``specfleet worker`` pins before it imports the serving code;
    ``tests/test_process_imports.py`` checks the order). A group's GPUs are shown in
    ascending order; the model's own order is its placement's (:mod:`worker.llm.placement`).
    """
    group = device if isinstance(device, DeviceGroup) else DeviceGroup.of(device)
    wanted = ",".join(str(i) for i in group.cuda_indices)
    if "llama_cpp" in sys.modules and os.environ.get("CUDA_VISIBLE_DEVICES") != wanted:
        raise RuntimeError(f"llama.cpp was loaded before the device was pinned to "
                           f"{group.name}: pin first (worker/launch.py)")
    # CUDA numbers GPUs fastest-first unless told otherwise; NVML (which the fitter measures
    # through) numbers them by PCI bus: make cuda:N the same GPU for both.
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    os.environ["CUDA_VISIBLE_DEVICES"] = wanted
    return -1 if group.offload else 0
