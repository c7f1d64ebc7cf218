"""Model fixtures shared by every test: the tiny GGUFs are written once per session.

Gemma fixtures skip (with the install hint) when the demo extra is missing; the F16 copy is
cached in ``$SPECFLEET_CACHE_DIR`` (default ``~/.cache/specfleet``), so only the first run pays
for the conversion.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.testmodels import TinyModels, build_tiny_models, gemma


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


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    """Gemma 3 270M Q4_K_M (demo extra)."""
    try:
        return gemma.gemma_q4_path()
    except gemma.GemmaUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def gemma_f16_path(gemma_path: Path) -> Path:
    """The F16 copy of Gemma 3 270M: batch-invariant enough for exactness gates."""
    return gemma.gemma_f16_path()
