"""Host work handed to a step runs while the device decodes where llama.cpp queues the
decode (a GPU: ``OVERLAPPED``), after it elsewhere (``SERIAL``); either way the step's
decode time is only what it waited on the device, and the output is the same."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from helpers import PROMPT

from shared.protocol import SpecMethod, SpecSettings
from worker.engine.overlap import OVERLAPPED, SERIAL, Overlap, make_overlap
from worker.engine.slot import SlotRequest
from worker.llm import Batch, Context

from .conftest import open_engine

#: What the work handed to each step costs (slept: far above a tiny model's decode).
WORK_SECONDS = 0.05


class RecordsOrder:
    """The target context, noting when each decode is queued and waited for."""

    def __init__(self, context: Context, log: list[str]) -> None:
        self._context = context
        self._log = log

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    def decode(self, batch: Batch) -> None:
        self._log.append("decode")
        self._context.decode(batch)

    def synchronize(self) -> None:
        self._log.append("synchronize")
        self._context.synchronize()


@pytest.mark.parametrize(("overlap", "order"), [
    (OVERLAPPED, ["decode", "during", "synchronize"]),
    (SERIAL, ["decode", "synchronize", "during"])], ids=["overlapped", "serial"])
def test_host_work_runs_while_the_device_decodes_where_it_overlaps(
        dense_model: Path, overlap: Overlap, order: list[str]) -> None:
    spec = SpecSettings(method=SpecMethod.NGRAM, draft_max=4)
    with open_engine(dense_model, SpecMethod.NGRAM, draft_max=4) as engine:
        expected = engine.generate(PROMPT, 24, spec).tokens
        log: list[str] = []
        engine.verifier.target = RecordsOrder(engine.verifier.target, log)  # type: ignore[assignment]
        engine.verifier.overlap = overlap
        slot = engine.admit(SlotRequest(PROMPT, 24, spec))
        decode0, steps = engine.decode_seconds, 0

        def work() -> None:
            log.append("during")
            time.sleep(WORK_SECONDS)

        decoded = 0
        while engine.active:
            start = len(log)
            engine.step(work)
            # A step with nothing to decode (the prompt was cached whole) still runs it.
            assert log[start:] in (order, ["during"])
            decoded += log[start:] == order
            steps += 1
        assert decoded >= steps - 1 and slot.generated == expected
        # The work's seconds are not the decode's (each step slept WORK_SECONDS in it).
        assert engine.decode_seconds - decode0 < steps * WORK_SECONDS / 2


def test_a_step_overlaps_only_where_the_layers_run_on_a_gpu(dense_model: Path) -> None:
    assert make_overlap(True) is OVERLAPPED and make_overlap(False) is SERIAL
    with open_engine(dense_model, SpecMethod.NGRAM, draft_max=4) as engine:
        assert not engine.model.offloaded
        assert not engine.overlaps and engine.verifier.overlap is SERIAL
