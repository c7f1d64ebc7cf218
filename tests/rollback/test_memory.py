"""What compact rollback costs in memory, read from llama.cpp, and who never pays it.

The recurrent buffer of the target context is read from llama.cpp's own allocation line
(``... RS buffer size = X MiB``), for contexts the engine builds itself. At D = 1 it must not
move as the draft maximum N grows; at D = N it must grow with N (one snapshot per position).
"""

from __future__ import annotations

from pathlib import Path

from helpers import PROMPT

from shared.protocol import CheckpointMode, SpecMethod
from worker.fitter.buffers import parse_buffers
from worker.llm import capture_llama_log

from .conftest import MATRIX_TOKENS, engine_for
from .oracle import OracleProposer


def recurrent_bytes(model: Path, draft_max: int, depth: int) -> int:
    """Recurrent-state bytes llama.cpp allocates for the engine's target context (an n-gram
    engine builds no other context), at the log's 0.01 MiB resolution."""
    with capture_llama_log() as lines, engine_for(model, draft_max, depth):
        pass
    return parse_buffers(lines).total("recurrent")


def test_compact_depth_keeps_recurrent_memory_flat_as_drafts_grow(hybrid_model: Path) -> None:
    compact = [recurrent_bytes(hybrid_model, n, 1) for n in (3, 5, 7)]
    full = [recurrent_bytes(hybrid_model, n, n) for n in (3, 5, 7)]

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
