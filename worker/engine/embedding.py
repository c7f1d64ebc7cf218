"""Embeddings: inputs pooled into unit vectors by an embedding context beside the target.

The context is llama.cpp's embeddings mode over the engine's own loaded model: the weights
are shared, only its KV cells and buffers are its own, sized by
``EngineConfig.embedding_tokens`` (:func:`~worker.engine.config.embedding_spec`) and counted
by the fitter as ``embeddings``. It is created once at the worker's start, so a worker that
cannot hold it never starts serving instead of failing its first embedding request.

One decode pools as many inputs as its cells and sequences hold, each input a sequence of its
own, whichever jobs they come from (the serving loop hands over every pending input of the
worker's embedding jobs, in order). The cells are cleared after each decode, so no input
attends to another's. An input's vector can still differ in the last bits with the decode it
shares (llama.cpp's kernels are chosen by the batch's shape): identical inputs in one decode
are decoded once and share their vector, so a request that repeats an input gets the same
vector for both.

Vectors are scaled to unit L2 length, as OpenAI's are (a dot product is their cosine).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from shared.logs import get_logger
from worker.llm import Batch, Context, ContextSpec, Model

log = get_logger("engine")


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
        decoded once."""
        sequences: dict[tuple[int, ...], int] = {}
        order: list[int] = []
        used = 0
        for tokens in pending:
            key = tuple(tokens)
            if key not in sequences:
                if (not key or len(sequences) == self.spec.n_seq_max
                        or used + len(key) > self.max_tokens):
                    break
                sequences[key] = len(sequences)
                used += len(key)
            order.append(sequences[key])
        if not order:
            raise ValueError(f"an input of {len(pending[0]) if pending else 0} tokens cannot "
                             f"be embedded (1..{self.max_tokens} tokens)")
        batch = self._batch.clear()
        for key, seq in sequences.items():
            batch.add(key, 0, True, seq=seq)
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
