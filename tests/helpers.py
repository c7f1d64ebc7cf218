"""Helpers every test folder shares: the installed CLI, free ports, the greedy reference.

``tests/`` is on ``sys.path`` (its root ``conftest.py`` has no package), so any test imports
these as ``from helpers import ...``. One copy here keeps the folders from drifting apart: the
CLI is always the venv's own console script and every exactness check compares with the same
plain-greedy continuation of the same prompt. Child processes are stopped with
``coordinator.processes.stop_processes``, as the demo and the benches stop theirs.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from coordinator.redis_local import free_port  # noqa: F401  (the tests import it from here)
from shared.protocol import SpecMethod, SpecSettings
from worker.engine.engine import SpeculativeEngine
from worker.llm import Batch, Context

#: The ``specfleet`` console script of the interpreter running the tests (never one on PATH).
SPECFLEET = str(Path(sys.executable).with_name("specfleet"))
#: The prompt the engine and rollback exactness checks continue.
PROMPT = [5, 17, 42, 99, 3, 250, 8, 61]
#: The context the tiny-model engines are opened with.
N_CTX = 512


def specfleet(*args: str, env: Mapping[str, str] | None = None, stdin: str | None = None,
              cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``specfleet ARGS`` to completion, text output captured (``env`` replaces os.environ)."""
    return subprocess.run([SPECFLEET, *args], env=env, input=stdin, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def run_bench(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run ``bench/SCRIPT ARGS`` with the tests' interpreter, text output captured."""
    bench = Path(__file__).resolve().parents[1] / "bench" / script
    return subprocess.run([sys.executable, str(bench), *args], capture_output=True, text=True,
                          timeout=timeout)


def greedy(engine: SpeculativeEngine, n_tokens: int, prompt: list[int] = PROMPT) -> list[int]:
    """Plain one-token-at-a-time greedy continuation: the reference of every exactness check."""
    return engine.generate(prompt, n_tokens, SpecSettings(method=SpecMethod.NONE)).tokens


#: How far one log probability of the F32 tiny models may move between a request and its
#: repeat (another KV layout and verify width): an alternative at -20.8418 came back at
#: -20.8426 on an AVX2-only CPU (7.5e-4; within 1e-5 on the AVX-512 machines before). An
#: absolute bound, in log space: a logit's rounding moves a logprob by the same amount
#: whatever its size.
LOGPROB_TOLERANCE = 2e-3


def close_floats(value: object) -> object:
    """``value`` (dicts, lists, pydantic models) with every float replaced by a
    ``pytest.approx`` of it, so ``==`` holds every token, text and byte exact and every
    log probability to :data:`LOGPROB_TOLERANCE`, alternatives in any order (two tied may
    swap): one request and its repeat run on a different KV layout and verify width, and
    attention over a shared cache sums in another order (docs/engine.md, "Several slots").
    Compare with the other side's ``model_dump()`` dicts, alternatives sorted by token."""
    import pytest  # noqa: PLC0415  (helpers is imported by non-test tools too)

    if hasattr(value, "model_dump"):
        value = value.model_dump()
    if isinstance(value, float):
        return pytest.approx(value, rel=1e-5, abs=LOGPROB_TOLERANCE)
    if isinstance(value, dict):
        return {k: close_floats(sorted(v, key=lambda t: t["token"]) if k == "top_logprobs"
                                else v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [close_floats(v) for v in value]
    return value


class ReplaysRepeats:
    """A target context whose decode is ``penalty`` seconds slower unless it repeats the
    previous decode's row count, as a GPU replays the CUDA graph of a repeated shape
    (docs/benchmarks.md, "GPU, second run")."""

    def __init__(self, context: Context, penalty: float) -> None:
        self._context = context
        self._penalty = penalty
        self._rows = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    def decode(self, batch: Batch) -> None:
        if batch.n_tokens != self._rows:
            time.sleep(self._penalty)
        self._rows = batch.n_tokens
        self._context.decode(batch)


T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout: float = 60.0, what: str = "condition",
             every: float = 0.05) -> T:
    """Poll ``predicate`` every ``every`` seconds until it returns something truthy, and return
    that; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every)

