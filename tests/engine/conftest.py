"""Engines shared by the engine tests, and the plain-greedy references they are checked against.

Every exactness check compares a speculative run with plain one-token-at-a-time greedy
decoding of the same prompt on the same model, token by token. The tiny models are F32,
where batched and single-row logits agree (see docs/engine.md), so identity is the bar.
Tiny engines run one thread: a 64-wide model gains nothing from two, and on a shared
two-core machine thread barriers cost more than the arithmetic.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pytest
from helpers import N_CTX, PROMPT, greedy

from shared.protocol import SpecMethod, Telemetry
from worker.engine.drafting.curve import CostCurve
from worker.engine.engine import EngineConfig, GenerationResult, SpeculativeEngine
from worker.launch import EngineCapacity
from worker.testmodels import write_dense_llama, write_qwen35_hybrid
from worker.testmodels.recipe import Strengths

TOKENS = 200
N_MAX = 7
#: A softer output scale, so the MTP head's confidence spreads out (median ~0.6) and p-min
#: really cuts drafts; at the default scale the head is ~100% sure of every token.
SOFT_LOGIT_SCALE = 8.0


@dataclass
class Subject:
    """An engine plus the plain-greedy continuation of :data:`PROMPT` on its model."""

    engine: SpeculativeEngine
    reference: list[int]


#: Rows that cost next to nothing (a GPU's shape): every draft the drafter believes in pays,
#: so an exactness check really speculates however busy the host is (a curve timed under
#: the suite's own load once made a cost-gated drafter decline every draft).
CHEAP_ROWS = CostCurve({1: 1.0, 2: 1.02, 4: 1.04, 8: 1.08, 16: 1.16, 32: 1.32})


def open_engine(model: Path, method: SpecMethod, draft_max: int = N_MAX,
                n_ctx: int = N_CTX, row_costs: CostCurve | None = None) -> SpeculativeEngine:
    """An engine on ``model`` loaded for ``method``; ``row_costs`` prices its rows (None:
    timed on this host, as a worker does)."""
    capacity = EngineCapacity(method=method, draft_max=draft_max)
    return SpeculativeEngine(EngineConfig(str(model), n_ctx=n_ctx, n_threads=1,
                                          capacity=capacity, row_costs=row_costs))


def subject(model: Path, method: SpecMethod) -> Iterator[Subject]:
    """An engine drafting with ``method`` on ``model`` (rows priced :data:`CHEAP_ROWS`), and
    its greedy reference."""
    with open_engine(model, method, row_costs=CHEAP_ROWS) as engine:
        yield Subject(engine, greedy(engine, TOKENS))


def subject_fixture(model: str, method: SpecMethod,
                    scope: Literal["session", "module"] = "session") -> Any:
    """A fixture yielding :func:`subject` of ``method`` on the model fixture ``model``."""
    @pytest.fixture(scope=scope)
    def fixture(request: pytest.FixtureRequest) -> Iterator[Subject]:
        yield from subject(request.getfixturevalue(model), method)
    return fixture


hybrid_mtp = subject_fixture("hybrid_model", SpecMethod.MTP)
dense_ngram = subject_fixture("dense_model", SpecMethod.NGRAM)


@pytest.fixture(scope="session")
def soft_hybrid_mtp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Subject]:
    path = write_qwen35_hybrid(tmp_path_factory.mktemp("soft") / "soft-qwen35-mtp.gguf",
                               strengths=Strengths(logit_scale=SOFT_LOGIT_SCALE))
    yield from subject(path, SpecMethod.MTP)


@pytest.fixture(scope="module")
def byte_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The dense and the MTP hybrid tiny models, with the byte-level vocabulary."""
    d = tmp_path_factory.mktemp("byte-vocab")
    return {"dense": write_dense_llama(d / "dense-bytes.gguf", byte_vocab=True),
            "hybrid": write_qwen35_hybrid(d / "hybrid-bytes.gguf", byte_vocab=True),
            "soft": write_qwen35_hybrid(d / "soft-bytes.gguf", byte_vocab=True,
                                        strengths=Strengths(logit_scale=8.0))}


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or of the shorter end), None when equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


def assert_consistent(result: GenerationResult) -> None:
    """The telemetry invariants every generation must satisfy, whatever the drafter."""
    t: Telemetry = result.telemetry
    assert t.generated_tokens == len(result.tokens)
    assert 0 <= t.accepted <= t.drafted
    assert sum(t.accepted_per_position) == t.accepted
    assert sum(t.drafted_per_position) == t.drafted
    assert len(t.drafted_per_position) <= max(t.draft_max, 0)
    # Position i can only be accepted where it was drafted and position i-1 was accepted.
    for i, (acc, dr) in enumerate(zip(t.accepted_per_position, t.drafted_per_position,
                                      strict=False)):
        assert acc <= dr
        if i:
            assert acc <= t.accepted_per_position[i - 1]
    assert t.acceptance == pytest.approx(t.accepted / t.drafted if t.drafted else 0.0)
    assert t.tokens_per_verify == pytest.approx(t.generated_tokens / t.target_decodes)
    # Each verify commits its accepted drafts plus one token (minus what a limit cut off).
    assert t.generated_tokens <= t.accepted + t.target_decodes
    assert t.tokens_per_second >= t.effective_tokens_per_second > 0
    assert t.wall_seconds >= t.decode_seconds + t.draft_seconds
    # The host's share of the steps: drafting is host work, the verify's decode is not.
    assert t.draft_seconds <= t.host_seconds <= t.wall_seconds
    assert t.host_seconds_per_token == pytest.approx(t.host_seconds / t.generated_tokens)
    assert t.prompt_tokens == len(PROMPT)
