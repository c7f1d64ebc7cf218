"""Tiny seeded GGUF models that llama.cpp loads: the project's own test and bench models.

No small real model with an MTP head can be downloaded, so tests write their own: a dense
``llama`` (KV cache only), a hybrid ``qwen35`` (gated delta-net + attention) with one NextN
(MTP) layer, the same hybrid without its head (the "no MTP head" path), and a ``gemma3`` with
interleaved sliding-window attention (Gemma 3 270M's layout, in miniature). All are F32 with
llama.cpp's built-in dummy tokenizer (``tok_0 .. tok_255``); tests drive token ids directly.
Weights follow :mod:`worker.testmodels.recipe` so that speculation is non-trivial.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from worker.testmodels.recipe import CONST_DIM, SCRATCH, Dims, Recipe, Strengths

DEFAULT_STRENGTHS = Strengths()
#: Gemma's switch sits in a post-normed block, where its on/off mix flips the argmax over a
#: wider band of the probe than on the pre-norm models: a steeper gate narrows it and a higher
#: threshold keeps greedy text out of it (prompts whose greedy text comes within 2 logits of a
#: tie, of 20: 8 with the defaults, 1 with these, as on the dense model).
SWA_STRENGTHS = Strengths(gate=200.0, threshold=1.5)

CONTEXT_LENGTH = 4096
RMS_EPS = 1e-6
ROPE_BASE = 10000.0

DENSE_LAYERS = 2
HYBRID_LAYERS = 4
FULL_ATTENTION_INTERVAL = 2  # delta-net at layers 0 and 2, attention at 1 and 3
HYBRID_ROPE_DIMS = 16
HYBRID_ROPE_SECTIONS = (3, 3, 2, 0)
SSM_CONV_KERNEL = 4
SSM_STATE = 16
SSM_GROUPS = 2
SSM_HEADS = 4  # time_step_rank: number of value heads
SWA_LAYERS = 6  # gemma3's default pattern: 5 sliding-window layers, then 1 global (layer 5)
SWA_WINDOW = 32
#: Per layer, the two attention heads' offsets (tokens back). Offsets 0-3 win by the widest
#: margins; four sliding-window heads aim beyond the window (100, 212, 377, 370 back), fall
#: back to 0, 11, 19 and 12 back inside it, and the window-less twin does not (offset 100:
#: 56 back at position 60, 100 from position 100 on).
SWA_OFFSETS = ((1, 2), (3, 100), (212, 1), (377, 2), (370, 3), (1, 3))
#: ``attn_q_norm``/``attn_k_norm`` weight: each RoPE pair adds 2 w^2 / sqrt(head_dim) = 141 x
#: cos(...) to a score, so the smallest margin (0.255 of a pair, the offset-100 head) is ~36.
ATTENTION_NORM = 20.0

Tensors = Iterator[tuple[str, np.ndarray]]


@dataclass(frozen=True)
class TinyModels:
    """Paths of the four tiny models built by :func:`build_tiny_models`."""

    dense: Path
    hybrid: Path
    headless: Path
    swa: Path


def build_tiny_models(directory: Path, seed: int = 0) -> TinyModels:
    """Write all tiny models into ``directory`` (created if needed) and return their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    return TinyModels(
        dense=write_dense_llama(directory / "tiny-dense-llama.gguf", seed),
        hybrid=write_qwen35_hybrid(directory / "tiny-qwen35-mtp.gguf", seed),
        headless=write_qwen35_hybrid(directory / "tiny-qwen35-headless.gguf", seed, mtp=False),
        swa=write_gemma3_swa(directory / "tiny-gemma3-swa.gguf", seed),
    )


#: The chat variant's turn markers: control tokens (so only a template, never user text, can
#: produce them) whose names llama.cpp does not take for end-of-generation tokens.
CHAT_START = "<|sf_start|>"
CHAT_END = "<|sf_end|>"
CHAT_TOKENS = {CHAT_START: 253, CHAT_END: 254}
#: A ChatML-like template over those markers (``tokenizer.chat_template`` of the chat variant);
#: a turn's ``name``, when it has one, follows its role (as some models' templates write it).
CHAT_TEMPLATE = (
    "{% for m in messages %}" + CHAT_START
    + "{{ m['role'] }}{{ (' ' + m['name']) if m['name'] is defined else '' }}\n{{ m['content'] }}"
    + CHAT_END + "\n{% endfor %}"
    "{% if add_generation_prompt %}" + CHAT_START + "assistant\n{% endif %}"
)


def write_dense_llama(path: Path, seed: int = 0, strengths: Strengths = DEFAULT_STRENGTHS,
                      chat: bool = False, byte_vocab: bool = False) -> Path:
    """Write a 2-layer F32 ``llama`` model (about 430 KB); same seed, same bytes.

    ``chat`` adds a chat template and makes its two turn markers control tokens; the weights
    stay the same, so greedy token ids do too (only those two ids detokenize to nothing).
    """
    recipe = Recipe(seed, strengths=strengths)
    d = recipe.dims
    writer = _writer(path, "llama", d, n_blocks=DENSE_LAYERS, chat=chat, byte_vocab=byte_vocab)
    writer.add_rope_dimension_count(d.head_dim)  # must equal the head size ("invalid n_rot")
    _add_tensors(writer, _skeleton(recipe))
    for il in range(DENSE_LAYERS):
        _add_tensors(writer, _dense_block(recipe, il))
    _finish(writer)
    return path


def write_qwen35_hybrid(
    path: Path, seed: int = 0, mtp: bool = True, strengths: Strengths = DEFAULT_STRENGTHS,
    byte_vocab: bool = False,
) -> Path:
    """Write a 4-layer F32 ``qwen35`` hybrid, plus one NextN (MTP) layer when ``mtp``.

    With ``mtp=False`` the trunk is byte-for-byte the same weights, only the head is missing.
    """
    recipe = Recipe(seed, strengths=strengths)
    d = recipe.dims
    writer = _writer(path, "qwen35", d, n_blocks=HYBRID_LAYERS + int(mtp), byte_vocab=byte_vocab)
    writer.add_key_length(d.head_dim)
    writer.add_value_length(d.head_dim)
    writer.add_rope_dimension_count(HYBRID_ROPE_DIMS)
    writer.add_rope_dimension_sections(list(HYBRID_ROPE_SECTIONS))
    writer.add_ssm_conv_kernel(SSM_CONV_KERNEL)
    writer.add_ssm_state_size(SSM_STATE)
    writer.add_ssm_group_count(SSM_GROUPS)
    writer.add_ssm_time_step_rank(SSM_HEADS)
    writer.add_ssm_inner_size(SSM_STATE * SSM_HEADS)
    writer.add_full_attention_interval(FULL_ATTENTION_INTERVAL)
    if mtp:
        writer.add_nextn_predict_layers(1)
    _add_tensors(writer, _skeleton(recipe))
    for il in range(HYBRID_LAYERS):
        is_attention = (il + 1) % FULL_ATTENTION_INTERVAL == 0
        mixer = _gated_attention(recipe, il) if is_attention else _delta_net(recipe, il)
        _add_tensors(writer, mixer)
        _add_tensors(writer, _qwen35_ffn(recipe, il, switch=il == HYBRID_LAYERS - 1))
    if mtp:
        _add_tensors(writer, _nextn_block(recipe, HYBRID_LAYERS))
    _finish(writer)
    return path


def write_gemma3_swa(path: Path, seed: int = 0, window: int = SWA_WINDOW,
                     strengths: Strengths = SWA_STRENGTHS) -> Path:
    """Write a 6-layer F32 ``gemma3`` with a ``window``-token sliding window on layers 0-4.

    Layer 5 attends globally, as every sixth layer of Gemma 3 does, so a context with
    ``swa_full=False`` keeps two caches: a full one for layer 5 and a window-sized one whose
    old cells are overwritten, the case prefix reuse and rollback must get right on Gemma.
    With the default window, one decode of a sequence and one decode per token give the same
    logits (to ~1e-5; see :func:`_gemma3_block`); a wider window is the same weights, whose
    far-aiming heads then win by under one logit at some positions: not batch-invariant.

    Attention here is by position, not by query gain, so ``strengths.sharpness`` has no
    meaning for this model and a value other than the default is refused.
    """
    if window < 1:  # llama.cpp reads 0 as "no sliding window": a different model, silently
        raise ValueError(f"window must be at least 1 token, got {window}")
    if strengths.sharpness != DEFAULT_STRENGTHS.sharpness:
        raise ValueError(f"strengths.sharpness is not used by the gemma3 model (attention is "
                         f"by position, sized by ATTENTION_NORM), got {strengths.sharpness}")
    recipe = Recipe(seed, strengths=strengths)
    d = recipe.dims
    writer = _writer(path, "gemma3", d, n_blocks=SWA_LAYERS)
    writer.add_key_length(d.head_dim)
    writer.add_value_length(d.head_dim)
    writer.add_rope_dimension_count(d.head_dim)
    writer.add_sliding_window(window)
    writer.add_rope_freq_base_swa(ROPE_BASE)
    _add_tensors(writer, _skeleton(recipe))
    for il in range(SWA_LAYERS):
        _add_tensors(writer, _gemma3_block(recipe, il))
    _finish(writer)
    return path


# -- GGUF plumbing ---------------------------------------------------------------------------
def byte_pieces() -> list[str]:
    """GPT-2's byte-level alphabet: one printable character per byte, so a BPE vocabulary of
    these 256 pieces (no merges) spells every byte string one token per byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


#: The byte-level variant's end-of-sequence token: id 255, whose byte (0xFF) no UTF-8 text has.
BYTE_EOS = 255


def _writer(path: Path, arch: str, d: Dims, n_blocks: int, chat: bool = False,
            byte_vocab: bool = False) -> gguf.GGUFWriter:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"specfleet tiny {arch}")
    writer.add_context_length(CONTEXT_LENGTH)
    writer.add_embedding_length(d.n_embd)
    writer.add_block_count(n_blocks)
    writer.add_feed_forward_length(d.n_ff)
    writer.add_head_count(d.n_head)
    writer.add_head_count_kv(d.n_head_kv)
    writer.add_layer_norm_rms_eps(RMS_EPS)
    writer.add_rope_freq_base(ROPE_BASE)
    writer.add_vocab_size(d.n_vocab)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    if byte_vocab:  # a real byte-level BPE tokenizer: text (JSON, grammars) round-trips
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        tokens = byte_pieces()
        # llama.cpp needs a merges list; this one pairs byte 0xFE with itself, which UTF-8
        # text never holds, so every text stays one token per byte.
        writer.add_token_merges([f"{tokens[0xFE]} {tokens[0xFE]}"])
        tokens[BYTE_EOS] = "<|eos|>"
        writer.add_token_types([gguf.TokenType.CONTROL if i == BYTE_EOS else
                                gguf.TokenType.NORMAL for i in range(d.n_vocab)])
        writer.add_eos_token_id(BYTE_EOS)
        writer.add_token_list(tokens)
        writer.add_token_scores([0.0] * d.n_vocab)
        return writer
    # llama.cpp's built-in dummy tokenizer: no merges, no special tokens needed.
    writer.add_tokenizer_model("test")
    tokens = [f"tok_{i}" for i in range(d.n_vocab)]
    if chat:
        for text, token in CHAT_TOKENS.items():
            tokens[token] = text
        writer.add_token_types([gguf.TokenType.CONTROL if t in CHAT_TOKENS else
                                gguf.TokenType.NORMAL for t in tokens])
        writer.add_chat_template(CHAT_TEMPLATE)
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * d.n_vocab)
    return writer


def _add_tensors(writer: gguf.GGUFWriter, tensors: Tensors) -> None:
    for name, array in tensors:
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))


def _finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# -- blocks (names and shapes as llama.cpp's loaders require them) ---------------------------
def _skeleton(r: Recipe) -> Tensors:
    yield "token_embd.weight", r.token_embd()
    yield "output_norm.weight", r.ones(r.dims.n_embd)
    yield "output.weight", r.output()


def _dense_block(r: Recipe, il: int) -> Tensors:
    d, p = r.dims, f"blk.{il}"
    yield f"{p}.attn_norm.weight", r.ones(d.n_embd)
    yield _query(r, p, d.n_head * d.head_dim)
    yield from _kvo(r, p)
    yield f"{p}.ffn_norm.weight", r.ones(d.n_embd)
    yield from _ffn(r, p, switch=il == DENSE_LAYERS - 1)


def _query(r: Recipe, p: str, rows: int) -> tuple[str, np.ndarray]:
    return f"{p}.attn_q.weight", r.matrix(f"{p}.q", rows, r.dims.n_embd, r.strengths.sharpness)


def _kvo(r: Recipe, p: str) -> Tensors:
    d = r.dims
    yield f"{p}.attn_k.weight", r.matrix(f"{p}.k", d.n_head_kv * d.head_dim, d.n_embd,
                                         r.strengths.sharpness)
    yield f"{p}.attn_v.weight", r.matrix(f"{p}.v", d.n_head_kv * d.head_dim, d.n_embd)
    yield f"{p}.attn_output.weight", r.to_scratch(f"{p}.o", d.n_head * d.head_dim)


def _ffn(r: Recipe, p: str, switch: bool) -> Tensors:
    """The last trunk block's feed-forward is the recipe's switch; others write context."""
    d = r.dims
    if switch:
        gate, up, down = r.switch(f"{p}.switch")
    else:
        gate = r.matrix(f"{p}.gate", d.n_ff, d.n_embd, 2.0)
        up = r.matrix(f"{p}.up", d.n_ff, d.n_embd)
        down = r.to_scratch(f"{p}.down", d.n_ff)
    yield f"{p}.ffn_gate.weight", gate
    yield f"{p}.ffn_up.weight", up
    yield f"{p}.ffn_down.weight", down


def _qwen35_ffn(r: Recipe, il: int, switch: bool) -> Tensors:
    p = f"blk.{il}"
    yield f"{p}.attn_norm.weight", r.ones(r.dims.n_embd)
    yield f"{p}.post_attention_norm.weight", r.ones(r.dims.n_embd)
    yield from _ffn(r, p, switch)


def _gated_attention(r: Recipe, il: int) -> Tensors:
    """Qwen3.5 attention: ``attn_q`` holds query and output gate together."""
    d = r.dims
    yield from _normed_attention(r, f"blk.{il}", 2 * d.n_head * d.head_dim)


def _normed_attention(r: Recipe, p: str, query_rows: int) -> Tensors:
    """Attention whose q and k are RMS-normalised per head (qwen35, gemma3): there the norm
    weights, not the projections' gain, set the sharpness."""
    d = r.dims
    yield _query(r, p, query_rows)
    yield f"{p}.attn_q_norm.weight", r.ones(d.head_dim) * r.strengths.sharpness
    yield f"{p}.attn_k_norm.weight", r.ones(d.head_dim)
    yield from _kvo(r, p)


def _gemma3_block(r: Recipe, il: int) -> Tensors:
    """Gemma 3's block, built to be batch-invariant: pre- and post-norms around attention and
    feed-forward.

    The post-norms fix the size of what each half adds to the residual stream (of RMS
    sqrt(n_embd), Gemma's embedding scale), so their weights, not the projections, size the
    context writers and the switch; the switch is the post-normed kind (see Recipe.switch).
    Every matrix before the switch's output is :meth:`Recipe.sparse` (one weight per row, or
    two for the switch's gate) and attention is by position only (:func:`_offset_attention`),
    so batched and one-token decodes agree bit for bit up to the output layer: dense random
    matrices here let batch-width rounding cross F16 boundaries (the K/V cache, ggml's GELU
    table) and moved logits by up to 60 (docs/test-models.md, "Batch invariance").
    """
    d, p = r.dims, f"blk.{il}"
    stream_rms = float(np.sqrt(d.n_embd))
    switch = il == SWA_LAYERS - 1
    yield f"{p}.attn_norm.weight", r.ones(d.n_embd)
    yield from _offset_attention(r, p, SWA_OFFSETS[il])
    yield f"{p}.post_attention_norm.weight", r.context_post_norm(stream_rms)
    yield f"{p}.ffn_norm.weight", r.ones(d.n_embd)
    if switch:
        probe_dim = int(r.rng(f"{p}.switch.probe").integers(d.n_embd - CONST_DIM - 1))
        gate, up, down = r.switch(f"{p}.switch", post_normed=True, probe_dim=probe_dim)
    else:
        gate, up, down = _sparse_ffn(r, p)
    yield f"{p}.ffn_gate.weight", gate
    yield f"{p}.ffn_up.weight", up
    yield f"{p}.ffn_down.weight", down
    yield f"{p}.post_ffw_norm.weight", (r.switch_post_norm(stream_rms) if switch
                                        else r.context_post_norm(stream_rms))


def _offset_attention(r: Recipe, p: str, offsets: tuple[int, int]) -> Tensors:
    """Attention whose scores depend on position only: head h peaks ``offsets[h]`` tokens back.

    Queries and keys read only the constant dimension, so after ``attn_q_norm``/``attn_k_norm``
    each is one fixed vector; RoPE (NEOX pairs ``(i, i + 16)``) turns the score into
    ``S * sum_i cos(theta_i * (delta - offset))``: the key is 1 in every pair and the query is
    turned back by ``theta_i * offset``. ``S`` (the norm weights) makes the best visible cell
    win by a wide margin at every position (see :data:`ATTENTION_NORM`), so softmax is one-hot
    in F32 and in the F16 accumulator of ggml's CPU flash attention alike: the output is that
    cell's V exactly. An offset beyond the window makes the sliding-window head fall back to
    a fixed cell inside it, so the window changes what the model sees.
    """
    d = r.dims
    half = d.head_dim // 2
    theta = ROPE_BASE ** (-np.arange(half) / half)
    q = np.zeros((d.n_head * d.head_dim, d.n_embd))
    for h, offset in enumerate(offsets):
        q[h * d.head_dim:h * d.head_dim + half, CONST_DIM] = np.cos(theta * offset)
        q[h * d.head_dim + half:(h + 1) * d.head_dim, CONST_DIM] = -np.sin(theta * offset)
    k = np.zeros((d.n_head_kv * d.head_dim, d.n_embd))
    k[:half, CONST_DIM] = 1.0
    v_sources = r.rng(f"{p}.v.sources").choice(
        np.delete(np.arange(d.n_embd), CONST_DIM), d.head_dim, replace=False)
    n_scratch = d.n_embd - CONST_DIM - 1
    o_sources = r.rng(f"{p}.o.sources").choice(d.n_head * d.head_dim, n_scratch, replace=False)
    yield f"{p}.attn_q.weight", q.astype(np.float32)
    yield f"{p}.attn_q_norm.weight", r.ones(d.head_dim) * ATTENTION_NORM
    yield f"{p}.attn_k_norm.weight", r.ones(d.head_dim) * ATTENTION_NORM
    yield f"{p}.attn_k.weight", k.astype(np.float32)
    yield f"{p}.attn_v.weight", r.sparse(f"{p}.v", d.head_dim, d.n_embd,
                                         np.arange(d.head_dim), v_sources)
    yield f"{p}.attn_output.weight", r.sparse(f"{p}.o", d.n_embd, d.n_head * d.head_dim,
                                              np.arange(d.n_embd)[SCRATCH], o_sources)


def _sparse_ffn(r: Recipe, p: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A context writer of one GELU-gated product of two stream dimensions per scratch
    dimension (the other units stay zero): a nonlinear record of the context, and sparse."""
    d = r.dims
    n_scratch = d.n_embd - CONST_DIM - 1
    units = np.arange(n_scratch)
    readable = np.delete(np.arange(d.n_embd), CONST_DIM)
    rng = r.rng(f"{p}.ffn.sources")
    gate = r.sparse(f"{p}.gate", d.n_ff, d.n_embd, units, rng.choice(readable, n_scratch), 2.0)
    up = r.sparse(f"{p}.up", d.n_ff, d.n_embd, units, rng.choice(readable, n_scratch))
    down = r.sparse(f"{p}.down", d.n_embd, d.n_ff, np.arange(d.n_embd)[SCRATCH], units)
    return gate, up, down


def _delta_net(r: Recipe, il: int) -> Tensors:
    d, p = r.dims, f"blk.{il}"
    key_dim = SSM_STATE * SSM_GROUPS
    value_dim = SSM_STATE * SSM_HEADS
    conv_dim = 2 * key_dim + value_dim
    yield f"{p}.attn_qkv.weight", r.matrix(f"{p}.qkv", conv_dim, d.n_embd)
    yield f"{p}.attn_gate.weight", r.matrix(f"{p}.z", value_dim, d.n_embd)
    yield f"{p}.ssm_conv1d.weight", r.matrix(f"{p}.conv", conv_dim, SSM_CONV_KERNEL)
    yield f"{p}.ssm_dt.bias", r.vector(f"{p}.dt", SSM_HEADS, 0.0, 0.5)
    yield f"{p}.ssm_a", -np.abs(r.vector(f"{p}.a", SSM_HEADS, 1.0, 0.3))  # decay: negative
    yield f"{p}.ssm_beta.weight", r.matrix(f"{p}.beta", SSM_HEADS, d.n_embd)
    yield f"{p}.ssm_alpha.weight", r.matrix(f"{p}.alpha", SSM_HEADS, d.n_embd)
    yield f"{p}.ssm_norm.weight", r.ones(SSM_STATE)
    yield f"{p}.ssm_out.weight", r.to_scratch(f"{p}.out", value_dim)


def _nextn_block(r: Recipe, il: int) -> Tensors:
    """The MTP layer: passes the token embedding through and has no switch: it predicts perm.

    Its input is concat(enorm(token embedding), hnorm(target hidden state)); the hidden state
    only reaches scratch, where it shapes the block's attention but not its prediction.
    """
    d, p = r.dims, f"blk.{il}"
    eh_proj = np.concatenate(
        [np.eye(d.n_embd, dtype=np.float32), r.to_scratch(f"{p}.eh_hidden", d.n_embd)], axis=1
    )
    eh_proj[SCRATCH, : d.n_embd] = 0.0
    yield f"{p}.nextn.eh_proj.weight", eh_proj
    yield f"{p}.nextn.enorm.weight", r.ones(d.n_embd)
    yield f"{p}.nextn.hnorm.weight", r.ones(d.n_embd)
    yield from _gated_attention(r, il)
    yield from _qwen35_ffn(r, il, switch=False)
