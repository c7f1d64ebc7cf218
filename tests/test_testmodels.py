"""The project's test models load in real llama.cpp and behave as the rest of the suite assumes.

Other tests lean on these facts: the hybrid has an MTP head and its twin has none, the files
are reproducible, greedy margins are wide (so batch-width numerics cannot flip an argmax) and
speculation on them is non-trivial (full accepts and rejections both happen).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from shared.protocol import SpecMethod
from worker.engine.config import EngineCapacity
from worker.engine.engine import EngineConfig, SpeculativeEngine
from worker.llm import (
    Batch,
    Context,
    ContextSpec,
    LlamaError,
    Model,
    ModelSpec,
    capture_llama_log,
)
from worker.testmodels import TinyModels, write_dense_llama, write_qwen35_hybrid
from worker.testmodels.recipe import Recipe

PROMPTS = ([1, 2, 3], [10, 20, 30, 40, 50], [200, 7, 7, 99])
TINY = ("dense", "hybrid", "headless")


def greedy(path: Path, prompt: list[int], n: int) -> tuple[list[int], np.ndarray]:
    with Model(ModelSpec(str(path))) as model:
        return greedy_on(model, prompt, n)


def greedy_on(model: Model, prompt: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """Plain one-token-at-a-time greedy decoding: the tokens and each step's top-1/top-2 gap."""
    with Context(model, ContextSpec(n_ctx=512, n_batch=64, n_threads=2)) as ctx:
        batch = Batch(64)
        try:
            ctx.decode(batch.set(prompt, 0, logits=[False] * (len(prompt) - 1) + [True]))
            row, tokens, margins = len(prompt) - 1, [], []
            for pos in range(len(prompt), len(prompt) + n):
                logits = ctx.logits(row)
                top2 = np.partition(logits, -2)[-2:]
                margins.append(float(top2[1] - top2[0]))
                tokens.append(int(np.argmax(logits)))
                ctx.decode(batch.set(tokens[-1:], pos, logits=True))
                row = 0
        finally:
            batch.close()
    return tokens, np.array(margins)


@pytest.mark.parametrize("name", TINY)
def test_tiny_models_decode_deterministically(tiny_models: TinyModels, name: str) -> None:
    path = getattr(tiny_models, name)
    first, _ = greedy(path, [5, 6, 7], 12)
    second, _ = greedy(path, [5, 6, 7], 12)
    assert first == second
    assert all(0 <= t < 256 for t in first)


def test_hybrid_has_one_nextn_layer_and_its_twin_none(tiny_models: TinyModels) -> None:
    with Model(ModelSpec(str(tiny_models.hybrid), load_mtp=True)) as hybrid, \
            Model(ModelSpec(str(tiny_models.headless), load_mtp=True)) as headless:
        assert (hybrid.n_layer, hybrid.n_layer_nextn) == (4, 1)
        assert (headless.n_layer, headless.n_layer_nextn) == (4, 0)
        assert hybrid.is_recurrent and headless.is_recurrent
        with Context(hybrid, ContextSpec(n_ctx=256, n_batch=32, n_ubatch=32, mtp=True)):
            pass
        with pytest.raises(LlamaError):
            Context(headless, ContextSpec(n_ctx=256, n_batch=32, n_ubatch=32, mtp=True))


def test_rollback_snapshots_only_on_the_hybrid(tiny_models: TinyModels) -> None:
    for path, granted in ((tiny_models.hybrid, 3), (tiny_models.dense, 0)):
        with Model(ModelSpec(str(path))) as model, \
                Context(model, ContextSpec(n_ctx=256, n_rs_seq=3)) as ctx:
            assert ctx.n_rs_seq == granted


def test_headless_twin_has_the_hybrids_trunk(tiny_models: TinyModels) -> None:
    hybrid = {t.name: t for t in gguf.GGUFReader(tiny_models.hybrid).tensors}
    headless = gguf.GGUFReader(tiny_models.headless).tensors
    assert {t.name for t in headless} == {n for n in hybrid if not n.startswith("blk.4.")}
    for tensor in headless:
        assert np.array_equal(tensor.data, hybrid[tensor.name].data), tensor.name


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path: Path) -> None:
    for write in (write_dense_llama, write_qwen35_hybrid):
        a = write(tmp_path / "a.gguf", 3).read_bytes()
        b = write(tmp_path / "b.gguf", 3).read_bytes()
        c = write(tmp_path / "c.gguf", 4).read_bytes()
        assert a == b
        assert a != c and len(a) == len(c)
        assert len(a) < 1_100_000


@pytest.mark.parametrize("name", ["dense", "hybrid"])
def test_greedy_has_wide_margins_and_leaves_the_permutation_sometimes(
    tiny_models: TinyModels, name: str
) -> None:
    """Margins far above F32 batch-width noise; the MTP head's guess (perm) often but not
    always right, which is what makes its acceptance non-trivial."""
    perm = Recipe(0).perm
    for prompt in PROMPTS:
        tokens, margins = greedy(getattr(tiny_models, name), prompt, 300)
        assert margins.min() > 0.5, (prompt, margins.min())
        previous = [prompt[-1], *tokens[:-1]]
        follows = np.mean([perm[a] == b for a, b in zip(previous, tokens, strict=True)])
        assert 0.4 < follows < 0.95, (prompt, follows)


def _spec_telemetry(path: Path, method: SpecMethod, width: int) -> list:
    config = EngineConfig(str(path), n_ctx=512,
                          capacity=EngineCapacity(method=method, draft_max=width))
    with SpeculativeEngine(config) as engine:
        return [engine.generate(p, 220).telemetry for p in PROMPTS[:2]]


def test_mtp_speculation_is_non_trivial(tiny_models: TinyModels) -> None:
    """At width 4: full accepts, rejections at the first draft and deeper rejections."""
    for t in _spec_telemetry(tiny_models.hybrid, SpecMethod.MTP, 4):
        assert 0.3 < t.acceptance < 0.85, t.acceptance
        drafted, accepted = t.drafted_per_position, t.accepted_per_position
        assert accepted[3] > 0  # full accepts
        assert drafted[0] > accepted[0]  # nothing accepted
        assert accepted[0] > accepted[3]  # partly accepted


@pytest.mark.parametrize("name", ["dense", "hybrid"])
def test_ngram_speculation_is_non_trivial(tiny_models: TinyModels, name: str) -> None:
    for t in _spec_telemetry(getattr(tiny_models, name), SpecMethod.NGRAM, 4):
        assert 0.2 < t.acceptance < 0.95, t.acceptance


@pytest.mark.gemma
def test_gemma_f16_copy_is_unquantized_and_decodes(gemma_f16_path: Path) -> None:
    # llama.cpp's loader reports the tensor types it found (gguf.GGUFReader takes ~30 s
    # here, parsing the 262k-token vocabulary).
    with capture_llama_log() as lines, Model(ModelSpec(str(gemma_f16_path))) as model:
        types = {line.split()[3].rstrip(":") for line in lines if " - type " in line}
        assert types == {"f16", "f32"}, types
        tokens, margins = greedy_on(model, model.tokenize("The capital of France is"), 8)
        text = model.detokenize(tokens)
    assert any(c.isalpha() for c in text), text
    assert np.all(np.isfinite(margins))
    assert np.median(margins) > 0.05  # not a degenerate (all-equal) distribution
    assert len(set(tokens)) > 2  # not stuck on one token
