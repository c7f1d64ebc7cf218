"""The embedding context beside the target: inputs pooled into unit vectors, as many a decode
as its cells and sequences hold, repeated inputs decoded once, on the real tiny model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from worker.engine.config import EMBEDDING_SEQS, EngineConfig, embedding_spec
from worker.engine.embedding import SHARED_INPUT_TOKENS, Embedder, shared_rows
from worker.llm import Model, ModelSpec


@pytest.fixture(scope="module")
def embedder(dense_model: Path) -> Iterator[Embedder]:
    with Model(ModelSpec(str(dense_model))) as model:
        spec = embedding_spec(EngineConfig(model_path=str(dense_model), n_threads=1,
                                           embedding_tokens=EMBEDDING_SEQS))
        assert spec is not None
        embedder = Embedder(model, spec)
        try:
            yield embedder
        finally:
            embedder.close()


def test_a_decode_takes_the_leading_inputs_that_fit(embedder: Embedder) -> None:
    """Inputs of 40 and 30 tokens go in two decodes, each vector the one the input gets
    alone; one-token inputs fill a shared decode's rows but its filler's; an input too long
    to share one is decoded alone, with its repeats."""
    first, second = list(range(2, 42)), list(range(50, 80))
    alone = [embedder.embed_next([first])[0], embedder.embed_next([second])[0]]
    taken = embedder.embed_next([first, second])
    assert len(taken) == 1 and (taken[0] == alone[0]).all()
    assert (embedder.embed_next([second, first])[0] == alone[1]).all()
    singles = [[t] for t in range(100, 170)]
    assert len(embedder.embed_next(singles)) == shared_rows() - 1
    long = list(range(2, 2 + SHARED_INPUT_TOKENS))
    assert len(embedder.embed_next([long, long, [5], long])) == 2
    assert len(embedder.embed_next([[5], long])) == 1


def test_vectors_are_unit_length_and_repeats_share_one(embedder: Embedder) -> None:
    inputs = [[5, 6, 7], [9, 10], [5, 6, 7], [9, 10], [11]]
    vectors = embedder.embed_next(inputs)
    assert len(vectors) == 5 and all(v.dtype == np.float32 for v in vectors)
    assert np.allclose([np.linalg.norm(v.astype(np.float64)) for v in vectors], 1.0, atol=1e-6)
    assert (vectors[0] == vectors[2]).all() and (vectors[1] == vectors[3]).all()
    assert not np.allclose(vectors[0], vectors[1])
    # repeats take no cells: a 64-token input twice still fits one decode
    assert len(embedder.embed_next([list(range(2, 66))] * 2)) == 2


def test_an_input_past_the_context_is_refused(embedder: Embedder) -> None:
    with pytest.raises(ValueError, match="1..64 tokens"):
        embedder.embed_next([list(range(2, 67))])
    with pytest.raises(ValueError):
        embedder.embed_next([[]])


@pytest.fixture(scope="module")
def gemma_embedder(gemma_path: Path) -> Iterator[tuple[Model, Embedder]]:
    """Gemma 3 270M Q4_K_M, whose quantized kernels round by the decode's shape."""
    with Model(ModelSpec(str(gemma_path))) as model:
        spec = embedding_spec(EngineConfig(model_path=str(gemma_path), n_threads=2,
                                           embedding_tokens=128))
        assert spec is not None
        embedder = Embedder(model, spec)
        try:
            yield model, embedder
        finally:
            embedder.close()


def _embed_all(embedder: Embedder, inputs: list[list[int]]) -> list[np.ndarray]:
    """Every input's vector, decode after decode, as the serving loop takes them."""
    vectors: list[np.ndarray] = []
    while len(vectors) < len(inputs):
        vectors += embedder.embed_next(inputs[len(vectors):])
    return vectors


def test_a_vector_is_the_same_bits_whatever_shares_its_decode(
        gemma_embedder: tuple[Model, Embedder]) -> None:
    """On a quantized model (one decode pooling every pending input drifted a short text's
    cosine with itself to 0.9965): short and long texts, each alone and among texts of
    other lengths in three orders, get the same float32 vector."""
    model, embedder = gemma_embedder
    sentence = ("The fleet decodes tokens while Redis keeps every queue in memory, and each "
                "worker pools the inputs of its embedding jobs between two steps.")
    texts = [sentence[i:i + n] for i, n in ((0, 3), (4, 5), (10, 14), (30, 22), (0, 48),
                                            (20, 70), (5, 120), (50, 9), (60, 30), (1, 2))]
    inputs = [model.tokenize(t) for t in texts]
    assert min(map(len, inputs)) < SHARED_INPUT_TOKENS <= max(map(len, inputs))
    alone = [embedder.embed_next([tokens])[0] for tokens in inputs]
    for order in (list(range(len(inputs))), list(range(len(inputs)))[::-1],
                  sorted(range(len(inputs)), key=lambda i: (i * 7) % len(inputs))):
        together = _embed_all(embedder, [inputs[i] for i in order])
        for i, vector in zip(order, together, strict=True):
            assert np.array_equal(vector, alone[i]), (texts[i], float(vector @ alone[i]))
