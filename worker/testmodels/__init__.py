"""The project's own test models: tiny seeded GGUFs written on the fly, and Gemma 270M copies.

Tests, benches and demos use these instead of downloads: the tiny models cover every code path
(dense KV cache, hybrid recurrent state, an MTP head or none) in milliseconds, and Gemma gives
real text.
"""

from worker.testmodels.tiny import (
    TinyModels,
    build_tiny_models,
    write_dense_llama,
    write_qwen35_hybrid,
)

__all__ = ["TinyModels", "build_tiny_models", "write_dense_llama", "write_qwen35_hybrid"]
