"""What compact rollback costs in memory, read from llama.cpp, and who never pays it.

The recurrent buffer of the target context is read from llama.cpp's own allocation line
(``... RS buffer size = X MiB``), for contexts the engine builds itself. At D = 1 it must not
move as the draft maximum N grows; at D = N it must grow with N (one snapshot per position).
"""

from __future__ import annotations

import re
from pathlib import Path

from shared.protocol import CheckpointMode, SpecMethod
from worker.llm import capture_llama_log

from .conftest import MATRIX_TOKENS, PROMPT, engine_for
from .oracle import OracleProposer

RS_BUFFER = re.compile(r"RS buffer size =\s+([\d.]+) MiB")


def recurrent_mib(model: Path, draft_max: int, depth: int) -> float:
    """Recurrent-state MiB llama.cpp allocates for the engine's target context."""
    with capture_llama_log() as lines, engine_for(model, draft_max, depth):
        pass
    # The MTP-free engine builds one context; sum in case the buffer is split over devices.
    return sum(float(m.group(1)) for line in lines if (m := RS_BUFFER.search(line)))


def test_compact_depth_keeps_recurrent_memory_flat_as_drafts_grow(hybrid_model: Path) -> None:
    compact = [recurrent_mib(hybrid_model, n, 1) for n in (3, 5, 7)]
    full = [recurrent_mib(hybrid_model, n, n) for n in (3, 5, 7)]

    assert compact[0] > 0
    assert compact == [compact[0]] * 3
    assert full[0] < full[1] < full[2]
    assert compact[0] < full[0]


def test_pure_attention_never_checkpoints(dense_model: Path, dense_reference: list[int]) -> None:
    with engine_for(dense_model, 5, 1, CheckpointMode.DEVICE, method=SpecMethod.NGRAM) as engine:
        oracle = OracleProposer(dense_reference, engine.model.n_vocab, seed=11)
        result = engine.generate(PROMPT, MATRIX_TOKENS, proposer=oracle)

    assert result.tokens == dense_reference
    assert any(p.rejected > 1 for p in oracle.plan), "no deep rejection: nothing was at stake"
    assert result.telemetry.checkpoint_saves == 0
    assert result.telemetry.replay_events == 0
    assert result.telemetry.checkpoint_mode is None
