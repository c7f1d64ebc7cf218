"""A llama-server peer for side-by-side benches: started on a free loopback port, stopped after.

The binary is built from the llama.cpp inside the llama-cpp-python sdist (docs/benchmarks.md),
so both sides run the same kernels; benches take it from ``--llama-server PATH`` or
``$SPECFLEET_LLAMA_SERVER`` and skip the peer with a message when it is absent.

Where our worker loads the weights without repacked copies
(:func:`worker.llm.model.repacking_is_safe`: a CPU that reports AMX, whose tiles fault on the
hosts measured), the server is told the same (``--no-repack``). Without it llama-server dies
of SIGILL in the AMX kernel at its first prompt there, and with it both sides compute with
the same weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from coordinator.redis_local import free_port
from worker.llm.model import repacking_is_safe

SERVER_ENV = "SPECFLEET_LLAMA_SERVER"


def find_server(path: str | None) -> str | None:
    """The llama-server binary to use, or None when it is not there."""
    return path if path and Path(path).is_file() else None


def post(url: str, body: dict[str, object], timeout: float = 600.0) -> dict[str, object]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())  # type: ignore[no-any-return]


@contextmanager
def llama_server(binary: str, model: str, threads: int, n_ctx: int, parallel: int = 1,
                 extra: tuple[str, ...] = ()) -> Iterator[str]:
    """A llama-server with ``parallel`` slots sharing ``n_ctx`` (``-np``, ``-c``), repacking
    its weights where our worker does; yields its base URL once ``/health`` answers."""
    port = free_port()
    env = dict(os.environ, LD_LIBRARY_PATH=str(Path(binary).parent))
    repack = () if repacking_is_safe() else ("--no-repack",)
    cmd = [binary, "-m", model, "-t", str(threads), "-tb", str(threads), "-c", str(n_ctx),
           "-np", str(parallel), "--host", "127.0.0.1", "--port", str(port), *repack, *extra]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {proc.returncode}: {cmd}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("llama-server did not become healthy within 120 s")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def completion(url: str, ids: list[int], tokens: int,
               timeout: float = 600.0) -> dict[str, object]:
    """One greedy completion of exactly ``tokens`` tokens: llama-server's whole answer, its
    own ``timings`` and the generated ``tokens`` included."""
    return post(url + "/completion", {"prompt": ids, "n_predict": tokens, "temperature": 0.0,
                                      "top_k": 1, "cache_prompt": False, "ignore_eos": True,
                                      "return_tokens": True}, timeout)


def complete(url: str, ids: list[int], tokens: int, timeout: float = 600.0) -> dict[str, object]:
    """One greedy completion of exactly ``tokens`` tokens; llama-server's own timings."""
    timings = completion(url, ids, tokens, timeout)["timings"]
    assert isinstance(timings, dict)
    return timings


@contextmanager
def optional_server(binary: str | None, model: str, threads: int,
                    n_ctx: int) -> Iterator[str | None]:
    """:func:`llama_server`'s URL, or None when no binary was given (a bench then runs
    specfleet only)."""
    if binary is None:
        yield None
        return
    with llama_server(binary, model, threads, n_ctx) as url:
        yield url
