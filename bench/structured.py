"""Structured output: constrained vs unconstrained decoding, jump-forward and speculation,
specfleet against llama-server's ``json_schema``, side by side in one run.

Gemma 3 270M Q4_K_M, greedy, three JSON Schemas written for this bench (a small person
record, a nested order with ``$defs``, and a schema-heavy inventory row whose twelve fixed
keys make most of the output forced), each with a prompt that asks for it (Gemma's chat
template). Configurations:

- ``plain``: our engine, plain decoding, no constraint (the baseline every ratio divides by);
- ``constrained``: plain decoding under the schema (the mask's overhead: goal <= 10 %);
- ``jump``: constrained, forced runs verified as drafts, no drafter (jump-forward alone);
- ``jump_suffix``: constrained, forced runs plus the suffix drafter (goal >= 1.3x plain on
  the schema-heavy one);
- ``server_plain`` / ``server_json_schema``: llama-server (``--llama-server PATH`` or
  ``$SPECFLEET_LLAMA_SERVER``; skipped with a message when absent), plain and with the schema
  in ``json_schema`` (its GBNF sampler).

Repetitions are interleaved, the summary is the median per configuration; rates are decode
rates (our ``effective_tokens_per_second``: masks and drafting included, prefill excluded;
llama-server's ``timings.predicted_per_second``). It also measures llguidance's mask cost per
token on Gemma's 262,144-id vocabulary (``compute_bitmask`` along a valid document of each
schema) and says whether xgrammar can be measured here (0.2.9 needs torch). Progress goes to
stderr, the JSON summary to stdout; ``--markdown`` adds a table.

    ./.venv/bin/python bench/structured.py [--reps 3] [--tokens 256] [--threads 2]
        [--llama-server PATH] [--markdown]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from peer_server import SERVER_ENV, find_server, optional_server, post  # noqa: E402

from shared.constraint import Constraint, ConstraintKind  # noqa: E402
from shared.logs import configure_logging  # noqa: E402
from shared.protocol import SpecMethod, SpecSettings  # noqa: E402
from worker.engine.constraint.tokenizer import grammar_vocab  # noqa: E402
from worker.engine.engine import EngineConfig, SpeculativeEngine  # noqa: E402
from worker.engine.proposers.base import Proposer  # noqa: E402
from worker.engine.proposers.none import NoDraft  # noqa: E402
from worker.launch import EngineCapacity  # noqa: E402
from worker.testmodels.gemma import gemma_q4_path  # noqa: E402

N_CTX = 4096
DRAFT_MAX = 16
Result = dict[str, float]

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 40},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "city": {"type": "string", "maxLength": 40},
                   "email": {"type": "string", "maxLength": 60}},
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "order_id": {"type": "integer", "minimum": 1},
        "customer": {"$ref": "#/$defs/customer"},
        "items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1,
                  "maxItems": 4},
        "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]},
    },
    "required": ["order_id", "customer", "items", "status"],
    "additionalProperties": False,
    "$defs": {
        "customer": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 40},
            "country": {"type": "string", "maxLength": 30}},
            "required": ["name", "country"], "additionalProperties": False},
        "item": {"type": "object", "properties": {
            "product": {"type": "string", "maxLength": 30},
            "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
            "unit_price": {"type": "number", "minimum": 0, "maximum": 10000}},
            "required": ["product", "quantity", "unit_price"], "additionalProperties": False},
    },
}
#: Schema-heavy: twelve fixed, long keys around short values.
INVENTORY_KEYS = ("warehouse_identifier", "aisle_number", "shelf_position", "product_category",
                  "stock_keeping_unit", "quantity_on_hand", "reorder_threshold",
                  "supplier_reference", "last_inventory_check", "storage_temperature",
                  "hazardous_material", "insurance_class")
INVENTORY = {
    "type": "object",
    "properties": {key: ({"type": "integer", "minimum": 0, "maximum": 999}
                         if i % 3 == 1 else {"type": "boolean"} if key == "hazardous_material"
                         else {"type": "string", "maxLength": 12})
                   for i, key in enumerate(INVENTORY_KEYS)},
    "required": list(INVENTORY_KEYS),
    "additionalProperties": False,
}
SCHEMAS = {"person": PERSON, "order": ORDER, "inventory": INVENTORY}
PROMPTS = {
    "person": "Describe a fictional person as JSON with name, age, city and email.",
    "order": "Write a JSON record of an online order with a customer and two items.",
    "inventory": "Write a JSON inventory record for one product in a warehouse, with every "
                 "field filled in: " + ", ".join(INVENTORY_KEYS) + ".",
}
#: A valid document per schema, for the mask cost along a real path.
DOCUMENTS = {
    "person": {"name": "Maria Lopez", "age": 34, "city": "Valencia", "email": "m@x.es"},
    "order": {"order_id": 17, "customer": {"name": "Ann Lee", "country": "Canada"},
              "items": [{"product": "lamp", "quantity": 2, "unit_price": 19.5}],
              "status": "shipped"},
    "inventory": {k: (7 if i % 3 == 1 else False if k == "hazardous_material" else "A-1")
                  for i, k in enumerate(INVENTORY_KEYS)},
}


def turn(user: str) -> str:
    return f"<start_of_turn>user\n{user}<end_of_turn>\n<start_of_turn>model\n"


# -- specfleet -----------------------------------------------------------------------------
def run_ours(engine: SpeculativeEngine, ids: list[int], tokens: int, method: SpecMethod,
             constraint: Constraint | None, proposer: Proposer | None = None) -> Result:
    r = engine.generate(ids, tokens, SpecSettings(method=method), proposer=proposer,
                        constraint=constraint)
    t = r.telemetry
    return {"tokens_per_second": t.effective_tokens_per_second, "generated": t.generated_tokens,
            "decodes": t.target_decodes, "forced": t.forced_tokens,
            "acceptance": t.acceptance, "mask_ms_per_token":
                1e3 * t.mask_seconds / t.constrained_tokens if t.constrained_tokens else 0.0,
            "valid": float(_parses(r.text)) if constraint else 0.0}


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def mask_cost(engine: SpeculativeEngine) -> dict[str, object]:
    """llguidance's ``compute_bitmask`` per token along each schema's valid document on this
    vocabulary (ms: median and mean), and the vocabulary build time (once per model)."""
    from llguidance import LLMatcher

    t0 = time.perf_counter()
    vocab = grammar_vocab(engine.model)
    built = time.perf_counter() - t0
    out: dict[str, object] = {"n_vocab": vocab.n_vocab, "vocab_build_seconds": round(built, 2)}
    for name, schema in SCHEMAS.items():
        matcher = LLMatcher(vocab.tokenizer, Constraint(
            kind=ConstraintKind.JSON_SCHEMA, json_schema=schema).llguidance_grammar(), log_level=0)
        times = []
        for token in vocab.tokenizer.tokenize_str(json.dumps(DOCUMENTS[name],
                                                             separators=(",", ":"))):
            t = time.perf_counter()
            matcher.compute_bitmask()
            times.append(time.perf_counter() - t)
            assert matcher.consume_token(token), name
        out[name] = {"median_ms": round(1e3 * statistics.median(times), 3),
                     "mean_ms": round(1e3 * statistics.fmean(times), 3), "tokens": len(times)}
    return out


def xgrammar_status() -> str:
    try:
        importlib.import_module("xgrammar")
    except ImportError as exc:
        return f"not measured: import xgrammar failed ({exc}); 0.2.9 requires torch"
    return "installed: not measured by this bench"


# -- llama-server --------------------------------------------------------------------------
def run_server(url: str, ids: list[int], tokens: int, schema: dict[str, Any] | None) -> Result:
    body: dict[str, object] = {"prompt": ids, "n_predict": tokens, "temperature": 0.0,
                               "top_k": 1, "cache_prompt": False}
    if schema is not None:
        body["json_schema"] = schema
    out = post(url + "/completion", body)
    t = out["timings"]
    assert isinstance(t, dict)
    return {"tokens_per_second": float(t["predicted_per_second"]),
            "generated": float(t["predicted_n"]),
            "valid": float(_parses(str(out.get("content", "")))) if schema else 0.0}



# -- the run -------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions")
    ap.add_argument("--tokens", type=int, default=256, help="token budget per request")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads, both sides")
    ap.add_argument("--llama-server", default=os.environ.get(SERVER_ENV),
                    help=f"llama-server binary (default ${SERVER_ENV}); absent = ours only")
    ap.add_argument("--schemas", default=",".join(SCHEMAS), help="comma list")
    ap.add_argument("--markdown", action="store_true", help="also print a markdown table")
    args = ap.parse_args()

    configure_logging(level="warning")  # stdout carries only the summary
    model = str(gemma_q4_path())
    server = find_server(args.llama_server)
    if server is None:
        print(f"llama-server not found ({args.llama_server or '$' + SERVER_ENV + ' unset'}): "
              "running specfleet only; build it as docs/benchmarks.md says", file=sys.stderr)
    engine = SpeculativeEngine(EngineConfig(model, n_ctx=N_CTX, n_threads=args.threads,
                                            capacity=EngineCapacity(SpecMethod.SUFFIX,
                                                                    DRAFT_MAX),
                                            prefix_cache=False))
    masks = mask_cost(engine)
    print(f"mask cost: {masks}", file=sys.stderr)
    names = [n for n in SCHEMAS if n in args.schemas.split(",")]
    ids = {n: engine.model.tokenize(turn(PROMPTS[n]), parse_special=True) for n in names}
    constraints = {n: Constraint(kind=ConstraintKind.JSON_SCHEMA, json_schema=SCHEMAS[n])
                   for n in names}
    results: dict[str, dict[str, list[Result]]] = {n: {} for n in names}

    def record(name: str, config: str, r: Result, rep: int) -> None:
        results[name].setdefault(config, []).append(r)
        print(f"[rep {rep + 1}/{args.reps}] {name:10s} {config:20s} "
              f"{r['tokens_per_second']:7.1f} tok/s  {r['generated']:4.0f} tokens",
              file=sys.stderr, flush=True)

    tok = args.tokens
    with optional_server(server, model, args.threads, N_CTX) as url:
        for n in names:  # warm-up: first decodes pay one-time allocations
            run_ours(engine, ids[n], 8, SpecMethod.NONE, constraints[n])
        for rep in range(args.reps):
            for n in names:
                c = constraints[n]
                record(n, "plain", run_ours(engine, ids[n], tok, SpecMethod.NONE, None), rep)
                record(n, "constrained", run_ours(engine, ids[n], tok, SpecMethod.NONE, c), rep)
                record(n, "jump", run_ours(engine, ids[n], tok, SpecMethod.SUFFIX, c,
                                           NoDraft()), rep)
                record(n, "jump_suffix", run_ours(engine, ids[n], tok, SpecMethod.SUFFIX, c),
                       rep)
                if url is not None:
                    record(n, "server_plain", run_server(url, ids[n], tok, None), rep)
                    record(n, "server_json_schema", run_server(url, ids[n], tok, SCHEMAS[n]),
                           rep)
    engine.close()
    summary = summarize(results)
    summary["mask_cost"] = masks
    summary["xgrammar"] = xgrammar_status()
    print(json.dumps(summary, indent=2))
    if args.markdown:
        print(markdown(summary, names))


def summarize(results: dict[str, dict[str, list[Result]]]) -> dict[str, object]:
    """Per schema: medians per configuration, and the ratios the issue's goals are about."""
    summary: dict[str, object] = {}
    for name, configs in results.items():
        med = {c: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
               for c, rs in configs.items()}
        plain = med["plain"]["tokens_per_second"]
        rate = {c: m["tokens_per_second"] for c, m in med.items()}
        ratios = {f"{c}/plain": round(v / plain, 3) for c, v in rate.items() if c != "plain"}
        if "server_json_schema" in rate:
            ratios["jump_suffix/server_json_schema"] = round(
                rate["jump_suffix"] / rate["server_json_schema"], 3)
        summary[name] = {"median": med, "ratios": ratios,
                         "mask_overhead": round(1 - rate["constrained"] / plain, 3)}
    return summary


def markdown(summary: dict[str, object], names: list[str]) -> str:
    configs = ["plain", "constrained", "jump", "jump_suffix", "server_plain",
               "server_json_schema"]
    lines = ["| schema | " + " | ".join(configs) + " | mask overhead | jump_suffix/plain |",
             "|---" * (len(configs) + 3) + "|"]
    for n in names:
        s = summary[n]
        assert isinstance(s, dict)
        med, ratios = s["median"], s["ratios"]
        cells = [f"{med[c]['tokens_per_second']:.1f}" if c in med else "-" for c in configs]
        lines.append(f"| {n} | " + " | ".join(cells) +
                     f" | {100 * s['mask_overhead']:.1f} % | {ratios['jump_suffix/plain']:.2f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
