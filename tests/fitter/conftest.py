"""Fixtures of the fitter tests: an engine really allocated from a fit, read back."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from shared.protocol import FitReport
from worker.engine.engine import SpeculativeEngine
from worker.fitter import FitResult, reserve_checkpoints
from worker.fitter.buffers import Buffers, parse_buffers
from worker.llm import capture_llama_log

#: Every kind of buffer llama.cpp logs when it really allocates one.
ALLOCATED_KINDS = ("model", "kv_buffer", "recurrent", "output", "compute", "checkpoint")


@dataclass
class Allocated:
    """An engine built from a fit, its checkpoints reserved, and what llama.cpp reported."""

    engine: SpeculativeEngine
    buffers: Buffers
    #: The fit's report as reserved (what the worker publishes).
    report: FitReport

    @property
    def reserved(self) -> int:
        return self.report.details["checkpoint_reserved_bytes"]

    @property
    def reported_bytes(self) -> int:
        """What the engine allocated: llama.cpp's buffers as it logged them, plus the
        engine's own prefix-checkpoint buffers (host memory llama.cpp never sees)."""
        return self.buffers.grand_total(ALLOCATED_KINDS) + self.engine.prefix.reserved_bytes


@pytest.fixture
def allocate() -> Iterator[object]:
    """Build the engine a fit describes, as the worker will, capturing llama.cpp's reports."""
    engines: list[SpeculativeEngine] = []

    def build(fit: FitResult) -> Allocated:
        with capture_llama_log() as lines:
            engine = SpeculativeEngine(fit.config)
            engines.append(engine)
            report = reserve_checkpoints(engine, fit)
        return Allocated(engine, parse_buffers(lines), report)

    yield build
    for engine in engines:
        engine.close()
