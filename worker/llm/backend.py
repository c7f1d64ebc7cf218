"""Process-wide llama.cpp state: backend init and the log callback.

llama.cpp logs through one process-global callback. We install ours once, keep a reference
to the ctypes object (if it were garbage-collected the next log line would crash the process),
and let callers capture the lines they need (the fitter reads llama.cpp's own size reports).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import llama_cpp


class LlamaError(RuntimeError):
    """A llama.cpp call failed; the message names the call and what it means for the user."""


_lock = threading.Lock()
_initialised = False
_captures: list[list[str]] = []
_partial: list[str] = []


@llama_cpp.llama_log_callback
def _log_callback(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    if not _captures:
        return
    _partial.append(text.decode("utf-8", errors="replace"))
    if _partial[-1].endswith("\n"):
        line = "".join(_partial).rstrip("\n")
        _partial.clear()
        for sink in _captures:
            sink.append(line)


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
