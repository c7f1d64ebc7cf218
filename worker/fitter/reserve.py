"""Reserve every slot's checkpoint storage right after the engine loads, before serving.

The device checkpoint is a separate allocation that no context breakdown shows (docs/fitter.md,
"Reservation"):
left to the first deep rejection, runtime could have eaten the fitted headroom by then. So
the worker allocates it at start-up through the engine's own ``CheckpointStore`` and checks
it against what the fit measured. A failure, a zero, or a reservation that differs from the
measurement stops the worker with the fit's breakdown; a device allocation that fails falls
back to host storage for the worker's life (the store logs ``checkpoint.fallback``), and the
returned report says so. The rollback is told first which devices the fit put the checkpoint
on, so a fallback, now or mid-run, names the devices of a group it moved off.
"""

from __future__ import annotations

from shared.logs import get_logger
from shared.protocol import CheckpointMode, DeviceFit, FitReport
from worker.engine.engine import SpeculativeEngine
from worker.engine.rollback import RollbackError
from worker.engine.rollback.compact import CompactRollback
from worker.fitter.buffers import MIB, Buffers, DeviceMap, parse_buffers
from worker.fitter.devices import device_map
from worker.fitter.errors import FitError
from worker.fitter.fit import FitResult
from worker.fitter.report import breakdown_text
from worker.llm import LlamaError, capture_llama_log
from worker.llm.placement import active_placement

#: llama.cpp logs each checkpoint buffer with 0.001 MiB resolution.
_CHECKPOINT_RESOLUTION = round(0.0005 * MIB)


def reserve_checkpoints(engine: SpeculativeEngine, fit: FitResult) -> FitReport:
    """Allocate the engine's checkpoint storage now; returns the fit's report as reserved.

    The report the worker publishes must say what was really reserved and where: after a
    device allocation fell back to the host, the checkpoint is host memory (off a GPU's
    total), ``checkpoint_mode`` says ``host`` and ``checkpoint_reserved_bytes`` is the host
    size. Engines that never checkpoint (pure attention, or D = N) reserve nothing, and say so
    with the same ``fit.reserve`` event.
    """
    report = fit.report
    _check_prefix_reservation(engine, report)
    rollback = engine.rollback
    if not engine.plan.checkpoints:
        if report.components.get("checkpoint_reservation"):
            raise FitError("the fit reserved checkpoint memory but the engine does not "
                           "checkpoint: the fit and the engine were built from different settings")
        _log_reserve(report, None, 0, None, {})
        return _as_reserved(report, None, 0)
    breakdown = f"fit breakdown: {breakdown_text(report.components)}"
    if not isinstance(rollback, CompactRollback):  # what a plan that checkpoints builds
        raise FitError(f"the engine's plan checkpoints but its rollback is "
                       f"{type(rollback).__name__} ({breakdown})")
    if engine.plan.slots != report.slots:
        raise FitError(f"the engine serves {engine.plan.slots} slots but the fit reserved "
                       f"{report.slots} ({breakdown})")
    rollback.place(_checkpoint_devices(report))
    try:
        with capture_llama_log() as lines:
            reservation = rollback.reserve(engine.target)
    except (LlamaError, RollbackError) as exc:
        raise FitError(f"checkpoint reservation failed: {exc} ({breakdown})") from exc
    mode, reserved = reservation.mode, reservation.bytes_per_slot
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
    allocated = parse_buffers(lines)
    _log_reserve(report, mode, reserved, measured, allocated.sizes.get("checkpoint", {}))
    as_reserved = _as_reserved(report, mode, reserved)
    if mode is CheckpointMode.DEVICE:
        _check_devices(as_reserved, allocated, breakdown)
    # Why a device reservation fell back (None: it did not) and the devices whose share moved
    # to the host, for the worker's metrics.
    as_reserved.details["checkpoint_fallback"] = reservation.fallback_reason
    as_reserved.details["checkpoint_fallback_devices"] = reservation.fallback_devices
    return as_reserved


def _checkpoint_devices(report: FitReport) -> list[str]:
    """The devices the fit put the device checkpoint on (those of the recurrent layers, in
    the model's order); none when the checkpoints are host storage by configuration."""
    if report.details.get("checkpoint_mode") != CheckpointMode.DEVICE.value:
        return []
    return [d.device for d in report.devices if d.components.get("checkpoint_reservation")]


def _check_devices(report: FitReport, allocated: Buffers, breakdown: str) -> None:
    """Each device's checkpoint buffers, as llama.cpp allocated them, must be the share the
    fit reserved on it (the devices of its recurrent layers, in the model's order): another
    split means the fit and the engine disagree on where the layers are."""
    placement = active_placement()
    where = (device_map(placement.group, placement) if placement is not None
             else DeviceMap.single(report.devices[0].device))
    found = allocated.by_device("checkpoint", where)
    lines = max(1, len(allocated.sizes.get("checkpoint", {}))) * report.slots
    for device in report.devices:
        expected = device.components.get("checkpoint_reservation", 0)
        got = found.get(device.device, 0)
        if abs(got - expected) > _CHECKPOINT_RESOLUTION * lines:
            raise FitError(f"llama.cpp allocated {got} B of checkpoints on {device.device}, the "
                           f"fit reserved {expected} B there: the devices are not in the "
                           f"order the fit measured ({breakdown})")


def _check_prefix_reservation(engine: SpeculativeEngine, report: FitReport) -> None:
    """The engine's prefix-checkpoint buffers (allocated when it loaded) must be exactly what
    the fit counted: a CPU worker's ``prefix_checkpoints`` component, a GPU worker's host
    bytes."""
    per_slot = report.details.get("prefix_checkpoints_per_slot", 0)
    size = report.details.get("prefix_checkpoint_bytes", 0)
    counted = report.slots * int(per_slot or 0) * int(size or 0)
    if engine.prefix.reserved_bytes != counted:
        raise FitError(f"the engine reserved {engine.prefix.reserved_bytes} B of prefix "
                       f"checkpoints but the fit counted {counted} B: the fit and the engine "
                       "were built from different settings")


def _log_reserve(report: FitReport, mode: CheckpointMode | None, reserved: int,
                 measured: int | None, allocated: dict[str, int]) -> None:
    get_logger("fitter").info(
        "fit.reserve", mode=mode.value if mode else None, slots=report.slots,
        reserved_bytes=reserved, measured_bytes=measured, allocated_bytes=allocated)


def _as_reserved(report: FitReport, mode: CheckpointMode | None, reserved: int) -> FitReport:
    """``report`` with the checkpoint as reserved: a device checkpoint where the fit placed it
    (the devices of the recurrent layers), host storage on the host (a CPU worker's host
    memory is its ``cpu`` device; beside GPUs it joins the host-side bytes)."""
    total = report.slots * reserved
    host = next((d for d in report.devices if d.device == "cpu"), None)

    def on(device: DeviceFit) -> int:
        if mode is CheckpointMode.DEVICE:
            return device.components.get("checkpoint_reservation", 0)
        return total if mode is CheckpointMode.HOST and device is host else 0

    devices = [d.model_copy(update={"components": {**d.components,
                                                   "checkpoint_reservation": on(d)}})
               for d in report.devices]
    components = {key: sum(d.components.get(key, 0) for d in devices)
                  for key in report.components}
    details = {**report.details, "checkpoint_mode": mode.value if mode else None,
               "checkpoint_reserved_bytes": total}
    if mode is CheckpointMode.HOST and host is None:
        details["host_bytes"] = int(details.get("host_bytes", 0)) + total
    return report.model_copy(update={
        "components": components, "total_bytes": sum(components.values()), "details": details,
        "devices": devices})
