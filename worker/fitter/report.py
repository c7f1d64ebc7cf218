"""Showing a fit: the ``fit.report`` log event, a table for operators, a one-line breakdown.

The :class:`shared.protocol.FitReport` itself is the record (published with the worker's
registration, printed by ``specfleet fit --json``); this module only presents it.
"""

from __future__ import annotations

from rich.table import Table

from shared.logs import get_logger
from shared.protocol import FitReport

_MIB = 1024 * 1024

#: Component keys in the order operators read them, with what each one is.
COMPONENTS: dict[str, str] = {
    "weights": "model weights",
    "kv": "attention KV cache at the fitted context",
    "recurrent": "live recurrent state (one group per slot)",
    "snapshots": "rollback snapshots (D groups per slot)",
    "compute": "target compute buffers",
    "output": "target output buffer (logits, hidden rows)",
    "draft": "MTP draft context (KV, compute, output)",
    "checkpoint_reservation": "compact-rollback checkpoints (one per slot)",
    "lookup_cache": "suffix drafter's output cache (host memory)",
    "prefix_checkpoints": "prefix-reuse checkpoints (host memory)",
    "embeddings": "embedding context, --embeddings (KV, compute, output)",
}


def mib(n: int | float) -> str:
    """Bytes as MiB with two decimals (llama.cpp's own resolution)."""
    return f"{n / _MIB:.2f}"


def breakdown_text(components: dict[str, int]) -> str:
    """``weights 235.16 MiB, kv 6.00 MiB, ...`` for error messages and logs."""
    return ", ".join(f"{k} {mib(v)} MiB" for k, v in components.items())


def log_report(report: FitReport) -> None:
    """The one ``fit.report`` event: every figure an operator needs to audit the fit."""
    get_logger("fitter").info(
        "fit.report", model=report.model_path, n_ctx=report.n_ctx,
        n_ctx_train=report.n_ctx_train, slots=report.slots, total_bytes=report.total_bytes,
        budget_bytes=report.budget_bytes, spec_method=report.spec_method,
        draft_max=report.draft_max, rollback_depth=report.rollback_depth,
        devices=[d.model_dump() for d in report.devices], components=report.components,
        details=report.details,
    )


def render_table(report: FitReport) -> Table:
    """A rich table: one row per component and device, then the totals and the verdict."""
    table = Table(title=f"fit: {report.model_path}", title_justify="left")
    table.add_column("component")
    for dev in report.devices:
        table.add_column(f"{dev.device} MiB", justify="right")
    table.add_column("what", style="dim")
    for key, what in COMPONENTS.items():
        table.add_row(key, *(mib(d.components.get(key, 0)) for d in report.devices), what)
    layers = report.details.get("device_layers") or {}
    if len(report.devices) > 1:  # a device group: where llama.cpp put the layers
        table.add_row("layers", *(str(layers.get(d.device, 0)) for d in report.devices),
                      f"split-mode {report.details.get('split_mode')}, tensor-split "
                      f"{report.details.get('tensor_split') or 'by free memory'} "
                      "(the output layer counts as one)")
    table.add_section()
    table.add_row("total", *(mib(sum(d.components.values())) for d in report.devices),
                  f"{report.details.get('n_ctx_source', 'fitted')} n_ctx {report.n_ctx} "
                  f"(training {report.n_ctx_train}), "
                  f"slots {report.slots}")
    table.add_row("free", *(mib(d.free_bytes) for d in report.devices),
                  f"source: {report.details.get('memory_source')}")
    table.add_row("margin", *(mib(d.margin_bytes) for d in report.devices), "--fit-target-mib")
    table.add_row("headroom",
                  *(mib(d.free_bytes - d.margin_bytes - sum(d.components.values()))
                    for d in report.devices),
                  f"spec {report.spec_method}, draft_max {report.draft_max}, "
                  + _rollback_text(report))
    return table


def _rollback_text(report: FitReport) -> str:
    """Only recurrent state keeps rollback snapshots: a pure-attention model rolls back by
    trimming its KV cache, so it has no depth to show (nor has an engine that never drafts)."""
    if report.rollback_depth is None:
        return "no rollback snapshots"
    return f"rollback_depth {report.rollback_depth}"
