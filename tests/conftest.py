"""Model fixtures shared by every test: the tiny GGUFs are written once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.testmodels import TinyModels, build_tiny_models


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    """All tiny models (dense llama, qwen35 with MTP head, head-less twin), seed 0."""
    return build_tiny_models(tmp_path_factory.mktemp("tiny-models"))


@pytest.fixture(scope="session")
def dense_model(tiny_models: TinyModels) -> Path:
    """Dense ``llama``: KV cache only, no rollback support (n_rs_seq is granted as 0)."""
    return tiny_models.dense


@pytest.fixture(scope="session")
def hybrid_model(tiny_models: TinyModels) -> Path:
    """Hybrid ``qwen35`` with one NextN (MTP) layer; load with ``load_mtp=True`` to draft."""
    return tiny_models.hybrid


@pytest.fixture(scope="session")
def headless_model(tiny_models: TinyModels) -> Path:
    """The hybrid's trunk without an MTP head: for the "model has no MTP head" paths."""
    return tiny_models.headless
