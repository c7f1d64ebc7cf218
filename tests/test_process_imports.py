"""Each process imports only what it runs: a client, ``top`` or the gateway never loads
llama.cpp or worker code, and a worker never loads the HTTP gateway.

``tests/test_layers.py`` sees the direct imports of each module; this sees what a process
really loads, through every chain of imports. Each sub-command runs in a fresh interpreter
(the console script's own ``main``) against a Redis nobody listens on, so it goes as far as
its first Redis call, with everything it needs imported, and exits with the expected one-line
error; at exit the interpreter writes ``sys.modules`` for the test to read. (The root
``specfleet --help`` lists every sub-command, so it alone imports them all.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import free_port

from coordinator.cli.app import COMMANDS

#: What each kind of process must never load (a module or any module under it).
NO_MODEL = ("llama_cpp", "worker")
NO_HTTP = ("fastapi", "starlette", "uvicorn", "coordinator.gateway")

#: Each start of the interpreter counts itself in the environment, which a re-execution
#: (``os.execv``) inherits: a worker that had to re-execute to pin its device reports 2. A
#: finder sees the first import of llama_cpp and notes the visible devices at that moment.
_PRELUDE = """
import atexit, json, os, sys
out = sys.argv.pop(1)
os.environ["STARTS"] = str(int(os.environ.get("STARTS", "0")) + 1)
seen = {}
class Watch:
    def find_spec(self, name, path=None, target=None):
        if name == "llama_cpp" and "at_llama_import" not in seen:
            seen["at_llama_import"] = os.environ.get("CUDA_VISIBLE_DEVICES")
            seen["wait_at_llama_import"] = os.environ.get("OMP_WAIT_POLICY")
sys.meta_path.insert(0, Watch())
atexit.register(lambda: open(out, "w").write(json.dumps(
    {"modules": sorted(sys.modules), "starts": int(os.environ["STARTS"]), **seen})))
sys.argv[0] = "specfleet"
from coordinator.cli import main
main()
"""

#: sub-command argv, its exit status, a piece of its stderr, and what it must not load.
CASES = {
    "fleet": (["fleet"], 3, "Redis at", NO_MODEL),
    "submit": (["submit", "--model", "m", "--max-tokens", "4", "--prompt", "hi"], 3,
               "Redis at", NO_MODEL),
    "cancel": (["cancel", "some-job"], 3, "Redis at", NO_MODEL),
    "batch": (["batch", "list"], 3, "Redis at", NO_MODEL),
    "top": (["top", "--once"], 3, "Redis at", NO_MODEL),
    "models": (["models", "list"], 3, "Redis at", NO_MODEL + NO_HTTP),
    "monitor": (["monitor", os.devnull, "--json"], 0, "", NO_MODEL + NO_HTTP),
    "serve": (["serve", "--port", "0"], 3, "does not answer", NO_MODEL),
    "worker": (["worker", "--model", "/nonexistent/model.gguf"], 2, "model file not found",
               ("llama_cpp", *NO_HTTP)),
    # A model file that exists: the worker pins, imports the serving code (llama.cpp) and
    # stops at its first Redis call, before reading the file.
    "worker-loads": (["worker", "--model", "{junk}"], 3, "Redis at", NO_HTTP),
}


@dataclass
class Run:
    """One sub-command's process: its exit status, stderr and ``sys.modules`` at exit."""

    returncode: int
    stderr: str
    modules: list[str]
    #: Interpreter starts of the process (more than 1: it re-executed itself).
    starts: int
    #: CUDA_VISIBLE_DEVICES when llama_cpp was first imported ("missing": never imported,
    #: None: not set yet).
    at_llama_import: str | None
    #: OMP_WAIT_POLICY then (worker/threads.py: libgomp reads it as llama.cpp loads).
    wait_at_llama_import: str | None = None


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """Every case's process, all started at once: most of each one's time is the Redis
    client's retry backoff, spent sleeping, so they overlap instead of queueing."""
    workdir = tmp_path_factory.mktemp("imports")
    env = {k: v for k, v in os.environ.items() if k != "SPECFLEET_REDIS_URL"}
    env["REDIS_URL"] = f"redis://127.0.0.1:{free_port()}/0"  # nobody listens there
    env["SPECFLEET_REDIS_OUTAGE_SECONDS"] = "1"  # a submit waits out an outage this long
    env.pop("CUDA_VISIBLE_DEVICES", None)  # as an operator starts a worker: the pin is its job
    env.pop("OMP_WAIT_POLICY", None)  # ... and so is the threads' wait policy
    junk = workdir / "not-a-model.gguf"
    junk.write_bytes(b"not a gguf file\n" * 64)
    procs = {case: subprocess.Popen(
        [sys.executable, "-c", _PRELUDE, str(workdir / f"{case}.json"),
         *(a.format(junk=junk) for a in argv)], env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for case, (argv, *_) in CASES.items()}
    done = {}
    for case, proc in procs.items():
        _, stderr = proc.communicate(timeout=120)
        report = json.loads((workdir / f"{case}.json").read_text())
        done[case] = Run(proc.returncode, stderr, report["modules"], report["starts"],
                         report.get("at_llama_import", "missing"),
                         report.get("wait_at_llama_import"))
    return done


def _forbidden(modules: list[str], roots: tuple[str, ...]) -> list[str]:
    return [m for m in modules if any(m == r or m.startswith(r + ".") for r in roots)]


@pytest.mark.parametrize("case", list(CASES))
def test_a_process_loads_only_what_it_runs(case: str, runs: dict[str, Run]) -> None:
    argv, status, says, roots = CASES[case]
    run = runs[case]
    assert run.returncode == status, run.stderr
    assert says in run.stderr
    loaded = _forbidden(run.modules, roots)
    assert not loaded, f"specfleet {' '.join(argv)} loaded {loaded[:12]}"


def test_the_check_sees_what_a_worker_loads(runs: dict[str, Run]) -> None:
    """The same inspection finds llama.cpp in a worker that got as far as its model: it can
    fail."""
    assert _forbidden(runs["worker-loads"].modules, NO_MODEL)
    assert "llama_cpp" in runs["worker-loads"].modules


def test_a_worker_pins_its_device_before_llama_cpp_loads(runs: dict[str, Run]) -> None:
    """Started without ``CUDA_VISIBLE_DEVICES``, a worker pins before it imports llama.cpp,
    so it never re-executes itself to apply the pin (it once always did: its command module
    imported the engine)."""
    for case in ("worker", "worker-loads"):
        assert runs[case].starts == 1, (case, runs[case].stderr)
    assert runs["worker-loads"].at_llama_import == "", "llama.cpp loaded before the pin"


def test_a_worker_sets_its_threads_wait_policy_before_llama_cpp_loads(
        runs: dict[str, Run]) -> None:
    """libgomp reads OMP_WAIT_POLICY once, as llama.cpp loads: the worker has chosen it by
    then (worker/threads.py), so its threads wait the way its registration says."""
    assert runs["worker-loads"].wait_at_llama_import in ("ACTIVE", "PASSIVE")


def test_every_sub_command_module_is_reachable() -> None:
    """A module under coordinator/cli/ that registers a command must be in ``COMMANDS``,
    or the lazy root group never imports it and its command does not exist."""
    cli = Path(__file__).resolve().parents[1] / "coordinator" / "cli"
    helpers = {"__init__", "__main__", "app", "options"}
    modules, listed = {p.stem for p in cli.glob("*.py")} - helpers, set(COMMANDS.values())
    assert modules == listed, (f"add each to COMMANDS in coordinator/cli/app.py: "
                               f"{sorted(modules - listed)}; listed but missing: "
                               f"{sorted(listed - modules)}")
