"""Process-wide llama.cpp state: backend init and the log callback.

llama.cpp logs through one process-global callback. We install ours once, keep a reference
to the ctypes object (if it were garbage-collected the next log line would crash the process),
and let callers capture the lines they need (the fitter reads llama.cpp's own size reports).
Every line also reaches the structured log as a ``llama.log`` event, never raw stderr.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import llama_cpp

from shared.logs import get_logger


class LlamaError(RuntimeError):
    """A llama.cpp call failed; the message names the call and what it means for the user."""


_lock = threading.Lock()
_initialised = False
_captures: list[list[str]] = []
_partial: list[str] = []
_partial_level = [0]

#: ggml_log_level (ggml.h: 1 DEBUG, 2 INFO, 3 WARN, 4 ERROR; 5 continues the previous line) to
#: the structured log's level. llama.cpp's INFO is the loader's dump, hundreds of lines a load:
#: it goes to ``debug`` (``SPECFLEET_LOG_LEVEL=debug`` shows it); warnings and errors stay.
_LOG_METHODS = {1: "debug", 2: "debug", 3: "warning", 4: "error"}
_GGML_LEVEL_NAMES = {1: "debug", 2: "info", 3: "warn", 4: "error"}
_GGML_CONT = 5
_llama_log = get_logger("llama")


@llama_cpp.llama_log_callback
def _log_callback(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    """Every complete llama.cpp line becomes a ``llama.log`` event (and reaches the captures).
    Runs inside C: it must never raise."""
    try:
        if level != _GGML_CONT or not _partial:
            _partial_level[0] = level
        _partial.append(text.decode("utf-8", errors="replace"))
        if not _partial[-1].endswith("\n"):
            return
        line = "".join(_partial).rstrip("\n")
        _partial.clear()
        for sink in _captures:
            sink.append(line)
        if line.strip():
            first = _partial_level[0]
            getattr(_llama_log, _LOG_METHODS.get(first, "debug"))(
                "llama.log", line=line.strip(), llama_level=_GGML_LEVEL_NAMES.get(first, "none"))
    except Exception:  # a log line is never worth a crash inside llama.cpp
        pass


def init_backend() -> None:
    """Initialise llama.cpp once per process and silence its stderr chatter."""
    global _initialised
    with _lock:
        if _initialised:
            return
        llama_cpp.llama_backend_init()
        llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))
        _initialised = True


@contextmanager
def capture_llama_log() -> Iterator[list[str]]:
    """Collect llama.cpp's log lines emitted inside the block."""
    init_backend()
    sink: list[str] = []
    _captures.append(sink)
    try:
        yield sink
    finally:
        _captures.remove(sink)


#: ggml's switch for its tiled K-quant matrix products (on by default, used from 8 rows up:
#: a different summation than the row-by-row ``vec_dot`` of narrower products). Read once,
#: at the first product of the process.
TILED_MM_ENV = "GGML_CPU_TILED_MM"
_decoded = [False]


def note_decode() -> None:
    """A decode is about to run: from now on ggml's kernel switches are fixed."""
    _decoded[0] = True


def require_width_invariant_kernels() -> None:
    """Turn ggml's tiled K-quant products off for this process, or refuse when it is too
    late (a decode already ran, and ggml read the switch then)."""
    if os.environ.get(TILED_MM_ENV) == "0":
        return
    if _decoded[0]:
        raise LlamaError(f"deterministic mode must be chosen before the process's first decode "
                         f"(ggml has read {TILED_MM_ENV}); start it in a fresh process or set "
                         f"{TILED_MM_ENV}=0 before loading any model")
    os.environ[TILED_MM_ENV] = "0"
