"""The embedding context beside the target: inputs pooled into unit vectors, as many a decode
as its cells and sequences hold, repeated inputs decoded once, on the real tiny model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from worker.engine.config import EMBEDDING_SEQS, EngineConfig, embedding_spec
from worker.engine.embedding import Embedder
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
    """64 cells: inputs of 40 and 30 tokens go in two decodes, each vector the one the input
    gets alone; 70 one-token inputs fill the 64 sequences of one decode."""
    first, second = list(range(2, 42)), list(range(50, 80))
    alone = [embedder.embed_next([first])[0], embedder.embed_next([second])[0]]
    taken = embedder.embed_next([first, second])
    assert len(taken) == 1 and (taken[0] == alone[0]).all()
    assert (embedder.embed_next([second, first])[0] == alone[1]).all()
    singles = [[t] for t in range(100, 170)]
    assert len(embedder.embed_next(singles)) == EMBEDDING_SEQS


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
