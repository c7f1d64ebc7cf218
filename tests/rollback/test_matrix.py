"""The rollback matrix: every draft maximum N in 1..7, every depth D in 1..N, both storages.

An oracle drafter makes every accepted-prefix length 0..N occur, so shallow rejections
(depth <= D: direct snapshot rollback), deep ones (depth > D: checkpoint restore + replay)
and full accepts all happen. Whatever the path, the output must be plain greedy, token for
token, and replays must happen exactly on the verifies whose rejected depth exceeds D.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import PROMPT

from shared.protocol import CheckpointMode

from .conftest import MATRIX_TOKENS, engine_for
from .oracle import OracleProposer

PAIRS = [(n, d) for n in range(1, 8) for d in range(1, n + 1)]


@pytest.mark.parametrize("mode", list(CheckpointMode), ids=lambda m: m.value)
@pytest.mark.parametrize(("draft_max", "depth"), PAIRS, ids=[f"N{n}-D{d}" for n, d in PAIRS])
def test_oracle_matrix_is_exact_and_replays_only_deep_rejections(
        hybrid_model: Path, hybrid_reference: list[int], draft_max: int, depth: int,
        mode: CheckpointMode) -> None:
    expected = hybrid_reference[:MATRIX_TOKENS]
    with engine_for(hybrid_model, draft_max, depth, mode) as engine:
        oracle = OracleProposer(expected, engine.model.n_vocab, seed=draft_max * 10 + depth)
        result = engine.generate(PROMPT, MATRIX_TOKENS, proposer=oracle)

    assert result.tokens == expected
    assert oracle.observed == [p.accept for p in oracle.plan], "the oracle's schedule did not hold"
    assert set(oracle.observed) == set(range(draft_max + 1)), "an accepted length never occurred"

    deep = [p for p in oracle.plan if p.rejected > depth]
    telemetry = result.telemetry
    assert telemetry.rollback_depth == depth
    assert telemetry.replay_events == len(deep)
    assert telemetry.replay_tokens == sum(p.accept + 1 for p in deep)
    if depth < draft_max:
        assert deep, "no rejection deeper than D: the replay path went untested"
        assert telemetry.checkpoint_saves == sum(p.width > depth for p in oracle.plan)
        assert telemetry.checkpoint_mode == mode.value
        assert telemetry.host_fallbacks == 0
    else:
        assert telemetry.checkpoint_saves == 0
