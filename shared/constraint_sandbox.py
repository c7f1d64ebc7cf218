"""Constraint compiles that can neither crash nor stall the process that asks for them.

llguidance compiles a grammar in Rust, recursively: a JSON Schema whose ``$ref`` chain is
~1,000 deep, or a Lark grammar of ~3,000 chained rules, overflows the compiling thread's
stack and kills the whole process (no exception reaches Python), and some schemas take tens
of seconds (compile time grows as ~N^4.4 with ``patternProperties``; llguidance's fuel
limits do not count that phase). A gateway that compiled a request's constraint in-process
died of one request, and every gateway pumping a batch that held one died in turn.

So every verdict on a constraint is given by a child process (:class:`CompileSandbox`): a
few warm ``python -m shared.constraint_sandbox`` processes that compile one grammar at a
time on a thread with a fixed stack (:data:`STACK_MIB`), under llguidance's own parser
limits and an address-space cap, and answer in JSON lines (no pickle). A compile may use
``seconds`` of the child's CPU time: a child that uses more is killed, one that dies is
replaced, and either way the request gets a :class:`~shared.constraint.ConstraintError`
naming the limit it hit. Nothing the child is sent can reach the parent's stack or heap.

The budget is CPU time, not wall time, and a child's start (an interpreter and llguidance,
~0.2 s idle, seconds on a loaded host) is not charged to it: a wall-clock budget refused
trivial schemas on a busy 2-core machine, where the child waited for a core longer than the
compile took. A child starved of CPU is still given up on after :data:`WALL_FACTOR` times
the budget of wall time, so a stalled machine cannot hold a request forever.
"""

from __future__ import annotations

import json
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

if TYPE_CHECKING:
    from llguidance import LLParserLimits

#: The compiling thread's stack in the child. A worker compiles what passed here on a
#: thread with :data:`WORKER_STACK_MIB` (``worker/engine/constraint``): 8x the room.
STACK_MIB = 8
WORKER_STACK_MIB = 64

#: Wall time a compile may take, in multiples of its CPU budget, while the child is starved
#: of CPU by other processes.
WALL_FACTOR = 20
#: Wall time a child may take to start (interpreter, llguidance import) before the request
#: that waits for it is refused.
START_SECONDS = 60.0
_READY = b'{"ready": true}'


def parser_limits() -> LLParserLimits:
    """llguidance's parser limits, the same for the check here and the worker's compile:
    grammar symbols, lexer states (~1-2 kB each), regex-building fuel (~50k/ms) and the
    per-token mask work (lexer fuel ~14k/ms, Earley items ~20k/ms) that bounds what one
    constrained slot can add to a decode step. llguidance's defaults, named here so both
    sides use the same ones whatever a later llguidance defaults to."""
    from llguidance import LLParserLimits

    return LLParserLimits(max_grammar_size=500_000, max_lexer_states=250_000,
                          initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
                          step_max_items=50_000, max_items_in_row=2_000)


class SandboxSettings(BaseSettings):
    """The sandbox's limits, from the environment of whichever process compiles
    (``SPECFLEET_CONSTRAINT_*``: gateway, client, worker alike)."""

    model_config = SettingsConfigDict(env_prefix="SPECFLEET_CONSTRAINT_", extra="ignore")

    compile_seconds: float = Field(
        default=0.5, gt=0, le=60,
        description="CPU seconds a constraint (JSON Schema, grammar, regex) may take to "
                    "compile without a vocabulary (a starved compiler is given 20x that of "
                    "wall time); past it the request is refused naming this limit "
                    "(bench/constraint_limits.py measures the cost curve to set it by)")
    compilers: int = Field(
        default=2, ge=1, le=64,
        description="child processes compiling constraints for this process: how many "
                    "compile at once")
    memory_mib: int = Field(default=2048, ge=256,
                            description="address space of each compiler process")

    def sandbox(self) -> CompileSandbox:
        return CompileSandbox(self.compile_seconds, self.compilers, self.memory_mib)


class CompileLimitError(Exception):
    """The child hit a limit (time, stack, memory) instead of giving a verdict; the message
    names the limit."""


class _Child:
    """One warm compiler process and its pipes."""

    def __init__(self, memory_mib: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "shared.constraint_sandbox", str(STACK_MIB),
             str(memory_mib)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            start_new_session=True)  # a terminal's Ctrl-C stops the parent, which stops it
        self._buffer = b""
        self._ready = False

    def ask(self, grammar: str, seconds: float) -> str:
        """The verdict on ``grammar`` ('' when it compiles); :class:`CompileLimitError` when
        the compile uses more than ``seconds`` of CPU (or :data:`WALL_FACTOR` times that of
        wall time) or the child dies (it is then not to be used again)."""
        assert self.proc.stdin is not None
        self._wait_ready()
        try:
            self.proc.stdin.write(json.dumps({"grammar": grammar}).encode() + b"\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise self._died() from None
        line = self._read_within(seconds)
        if line is None:
            self.kill()
            raise CompileLimitError(
                f"it did not compile within {seconds:g} s "
                "(SPECFLEET_CONSTRAINT_COMPILE_SECONDS): make it smaller or simpler")
        return str(json.loads(line)["error"])

    def _wait_ready(self) -> None:
        """Wait for the child's first line, written once llguidance is imported, so that its
        start is never charged to a compile's budget."""
        if self._ready:
            return
        line = self._read_line(time.monotonic() + START_SECONDS)
        if line != _READY:
            self.kill()
            raise CompileLimitError(
                f"the compiler process did not start within {START_SECONDS:g} s")
        self._ready = True

    def _read_within(self, seconds: float) -> bytes | None:
        """The child's answer, or None once it has used ``seconds`` of CPU on this compile or
        ``WALL_FACTOR * seconds`` of wall time has passed."""
        started, used_before = time.monotonic(), _cpu_seconds(self.proc.pid)
        deadline = started + seconds
        while (line := self._read_line(deadline)) is None:
            now, used_now = time.monotonic(), _cpu_seconds(self.proc.pid)
            if used_before is None or used_now is None:
                return None  # no CPU clock to read (not Linux): the wall clock decides
            left = seconds - (used_now - used_before)
            if left <= 0 or now - started >= WALL_FACTOR * seconds:
                return None
            deadline = min(now + left, started + WALL_FACTOR * seconds)
        return line

    def _read_line(self, deadline: float) -> bytes | None:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                raise self._died()
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def _died(self) -> CompileLimitError:
        code = self.proc.wait()
        if code in (-signal.SIGSEGV, -signal.SIGBUS, -signal.SIGABRT):
            return CompileLimitError(
                f"it nests too deeply to compile (the compiler overflowed its {STACK_MIB} MiB "
                "stack or ran out of memory): nest fewer rules or $refs inside each other")
        return CompileLimitError(f"the compiler process exited with status {code}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


class CompileSandbox:
    """Up to ``processes`` compiler children shared by the threads of one process.

    A caller takes an idle child (waiting for one while all are busy: the pool bounds how
    many compiles run at once), asks it, and puts it back; a child that was killed or died
    is replaced at the next take. Children start on first use (or :meth:`start`)."""

    def __init__(self, seconds: float, processes: int = 2, memory_mib: int = 2048) -> None:
        self.seconds = seconds
        self.memory_mib = memory_mib
        self._idle: queue.LifoQueue[_Child | None] = queue.LifoQueue()
        for _ in range(processes):
            self._idle.put(None)  # a slot whose child is started when taken
        self._lock = threading.Lock()
        self._children: list[_Child] = []

    def start(self) -> CompileSandbox:
        """Start every child now (a gateway does at start, so the first request does not
        wait ~0.2 s for an interpreter)."""
        taken = [self._take() for _ in range(self._idle.qsize())]
        for child in taken:
            self._idle.put(child)
        return self

    def verdict(self, grammar: str) -> str:
        """llguidance's error for ``grammar`` ('' when it compiles), from a child;
        :class:`CompileLimitError` naming the limit it hit instead."""
        child = self._take()
        try:
            return child.ask(grammar, self.seconds)
        finally:
            self._idle.put(child if child.alive() else None)

    def close(self) -> None:
        with self._lock:
            children, self._children = self._children, []
        for child in children:
            child.kill()

    def _take(self) -> _Child:
        child = self._idle.get()
        if child is None or not child.alive():
            if child is not None:
                child.kill()
            child = _Child(self.memory_mib)
            with self._lock:
                self._children = [c for c in self._children if c.alive()] + [child]
        return child


def _cpu_seconds(pid: int) -> float | None:
    """CPU time (user + system, all threads) process ``pid`` has used, from ``/proc``; None
    where there is no ``/proc`` or the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- the child -------------------------------------------------------------------------------
def _compile(grammar: str, out: dict[str, Any]) -> None:
    from llguidance import LLMatcher

    try:
        error = LLMatcher.validate_grammar(grammar, None, limits=parser_limits())
    except Exception as exc:  # noqa: BLE001  a verdict, whatever llguidance raised
        error = f"{type(exc).__name__}: {exc}"
    out["error"] = str(error or "")


def _serve(stack_mib: int, memory_mib: int) -> None:
    """Answer one JSON line per JSON line read, each grammar compiled on a fresh thread with
    a ``stack_mib`` stack, the whole process capped at ``memory_mib`` of address space."""
    import resource

    limit = memory_mib * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    threading.stack_size(stack_mib * 1024 * 1024)
    import llguidance  # noqa: F401  imported once, before the first request times anything

    sys.stdout.write(_READY.decode() + "\n")
    sys.stdout.flush()
    for raw in sys.stdin.buffer:
        out: dict[str, Any] = {"error": "the compiler thread ended without a verdict"}
        thread = threading.Thread(target=_compile, args=(json.loads(raw)["grammar"], out))
        thread.start()
        thread.join()
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]))
