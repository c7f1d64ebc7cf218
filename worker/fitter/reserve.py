"""Reserve every slot's checkpoint storage right after the engine loads, before serving.

The device checkpoint is a separate allocation that no context breakdown shows (seed 003):
left to the first deep rejection, runtime could have eaten the fitted headroom by then. So
the worker allocates it at start-up through the engine's own ``CheckpointStore`` and checks
it against what the fit measured. A failure, a zero, or a reservation that differs from the
measurement stops the worker with the fit's breakdown; a device allocation that fails falls
back to host storage for the worker's life (the store logs ``checkpoint.fallback``).
"""

from __future__ import annotations

from shared.logs import get_logger
from shared.protocol import CheckpointMode
from worker.engine.engine import SpeculativeEngine
from worker.engine.rollback import RollbackError
from worker.engine.rollback.compact import CompactRollback
from worker.fitter.buffers import parse_buffers
from worker.fitter.errors import FitError
from worker.fitter.fit import FitResult
from worker.fitter.report import breakdown_text
from worker.llm import LlamaError, capture_llama_log


def reserve_checkpoints(engine: SpeculativeEngine, fit: FitResult) -> int:
    """Allocate the engine's checkpoint storage now; returns the bytes reserved.

    Engines that never checkpoint (pure attention, or D = N) reserve nothing and return 0.
    """
    report = fit.report
    rollback = engine.rollback
    if not isinstance(rollback, CompactRollback):
        if report.components.get("checkpoint_reservation"):
            raise FitError("the fit reserved checkpoint memory but the engine does not "
                           "checkpoint: the fit and the engine were built from different settings")
        return 0
    breakdown = f"fit breakdown: {breakdown_text(report.components)}"
    if report.slots != 1:
        raise FitError(f"the engine serves one sequence, so it holds one checkpoint store; "
                       f"{report.slots} slots cannot all be reserved ({breakdown})")
    try:
        with capture_llama_log() as lines:
            reserved = rollback.reserve(engine.target)
    except (LlamaError, RollbackError) as exc:
        raise FitError(f"checkpoint reservation failed: {exc} ({breakdown})") from exc
    mode = rollback.store.mode
    key = ("checkpoint_device_bytes_per_slot" if mode is CheckpointMode.DEVICE
           else "checkpoint_host_bytes_per_slot")
    measured = report.details.get(key)
    if not isinstance(measured, int) or measured <= 0:
        raise FitError(f"the fit measured no {mode.value} checkpoint size ({breakdown})")
    if reserved <= 0:
        raise FitError(f"the {mode.value} checkpoint reservation is zero ({breakdown})")
    if reserved != measured:
        trend = "smaller" if reserved < measured else "larger"
        raise FitError(f"the {mode.value} checkpoint reservation ({reserved} B) is {trend} than "
                       f"the fit measured ({measured} B): the fit cannot be trusted ({breakdown})")
    get_logger("fitter").info(
        "fit.reserve", mode=mode.value, slots=report.slots, reserved_bytes=reserved,
        measured_bytes=measured, allocated_bytes=parse_buffers(lines).sizes.get("checkpoint", {}))
    return reserved
