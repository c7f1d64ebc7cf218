"""The project's test models load in real llama.cpp and behave as the rest of the suite assumes.

Other tests lean on these facts: the hybrid has an MTP head and its twin has none, the files
are reproducible, greedy margins are wide (so batch-width numerics cannot flip an argmax) and
speculation on them is non-trivial (full accepts and rejections both happen). The SWA model
really slides: its window changes the output, its cache drops old cells, and its SWA-only
state is the window's cells and restores exactly (what prefix reuse on Gemma relies on).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import gguf
import llama_cpp
import numpy as np
import pytest

from shared.protocol import SpecMethod
from worker.engine.engine import EngineConfig, SpeculativeEngine
from worker.launch import EngineCapacity
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
from worker.testmodels.recipe import Dims, Recipe, Strengths
from worker.testmodels.tiny import SWA_LAYERS, SWA_WINDOW, write_gemma3_swa

PROMPTS = ([1, 2, 3], [10, 20, 30, 40, 50], [200, 7, 7, 99])
TINY = ("dense", "hybrid", "headless", "swa")
SWA_ONLY = llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
#: A context whose SWA cache is small: pad(min(n_ctx, n_swa + n_ubatch), 256) = 256 cells.
SWA_CONTEXT = ContextSpec(n_ctx=1024, n_batch=32, n_ubatch=32, n_threads=2)


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


def test_context_margins_are_each_tokens_lead_over_the_best_other(
        tiny_models: TinyModels) -> None:
    """``Context.margins`` (what the suffix drafter marks near-ties with) against numpy on
    the same rows of one batched decode: the argmax leads by the top-2 gap, the runner-up
    trails by it, and token 0 and the last id (the slices' edges) are handled."""
    prompt = [5, 6, 7, 8, 9, 10]
    with Model(ModelSpec(str(tiny_models.dense))) as model, \
            Context(model, ContextSpec(n_ctx=256, n_batch=32, n_threads=2)) as ctx:
        batch = Batch(32)
        try:
            ctx.decode(batch.set(prompt, 0, logits=True))
            rows = np.array([ctx.logits(i) for i in range(len(prompt))])
            order = np.argsort(rows, axis=1)
            best, second = order[:, -1].tolist(), order[:, -2].tolist()
            gaps = rows[np.arange(len(prompt)), best] - rows[np.arange(len(prompt)), second]
            assert ctx.margins(0, best) == pytest.approx(gaps.tolist())
            assert ctx.margins(0, second) == pytest.approx((-gaps).tolist())
            edges = [0, model.n_vocab - 1]
            expected = [float(rows[i, t] - np.delete(rows[i], t).max())
                        for i, t in enumerate(edges)]
            assert ctx.margins(0, edges) == pytest.approx(expected)
        finally:
            batch.close()


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
    for write in (write_dense_llama, write_qwen35_hybrid, write_gemma3_swa):
        a = write(tmp_path / "a.gguf", 3).read_bytes()
        b = write(tmp_path / "b.gguf", 3).read_bytes()
        c = write(tmp_path / "c.gguf", 4).read_bytes()
        assert a == b
        assert a != c and len(a) == len(c)
        assert len(a) < 1_100_000


@pytest.mark.parametrize("name", ["dense", "hybrid", "swa"])
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


@pytest.mark.parametrize("name", ["dense", "hybrid", "swa"])
def test_ngram_speculation_is_non_trivial(tiny_models: TinyModels, name: str) -> None:
    for t in _spec_telemetry(getattr(tiny_models, name), SpecMethod.NGRAM, 4):
        assert 0.2 < t.acceptance < 0.95, t.acceptance


def test_ngram_acceptance_on_a_repeated_block_prompt(swa_model: Path) -> None:
    """A prompt of one block four times over: the drafter finds the block's n-grams in it."""
    block = [int(t) for t in np.random.default_rng(7).integers(0, 256, 24)]
    config = EngineConfig(str(swa_model), n_ctx=512,
                          capacity=EngineCapacity(method=SpecMethod.NGRAM, draft_max=4))
    with SpeculativeEngine(config) as engine:
        acceptance = engine.generate(block * 4, 160).telemetry.acceptance
    assert acceptance > 0.2, acceptance


# -- the sliding-window model ------------------------------------------------------------------
def _feed(ctx: Context, batch: Batch, tokens: list[int], pos0: int) -> None:
    """Decode ``tokens`` at ``pos0..`` in batch-sized chunks, logits on every row."""
    for i in range(0, len(tokens), batch.capacity):
        ctx.decode(batch.set(tokens[i:i + batch.capacity], pos0 + i, logits=True))


def _swa_pos_min(ctx: Context, seq: int = 0) -> int:
    return int(llama_cpp.llama_memory_seq_pos_min(ctx.mem, seq))


def _tokens(n: int, seed: int = 1) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 256, n)]


def test_swa_greedy_stays_clear_of_ties_on_random_prompts(swa_model: Path) -> None:
    """Prefix-reuse and speculation tests compare token streams decoded in other shapes
    (chunks, verify widths), which agree only where the top-2 margin dwarfs F16-KV noise: on
    this model greedy text after arbitrary prompts keeps such margins, not only after PROMPTS."""
    rng = np.random.default_rng(11)
    prompts = [[int(t) for t in rng.integers(0, 256, int(rng.integers(3, 40)))]
               for _ in range(10)]
    with Model(ModelSpec(str(swa_model))) as model:
        smallest = [float(greedy_on(model, prompt, 150)[1].min()) for prompt in prompts]
    assert min(smallest) > 2.0, smallest


def _full_vs_incremental(ctx: Context, batch: Batch, tokens: list[int]) -> np.ndarray:
    """Per position, max |dlogit| between one decode of all ``tokens`` and one per token."""
    ctx.seq_clear(0)
    ctx.decode(batch.set(tokens, 0, logits=True))
    full = ctx.logits_rows(0, len(tokens)).copy()
    ctx.seq_clear(0)
    single = []
    for pos, token in enumerate(tokens):
        ctx.decode(batch.set([token], pos, logits=True))
        single.append(ctx.logits(0).copy())
    return np.abs(full - np.array(single)).max(axis=1)


def _greedy_conversation(ctx: Context, batch: Batch, docs: list[list[int]], first: int,
                         turns: int) -> list[int]:
    """A chat-like sequence: 40 tokens of one document, then ``turns`` times 24 greedy
    tokens followed by the next 8 tokens of the next document (a user's turn)."""
    text = docs[first][:40]
    for turn in range(turns):
        ctx.seq_clear(0)
        ctx.decode(batch.set(text, 0, logits=[False] * (len(text) - 1) + [True]))
        row, reply = len(text) - 1, []
        for pos in range(len(text), len(text) + 24):
            reply.append(int(np.argmax(ctx.logits(row))))
            ctx.decode(batch.set(reply[-1:], pos, logits=True))
            row = 0
        user = docs[(first + 1) % len(docs)][turn * 8:turn * 8 + 8]
        text = text + reply + user
    return text


def test_swa_full_batch_and_one_token_decodes_agree(swa_model: Path) -> None:
    """Prefix reuse and speculation decode positions in other shapes (a whole prompt at once,
    verify rows, one token at a time) than plain greedy and must reproduce it token for token:
    on this model one decode of a whole sequence and one-token decodes give the same logits to
    1e-3 at every position, along greedy conversations and random sequences longer than the
    window (the sparse, position-only recipe; dense weights moved them by up to 60)."""
    docs = [[int(t) for t in np.random.default_rng(100 + d).integers(0, 256, 160)]
            for d in range(3)]
    spec = ContextSpec(n_ctx=2048, n_batch=512, n_threads=2)
    with Model(ModelSpec(str(swa_model))) as model, Context(model, spec) as ctx:
        batch = Batch(spec.n_batch)
        try:
            sequences = [_greedy_conversation(ctx, batch, docs, first, turns=8)
                         for first in range(3)]
            sequences += [_tokens(400, seed) for seed in range(5)]
            worst = [float(_full_vs_incremental(ctx, batch, s).max()) for s in sequences]
        finally:
            batch.close()
    assert max(worst) < 1e-3, worst


def test_swa_model_has_its_window_and_one_global_layer(swa_model: Path, tmp_path: Path) -> None:
    with capture_llama_log() as lines, Model(ModelSpec(str(swa_model))) as model:
        assert llama_cpp.llama_model_n_swa(model.ptr) == SWA_WINDOW
        assert model.n_layer == SWA_LAYERS
        assert not model.is_recurrent
    swa_layers = [line for line in lines if "is_swa = 1" in line]
    global_layers = [line for line in lines if "is_swa = 0" in line and "layer   5" in line]
    assert len(swa_layers) == SWA_LAYERS - 1 and global_layers, lines
    other = write_gemma3_swa(tmp_path / "w16.gguf", window=16)
    with Model(ModelSpec(str(other))) as model:
        assert llama_cpp.llama_model_n_swa(model.ptr) == 16
    with pytest.raises(ValueError, match="window"):
        write_gemma3_swa(tmp_path / "w0.gguf", window=0)
    with pytest.raises(ValueError, match="sharpness"):
        write_gemma3_swa(tmp_path / "s2.gguf", strengths=Strengths(sharpness=2.0))


def test_the_window_changes_what_the_model_predicts(swa_model: Path, tmp_path: Path) -> None:
    """Equal to the same weights without a window while every token sees its whole context,
    different once the context outgrows the window: the window is not a label."""
    wide = write_gemma3_swa(tmp_path / "wide.gguf", window=4096)
    prompt = [1, 2, 3]
    windowed, _ = greedy(swa_model, prompt, 120)
    unwindowed, _ = greedy(wide, prompt, 120)
    inside = SWA_WINDOW - len(prompt)  # tokens predicted from at most SWA_WINDOW positions
    assert windowed[:inside] == unwindowed[:inside]
    assert windowed != unwindowed


def test_swa_cache_overwrites_cells_older_than_the_window(swa_model: Path) -> None:
    """With ``swa_full=False`` (the engine's setting) 600 tokens overflow the 256-cell SWA
    cache and its oldest positions are gone; a full-size SWA cache keeps them all."""
    tokens = _tokens(600)
    with Model(ModelSpec(str(swa_model))) as model:
        for swa_full, expected_min in ((False, 600 - 256), (True, 0)):
            with Context(model, SWA_CONTEXT.with_(swa_full=swa_full)) as ctx:
                batch = Batch(SWA_CONTEXT.n_batch)
                try:
                    _feed(ctx, batch, tokens, 0)
                finally:
                    batch.close()
                assert ctx.pos_max() == 599
                assert _swa_pos_min(ctx) == expected_min, swa_full


def test_batched_decode_matches_single_token_decodes(swa_model: Path) -> None:
    """A verify decodes k rows at once; each must be the row a one-token decode gives, to F32
    (and F16-KV) noise, far below the greedy margins, so batching never moves an argmax."""
    prompt = [1, 2, 3]
    k = 8
    with Model(ModelSpec(str(swa_model))) as model:
        generated, margins = greedy_on(model, prompt, 120)
        text = prompt + generated
        worst = 0.0
        for start in (20, 60, 100):  # inside, past and far past the window
            with Context(model, SWA_CONTEXT) as wide, Context(model, SWA_CONTEXT) as narrow:
                batch = Batch(SWA_CONTEXT.n_batch)
                try:
                    _feed(wide, batch, text[:start], 0)
                    wide.decode(batch.set(text[start:start + k], start, logits=True))
                    batched = wide.logits_rows(0, k).copy()
                    _feed(narrow, batch, text[:start], 0)
                    single = []
                    for i, token in enumerate(text[start:start + k]):
                        narrow.decode(batch.set([token], start + i, logits=True))
                        single.append(narrow.logits(0).copy())
                finally:
                    batch.close()
            assert np.array_equal(batched.argmax(axis=1), np.argmax(single, axis=1))
            worst = max(worst, float(np.abs(batched - np.array(single)).max()))
    assert worst < 1e-2, worst
    assert worst * 100 < margins.min(), (worst, margins.min())


def test_swa_state_is_the_window_and_restores_exactly(swa_model: Path) -> None:
    """The SWA-only state holds exactly the window's cells, whatever the length; restored after
    its cells were overwritten (and the rest trimmed with seq_rm) the next decode is the same,
    and without it the SWA layers see an empty window and the logits move."""
    tokens = _tokens(700)
    p = 300
    with Model(ModelSpec(str(swa_model))) as model, Context(model, SWA_CONTEXT) as ctx:
        d = Dims()  # a cell: K and V of every SWA layer, F16 (llama.cpp's default cache type)
        cell_bytes = (SWA_LAYERS - 1) * 2 * d.n_head_kv * d.head_dim * 2
        batch = Batch(SWA_CONTEXT.n_batch)
        try:
            _feed(ctx, batch, tokens[:200], 0)
            size_at_200 = ctx.state_size(SWA_ONLY)
            _feed(ctx, batch, tokens[200:p], 200)
            size = ctx.state_size(SWA_ONLY)
            assert size == size_at_200
            assert SWA_WINDOW * cell_bytes <= size < (SWA_WINDOW + 1) * cell_bytes, size
            assert size * 2 < ctx.state_size(0)  # the global layer's cells are not in it
            saved = (ctypes.c_uint8 * size)()
            assert ctx.state_save(saved, SWA_ONLY) == size

            ctx.decode(batch.set([tokens[p]], p, logits=True))
            reference = ctx.logits(0).copy()
            _feed(ctx, batch, tokens[p + 1:p + 300], p + 1)
            assert _swa_pos_min(ctx) > p  # the window before p is overwritten

            assert ctx.state_restore(saved, size, SWA_ONLY) == size
            assert _swa_pos_min(ctx) == p - SWA_WINDOW
            assert ctx.seq_rm(p, -1)
            ctx.decode(batch.set([tokens[p]], p, logits=True))
            assert float(np.abs(ctx.logits(0) - reference).max()) < 1e-4

            _feed(ctx, batch, tokens[p + 1:p + 300], p + 1)
            assert ctx.seq_rm(p, -1)  # no restore: the SWA cache has nothing left before p
            ctx.decode(batch.set([tokens[p]], p, logits=True))
            assert float(np.abs(ctx.logits(0) - reference).max()) > 0.1
        finally:
            batch.close()


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
