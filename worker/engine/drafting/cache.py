"""Row-cost curves kept on disk, one per model, device, build and thread count, so a worker
that restarts or scales up reads its curve instead of timing it again.

A curve (:class:`~worker.engine.drafting.curve.CostCurve`) depends on what the decodes run: the
model file, the llama.cpp build and the kernels it picks on this CPU (its system info), the
CPU, the thread count, how many layers are offloaded and to what, whether weights are
repacked, and the batch shape. All of that is the key (:func:`curve_key`); a key that differs
in anything is a miss, and the curve is timed again and stored beside the others. A curve is
stored only when its timing ran on a quiet host (:func:`quiet`): a busy neighbour made
entries 2-23x too dear on a 2-core machine, and a dear entry, never drafted, is never
corrected by the verifies that run. What the curve misses afterwards (load, a context that
grew) the engine learns online (:class:`~worker.engine.drafting.costs.RowCosts`).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp
import psutil

from shared.logs import get_logger
from worker.engine.drafting.curve import PROBE_WIDTHS, CostCurve, measure_curve
from worker.llm import Batch, Context, ContextSpec, Model

log = get_logger("engine")

#: Bumped whenever what a stored curve means changes (the widths timed, how).
SCHEMA = 1
#: Most cores other processes may have used while a curve was timed for it to be stored.
QUIET_CORES = 0.3


def curve_key(model: Model, n_threads: int, n_ubatch: int, deterministic: bool,
              device_top2: bool = False) -> dict[str, Any]:
    """What a curve timed with this model and these settings on this host depends on (not
    the slot count or the context size: within 4 % at 4k to 262k cells)."""
    path = Path(model.spec.path).resolve()
    stat = path.stat()
    return {"schema": SCHEMA, "model": str(path), "bytes": stat.st_size,
            "mtime_ns": stat.st_mtime_ns, "llama_cpp": llama_cpp.__version__,
            "system": llama_cpp.llama_print_system_info().decode(errors="replace"),
            "cpu": _cpu_name(), "machine": platform.machine(), "threads": n_threads,
            "gpu_layers": model.spec.n_gpu_layers, "offloaded": model.offloaded,
            "devices": os.environ.get("CUDA_VISIBLE_DEVICES", ""), "repack": model.spec.repack,
            "deterministic": deterministic, "n_ubatch": n_ubatch,
            # rows sampled on the device cost more to decode on a CPU (docs/engine.md)
            "device_top2": device_top2}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor()


@dataclass(frozen=True)
class CostCache:
    """Curves under ``directory``, one JSON file per key (named by the key's digest)."""

    directory: Path

    def _path(self, key: dict[str, Any]) -> Path:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
        return self.directory / f"rowcost-{digest}.json"

    def load(self, key: dict[str, Any]) -> CostCurve | None:
        """The curve stored under ``key``, or None (none stored, or unreadable: timed again)."""
        path = self._path(key)
        try:
            data = json.loads(path.read_text())
            if data.get("key") != key:
                return None
            return CostCurve.from_json(data["curve"])
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("engine.cost_cache_unreadable", path=str(path), error=str(exc))
            return None

    def save(self, key: dict[str, Any], curve: CostCurve) -> None:
        """Store ``curve`` under ``key`` (atomically: a reader never sees half a file); a
        directory that cannot be written only costs the next start its timing."""
        path = self._path(key)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(f".{os.getpid()}.tmp")
            partial.write_text(json.dumps({"key": key, "curve": curve.as_json()}, indent=1))
            partial.replace(path)
        except OSError as exc:
            log.warning("engine.cost_cache_unwritable", path=str(path), error=str(exc))


class CpuWatch:
    """How many cores processes other than this one used between ``start`` and
    :meth:`others_cores` (``psutil``'s whole-host CPU time minus this process's)."""

    def __init__(self) -> None:
        self._process = psutil.Process()
        self._host = _busy_seconds(psutil.cpu_times())
        self._own = _own_seconds(self._process)
        self._wall = time.monotonic()

    def others_cores(self) -> float:
        wall = time.monotonic() - self._wall
        if wall <= 0:
            return 0.0
        host = _busy_seconds(psutil.cpu_times()) - self._host
        own = _own_seconds(self._process) - self._own
        return max(0.0, host - own) / wall


def _busy_seconds(times: Any) -> float:
    return float(sum(times) - times.idle - getattr(times, "iowait", 0.0))


def _own_seconds(process: psutil.Process) -> float:
    t = process.cpu_times()
    return float(t.user + t.system)


def curve_for(target: Context, batch: Batch, spec: ContextSpec, replays: bool,
              directory: str | None) -> CostCurve:
    """The target's cost curve: the one stored under its key in ``directory`` when that one
    covers every width this target can time (and its steady widths, where it ``replays``),
    else timed now (:func:`~worker.engine.drafting.curve.measure_curve`) and stored if the host
    was quiet meanwhile. ``directory`` None: always timed, never stored."""
    per_seq = spec.n_outputs_max_per_seq or spec.n_batch
    limit = min(spec.n_outputs_max or spec.n_batch, spec.n_batch, per_seq * spec.n_seq_max)
    wanted = {w for w in PROBE_WIDTHS if w <= limit} or {limit}
    cache = CostCache(Path(directory)) if directory else None
    key = (curve_key(target.model, spec.n_threads, spec.n_ubatch, spec.deterministic,
                     spec.device_top2) if cache is not None else {})
    stored = cache.load(key) if cache is not None else None
    if stored is not None and wanted <= set(stored.timed) and (stored.steady or not replays):
        log.info("engine.cost_curve", source="cache", widths=sorted(stored.timed))
        return stored
    watch, t0 = CpuWatch(), time.perf_counter()
    curve = measure_curve(target, batch, limit, replays)
    others = watch.others_cores()
    kept = cache is not None and others <= QUIET_CORES
    if cache is not None and kept:
        cache.save(key, curve)
    log.info("engine.cost_curve", source="timed", widths=sorted(curve.timed),
             seconds=round(time.perf_counter() - t0, 3), others_cores=round(others, 2),
             stored=kept)
    return curve
