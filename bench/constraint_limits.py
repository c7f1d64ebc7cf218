"""What a constraint compile costs, and where the sandbox's limits cut it off.

The limits of ``shared/constraint_sandbox.py`` are settings (a compile's time budget,
``SPECFLEET_CONSTRAINT_COMPILE_SECONDS``) and constants (the compiler's 8 MiB stack); this
measures what they cost and what they refuse, on this host:

- ``curve``: compile time of an object schema against its number of ``patternProperties``
  (the review's pathological family: ~N^4.4), in the sandbox without a budget (a child given
  a minute), so the budget can be read off it: the N where a compile passes the budget;
- ``depth``: the deepest ``$ref`` chain (through one-armed ``anyOf``) and the longest chain
  of Lark rules the sandbox compiles, found by bisection (deeper ones overflow the child's
  stack and are refused), and each size in bytes;
- ``overhead``: a verdict's round trip for an ordinary schema (a new grammar each time, so
  no cache answers) against compiling it in-process: what isolation adds to a request;
- ``refusal``: seconds from asking to the refusal for each of the review's probes.

Progress goes to stderr, the JSON summary to stdout; ``--markdown`` adds tables.

    ./.venv/bin/python bench/constraint_limits.py [--budget 0.5] [--markdown]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from llguidance import LLMatcher  # noqa: E402
from probes import (  # noqa: E402
    chained_lark,
    pattern_properties_schema,
    ref_chain_schema,
    size,
)

from shared.constraint_sandbox import STACK_MIB, CompileLimitError, CompileSandbox  # noqa: E402

COMPACT = {"whitespace_flexible": False}


def schema_grammar(schema: dict[str, Any]) -> str:
    return LLMatcher.grammar_from_json_schema(schema, defaults=COMPACT)


def timed(sandbox: CompileSandbox, grammar: str) -> tuple[float, str]:
    """Seconds to the sandbox's verdict, and the verdict ('ok', 'error', or the limit)."""
    start = time.perf_counter()
    try:
        verdict = "error" if sandbox.verdict(grammar) else "ok"
    except CompileLimitError as exc:
        verdict = "stack" if "stack" in str(exc) else "time"
    return time.perf_counter() - start, verdict


def curve(points: list[int]) -> list[dict[str, Any]]:
    """Compile time against ``patternProperties`` count, with a minute to spare."""
    rows = []
    with_time = CompileSandbox(seconds=60, processes=1).start()
    try:
        with_time.verdict(schema_grammar({"type": "object"}))  # imports done: time compiles
        for n in points:
            seconds, verdict = timed(with_time, schema_grammar(pattern_properties_schema(n)))
            rows.append({"patterns": n, "bytes": size(pattern_properties_schema(n)),
                         "seconds": round(seconds, 3), "verdict": verdict})
            print(f"curve: {n} patternProperties {seconds:.3f} s", file=sys.stderr)
    finally:
        with_time.close()
    return rows


def deepest(build: Callable[[int], str], low: int, high: int, sandbox: CompileSandbox) -> int:
    """The largest n in [low, high) whose grammar the sandbox compiles (bisection; low must
    compile, high must not)."""
    while high - low > 1:
        mid = (low + high) // 2
        _, verdict = timed(sandbox, build(mid))
        low, high = (mid, high) if verdict == "ok" else (low, mid)
    return low


def overhead(sandbox: CompileSandbox, reps: int) -> dict[str, float]:
    """Median seconds of a sandboxed verdict and of an in-process compile, for ordinary
    schemas (a different one each time: no cache)."""
    boxed, local = [], []
    for i in range(reps):
        schema = {"type": "object", "properties": {f"field_{i}_{k}": {"type": "string"}
                                                   for k in range(20)}}
        grammar = schema_grammar(schema)
        boxed.append(timed(sandbox, grammar)[0])
        start = time.perf_counter()
        LLMatcher.validate_grammar(schema_grammar({**schema, "title": "x"}), None)
        local.append(time.perf_counter() - start)
    return {"sandbox_ms": round(statistics.median(boxed) * 1000, 3),
            "in_process_ms": round(statistics.median(local) * 1000, 3)}


def refusals(sandbox: CompileSandbox) -> list[dict[str, Any]]:
    probes = {"ref_chain_1200": schema_grammar(ref_chain_schema()),
              "lark_chain_3000": LLMatcher.grammar_from_lark(chained_lark()),
              "pattern_properties_450": schema_grammar(pattern_properties_schema())}
    rows = []
    for name, grammar in probes.items():
        seconds, verdict = timed(sandbox, grammar)
        rows.append({"probe": name, "seconds": round(seconds, 3), "verdict": verdict})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=0.5,
                        help="the compile budget the refusals run under (the default's)")
    parser.add_argument("--points", default="50,100,150,200,250,300,350",
                        help="patternProperties counts of the curve")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    sandbox = CompileSandbox(seconds=args.budget).start()
    try:
        summary: dict[str, Any] = {
            "stack_mib": STACK_MIB, "budget_seconds": args.budget,
            "curve": curve([int(p) for p in args.points.split(",")]),
            "depth": {
                "ref_chain": deepest(lambda n: schema_grammar(ref_chain_schema(n)), 10, 1200,
                                     sandbox),
                "lark_rules": deepest(lambda n: LLMatcher.grammar_from_lark(chained_lark(n)),
                                      10, 3000, sandbox)},
            "overhead": overhead(sandbox, args.reps),
            "refusals": refusals(sandbox),
        }
    finally:
        sandbox.close()
    depth = summary["depth"]
    depth["ref_chain_bytes"] = size(ref_chain_schema(depth["ref_chain"]))
    depth["lark_rules_bytes"] = size(chained_lark(depth["lark_rules"]))
    print(json.dumps(summary, indent=2))
    if args.markdown:
        print("\n| patternProperties | bytes | compile (s) |\n|---:|---:|---:|")
        for row in summary["curve"]:
            print(f"| {row['patterns']} | {row['bytes']} | {row['seconds']} |")
        print("\n| probe | refused after (s) | limit |\n|---|---:|---|")
        for row in summary["refusals"]:
            print(f"| {row['probe']} | {row['seconds']} | {row['verdict']} |")


if __name__ == "__main__":
    main()
