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
from collections.abc import Mapping
from pathlib import Path

from coordinator.redis_local import free_port  # noqa: F401  (the tests import it from here)
from shared.protocol import SpecMethod, SpecSettings
from worker.engine.engine import SpeculativeEngine

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


def greedy(engine: SpeculativeEngine, n_tokens: int, prompt: list[int] = PROMPT) -> list[int]:
    """Plain one-token-at-a-time greedy continuation: the reference of every exactness check."""
    return engine.generate(prompt, n_tokens, SpecSettings(method=SpecMethod.NONE)).tokens
