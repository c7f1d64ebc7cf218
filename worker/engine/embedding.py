"""Embeddings: inputs pooled into unit vectors by an embedding context beside the target.

The context is llama.cpp's embeddings mode over the engine's own loaded model: the weights
are shared, only its KV cells and buffers are its own, sized by
``EngineConfig.embedding_tokens`` (:func:`~worker.engine.config.embedding_spec`) and counted
by the fitter as ``embeddings``. It is created once at the worker's start, so a worker that
cannot hold it never starts serving instead of failing its first embedding request.

An input's vector is the same bits whatever else is pending (batch invariance), on the CPU.
Each input is a sequence of its own, whichever jobs the inputs come from (the serving loop
hands over every pending input of the worker's embedding jobs, in order), and the cells are
cleared after each decode, so no input attends to another's; but llama.cpp picks its kernels
by the decode's shape, and on a quantized model a kernel's other rounding grows through the
layers (Gemma 3 270M Q4_K_M, one decode pooling all pending inputs: a short text's cosine
with itself down to 0.9965). So the decode an input is pooled in has a shape that follows
from the input alone:

- an input of :data:`SHARED_INPUT_TOKENS` tokens or more is decoded alone: one decode per
  input costs about what a shared decode does per row from 8 rows up (6 ms a row on Gemma
  270M, most of it the logits llama.cpp computes for every row even in embeddings mode);
- shorter inputs share decodes of at most :func:`shared_rows` rows, padded with a filler
  sequence (token 0, never read) to a multiple of :func:`pooling_lanes` rows, at least one
  filler row. Each condition keeps every decode in one kernel class (``bench/row_classes.py``
  found them): from 8 rows up the weights' products give a row the same bits at any width
  (below, 1, 2-3, 4 and 5 rows each round their own way); under 64 rows the CPU's flash
  attention skips the cells an input does not see, where from 64 up its tiled path sums
  them by tiles that depend on where the input's cells sit; and the mean pooling, a product
  over the decode's rows, takes llama.cpp's F32 kernel (tinyBLAS) only for two sequences or
  more and a multiple of its vector width, whose per-lane sums and butterfly reduction are
  then the same at whatever row an input starts (a plain dot product otherwise, whose tail
  rounds with the row count).

The price: a single input under 8 tokens is decoded at 8 rows (AVX2), and many inputs take
decodes of at most :func:`shared_rows` rows instead of the context's width (llama.cpp's
per-row cost falls by about a fifth at 512 rows); docs/http.md, "Embeddings", has the
figures. Identical inputs in one decode are decoded once and share their vector.

Vectors are scaled to unit L2 length, as OpenAI's are (a dot product is their cosine).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

import llama_cpp
import numpy as np

from shared.logs import get_logger
from worker.llm import Batch, Context, ContextSpec, Model

log = get_logger("engine")

#: Inputs of this many tokens or more are decoded alone; shorter ones share padded decodes.
#: The narrowest decode whose rows compute alike at every width up to :data:`TILED_ROWS`.
SHARED_INPUT_TOKENS = 8
#: Query rows from which the CPU's flash attention takes its tiled path (``GGML_FA_TILE_Q``).
TILED_ROWS = 64
#: The filler sequence's token: any id of any vocabulary; its rows are never read.
FILLER_TOKEN = 0


@cache
def pooling_lanes() -> int:
    """Floats in one vector of the CPU backend's F32 product: 16 with AVX-512, else 8
    (AVX/AVX2). A decode that shares inputs has a multiple of it as its row count."""
    info = llama_cpp.llama_print_system_info().decode(errors="replace")
    return 16 if "AVX512 = 1" in info else 8


def shared_rows() -> int:
    """The most rows of a decode that pools several inputs: the widest multiple of
    :func:`pooling_lanes` under :data:`TILED_ROWS` (56 on AVX2, 48 with AVX-512)."""
    return (TILED_ROWS - 1) // pooling_lanes() * pooling_lanes()


class Embedder:
    """A model's embedding context and the batch it decodes; :meth:`close` frees both (before
    the model is freed)."""

    def __init__(self, model: Model, spec: ContextSpec) -> None:
        if not spec.embeddings:
            raise ValueError("an Embedder needs an embedding context spec (embeddings=True)")
        self.spec = spec
        self.context = Context(model, spec)
        self._batch = Batch(spec.n_batch)
        self.dimensions = model.n_embd_out
        log.info("embedding.loaded", tokens=self.max_tokens, sequences=spec.n_seq_max,
                 pooling=model.pooling, dimensions=self.dimensions)

    @property
    def max_tokens(self) -> int:
        """The longest input, and the most tokens one decode pools."""
        return self.spec.n_batch

    def embed_next(self, pending: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Unit vectors (float32) of the leading inputs of ``pending`` that one decode holds:
        at least the first (``ValueError`` when even it cannot fit: admission refuses an
        input longer than :attr:`max_tokens` or empty). An input repeated among them is
        decoded once. Each vector is the one the input gets alone (the module's docstring
        says how): inputs under :data:`SHARED_INPUT_TOKENS` tokens share a padded decode, a
        longer one is decoded alone (with the repeats of it that follow it)."""
        first = tuple(pending[0]) if pending else ()
        if not first or len(first) > self.max_tokens:
            raise ValueError(f"an input of {len(first)} tokens cannot be embedded "
                             f"(1..{self.max_tokens} tokens)")
        rows = shared_rows()
        shared = len(first) < SHARED_INPUT_TOKENS
        sequences: dict[tuple[int, ...], int] = {}
        order: list[int] = []
        used = 0
        for tokens in pending:
            key = tuple(tokens)
            if key not in sequences:
                fits = (0 < len(key) < SHARED_INPUT_TOKENS and used + len(key) < rows
                        and len(sequences) + 1 < self.spec.n_seq_max)
                if sequences and not (shared and fits):
                    break
                sequences[key] = len(sequences)
                used += len(key)
            order.append(sequences[key])
        batch = self._batch.clear()
        for key, seq in sequences.items():
            batch.add(key, 0, True, seq=seq)
        if shared:
            lanes = pooling_lanes()
            batch.add([FILLER_TOKEN] * (used // lanes * lanes + lanes - used), 0, True,
                      seq=len(sequences))
        try:
            self.context.decode(batch)
            vectors = [_unit(self.context.pooled(seq)) for seq in range(len(sequences))]
        finally:
            self.context.clear()
        return [vectors[i] for i in order]

    def close(self) -> None:
        self._batch.close()
        self.context.close()


def _unit(vector: np.ndarray) -> np.ndarray:
    """``vector`` scaled to unit L2 length (in float64, then rounded to float32); an all-zero
    vector stays zero (it has no direction)."""
    wide = vector.astype(np.float64)
    norm = float(np.linalg.norm(wide))
    return (wide / norm if norm > 0.0 else wide).astype(np.float32)
