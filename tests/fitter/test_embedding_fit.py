"""The fit counts a worker's embedding context (``--embeddings``) as llama.cpp allocates it,
and refuses one past the model's training context."""

from __future__ import annotations

import pytest

from shared.protocol import SpecMethod
from worker.engine.config import embedding_spec
from worker.engine.embedding import Embedder
from worker.fitter import FitError, fit_worker
from worker.fitter.buffers import parse_buffers
from worker.fitter.measure import output_bytes
from worker.launch import EngineCapacity
from worker.llm import Model, ModelSpec, capture_llama_log
from worker.testmodels import TinyModels

NGRAM = EngineCapacity(method=SpecMethod.NGRAM)


def test_the_embedding_context_is_fitted_as_llama_cpp_allocates_it(
        tiny_models: TinyModels) -> None:
    """Its KV and compute buffers as llama.cpp logs them when the worker creates it, and the
    output buffer as a decode of every row grows it; the fit's total is the rest plus it."""
    path = str(tiny_models.dense)
    plain = fit_worker(path, budget_mib=64, fit_target_mib=0, capacity=NGRAM, n_ctx=512)
    fit = fit_worker(path, budget_mib=64, fit_target_mib=0, capacity=NGRAM, n_ctx=512,
                     embedding_tokens=100)
    counted = fit.report.components["embeddings"]
    assert plain.report.components["embeddings"] == 0
    assert fit.report.total_bytes == plain.report.total_bytes + counted
    spec = embedding_spec(fit.config)
    assert spec is not None and spec.n_batch == 128  # rounded up to a multiple of 64
    with Model(ModelSpec(path)) as model:
        with capture_llama_log() as lines:
            Embedder(model, spec).close()
        logged = parse_buffers(lines)
        assert counted == (logged.total("kv_buffer") + logged.total("compute")
                           + output_bytes(model, spec, spec.n_batch, 0)) > 0


def test_an_embedding_context_past_training_is_refused(tiny_models: TinyModels) -> None:
    with pytest.raises(FitError, match=r"^--embeddings 4097 \(4160 tokens, a multiple of 64\) "
                                       r"exceeds the model's training context \(4096"):
        fit_worker(str(tiny_models.dense), budget_mib=64, fit_target_mib=0, capacity=NGRAM,
                   n_ctx=512, embedding_tokens=4097)
