"""Thin, typed seam over llama-cpp-python's low-level (ctypes) API.

Everything else in the worker talks to llama.cpp through these classes, so that model and
context creation use exactly the same parameters for the fitter's measurements and for the
engine that later runs on them.
"""

from worker.llm.backend import LlamaError, capture_llama_log, init_backend
from worker.llm.batch import Batch
from worker.llm.context import Context, ContextSpec
from worker.llm.model import Model, ModelSpec

__all__ = [
    "Batch",
    "Context",
    "ContextSpec",
    "LlamaError",
    "Model",
    "ModelSpec",
    "capture_llama_log",
    "init_backend",
]
