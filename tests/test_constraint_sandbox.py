"""The compile sandbox charges a constraint only for its own compile: CPU time, not the
child's start nor the time it waits for a core (on a loaded 2-core CI machine a wall-clock
budget refused trivial schemas, ``did not compile within 0.5 s``), and still stops a
compile that burns its budget."""

from __future__ import annotations

import json
import os

import pytest
from llguidance import LLMatcher

from shared.constraint_sandbox import CompileLimitError, CompileSandbox

from probes import pattern_properties_schema  # isort: skip

TRIVIAL = LLMatcher.grammar_from_json_schema({"type": "object"})


def test_a_childs_start_is_not_charged_to_the_compile() -> None:
    """A budget far below a child's start (an interpreter and llguidance: ~0.2 s) still
    compiles a trivial schema, on a fresh child and after it."""
    sandbox = CompileSandbox(0.05, processes=1)
    try:
        assert sandbox.verdict(TRIVIAL) == ""
        assert sandbox.verdict(TRIVIAL) == ""
    finally:
        sandbox.close()


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="no /proc to read CPU time")
def test_a_compile_past_its_cpu_budget_is_stopped_and_the_child_replaced() -> None:
    sandbox = CompileSandbox(0.3, processes=1)
    try:
        slow = LLMatcher.grammar_from_json_schema(pattern_properties_schema(450))
        with pytest.raises(CompileLimitError, match="did not compile within 0.3 s"):
            sandbox.verdict(slow)
        assert sandbox.verdict(TRIVIAL) == ""  # a new child answers the next request
    finally:
        sandbox.close()


def test_a_broken_grammar_gets_llguidances_verdict() -> None:
    sandbox = CompileSandbox(1.0, processes=1)
    try:
        error = sandbox.verdict("start: nosuchrule\n")
        assert error and "nosuchrule" in error, json.dumps(error)
    finally:
        sandbox.close()
