"""Speculative vs plain decoding, specfleet against llama-server, side by side in one run.

Gemma 3 270M Q4_K_M, greedy, five workload kinds written for this bench (code copied with a
rename, code copied verbatim, CSV records rewritten as JSON, sentences quoted from a document,
free prose), each cold and warm:

- llama-server (built from the llama.cpp in the llama-cpp-python sdist, see docs/benchmarks.md;
  ``--llama-server PATH`` or ``$SPECFLEET_LLAMA_SERVER``; its part is skipped with a message
  when absent): plain, and ``--spec-type ngram-mod`` with its defaults. ngram-mod keeps its
  table across requests, so every repetition starts a fresh server: its first request is
  *cold*, the same request again *warm*.
- specfleet in this process: plain, the default drafter (``auto`` on a head-less model:
  suffix at its one-slot default width, 127) and the suffix drafter at N 64 (ngram-mod's
  reach), both on one engine loaded for the wider; *cold* is the
  first request on a fresh drafter state (empty output cache, uncalibrated confidences; the
  row costs measured at load are kept, as a fresh worker measures them at load), *warm* the
  same request again.

Repetitions are interleaved (every configuration of every workload once per round), so machine
noise hits all of them alike; the summary is the median per configuration, and the default
drafter against ngram-mod round by round (the median of the paired ratios, the rounds it
was ahead in, their range), and in how many rounds each side's warm request wrote its cold
request's text again (``kept_cold_text``: a repeat that parts at a near-tie drafts only its
own text after it, so both sides' warm rates follow it). Both sides get the
same token ids and the same thread count; rates are decode-phase rates (llama-server's
``timings.predicted_per_second``, our ``effective_tokens_per_second``: drafting included,
prefill excluded). Progress goes to stderr, the JSON summary (medians, ratios to llama-server
plain and to specfleet plain) to stdout, and ``--markdown`` adds a table.

    ./.venv/bin/python bench/spec_vs_plain.py [--reps 3] [--tokens 200] [--threads 2]
        [--llama-server PATH] [--deterministic] [--gpu] [--model GGUF]
        [--device-verify auto|on|off] [--markdown]

``--deterministic`` loads the engine in deterministic mode (docs/engine.md, "Deterministic
mode"); its rates against a default run are the mode's cost.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import cast

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from peer_server import (  # noqa: E402
    SERVER_ENV,
    completion,
    find_server,
    llama_server,
    optional_server,
)
from prompts import MERGE_INTERVALS, chat_turn  # noqa: E402

from shared.logs import configure_logging  # noqa: E402
from shared.protocol import SpecMethod, SpecSettings  # noqa: E402
from worker.engine.engine import EngineConfig, SpeculativeEngine  # noqa: E402
from worker.engine.plan import default_draft_max  # noqa: E402
from worker.launch import EngineCapacity  # noqa: E402
from worker.testmodels.gemma import gemma_q4_path  # noqa: E402

N_CTX = 4096
#: The suffix drafter's width as a configuration of its own: llama-server's ngram-mod drafts
#: up to 64 by default.
DRAFT_MAX = 64
SUFFIX = SpecSettings(method=SpecMethod.SUFFIX, draft_max=DRAFT_MAX)
PLAIN = SpecSettings(method=SpecMethod.NONE)
#: What a request without settings gets from a worker loaded with ``auto`` on Gemma: suffix
#: drafting at the default width of one slot. Said explicitly: this engine is loaded for
#: :data:`CAPACITY`, and a request that leaves the width unset gets the engine's.
DEFAULT = SpecSettings(method=SpecMethod.SUFFIX,
                       draft_max=default_draft_max(SpecMethod.SUFFIX, slots=1))
#: The engine's draft capacity: both widths above are requests within it, priced by one
#: row-cost table.
CAPACITY = max(DRAFT_MAX, DEFAULT.draft_max)
Result = dict[str, float]
#: A result and the tokens it generated.
Run = tuple[Result, list[int]]
#: A warm result's key: it wrote its cold run's text again (summed over rounds, not a median).
KEPT = "kept_cold_text"


CODE = MERGE_INTERVALS + '''

def total_covered(intervals):
    """Length of the union of the intervals."""
    return sum(end - start for start, end in merge_intervals(intervals))


def find_gaps(intervals, lower, upper):
    """The parts of [lower, upper] that no interval covers."""
    gaps = []
    cursor = lower
    for start, end in merge_intervals(intervals):
        if start > cursor:
            gaps.append([cursor, min(start, upper)])
        cursor = max(cursor, end)
        if cursor >= upper:
            break
    if cursor < upper:
        gaps.append([cursor, upper])
    return gaps
'''

CSV = """id,name,city,age,plan
1,Alice Martin,Lyon,34,pro
2,Bruno Costa,Porto,41,free
3,Chen Wei,Shanghai,29,team
4,Dana Novak,Prague,52,pro
5,Emeka Obi,Lagos,38,free
6,Farah Haddad,Beirut,45,team
7,Goran Ilic,Belgrade,31,pro
8,Hana Sato,Osaka,27,free
9,Ivan Petrov,Sofia,60,team
10,Julia Klein,Vienna,36,pro
11,Kofi Mensah,Accra,43,free
12,Lena Berg,Oslo,30,team
"""

DOCUMENT = " ".join([
    "The harbour of Saint-Aubin was rebuilt in 1873 after the great storm destroyed the old "
    "wooden piers.",
    "The new breakwater, made of granite blocks from the quarries at Kerlan, is four hundred "
    "metres long.",
    "Fishing boats were the main users of the harbour until the railway arrived in 1891.",
    "After the railway opened, the town became a destination for summer visitors from Paris.",
    "The lighthouse at the end of the breakwater was automated in 1964 and its last keeper, "
    "Yves Le Goff, moved to the village of Plouzec.",
    "Today the harbour shelters about two hundred pleasure boats and a small fleet of twelve "
    "fishing vessels.",
    "The annual regatta, first held in 1902, takes place on the second Sunday of August.",
    "The old customs house on the quay now holds a museum of maritime history, which is open "
    "from April to October.",
    "A ferry to the island of Bréhat leaves twice a day in summer and once a day in winter.",
])


def workloads() -> dict[str, str]:
    """The five kinds of request (prompt texts; Gemma's chat template)."""
    return {
        "copy_rename": chat_turn("Here is some Python code:\n\n```python\n" + CODE + "```\n\n"
                                 "Rewrite the code exactly as it is, but rename the function "
                                 "`merge_intervals` to `coalesce`. Output only the code.",
                                 "```python\n"),
        "copy": chat_turn("Repeat the following Python code exactly, character for character. "
                          "Output only the code.\n\n```python\n" + CODE + "```",
                          "```python\n"),
        "csv_json": chat_turn("Convert these CSV records to a JSON array of objects with the "
                              "keys id, name, city, age and plan. Output only the JSON.\n\n"
                              + CSV, "```json\n"),
        "quote": chat_turn("Here is a document:\n\n" + DOCUMENT + "\n\nQuote, word for word, "
                           "every sentence of the document that contains a year. Put each "
                           "quoted sentence on its own line."),
        "prose": chat_turn("Write a long, detailed story about a lighthouse keeper who finds a "
                           "message in a bottle."),
    }


# -- llama-server --------------------------------------------------------------------------
def run_server(url: str, ids: list[int], tokens: int) -> Run:
    answer = completion(url, ids, tokens)
    t = answer["timings"]
    assert isinstance(t, dict)
    drafted = float(t.get("draft_n", 0) or 0)
    accepted = float(t.get("draft_n_accepted", 0) or 0)
    return ({"tokens_per_second": float(t["predicted_per_second"]),
             "generated": float(t["predicted_n"]),
             "acceptance": accepted / drafted if drafted else 0.0},
            list(cast(list[int], answer["tokens"])))


# -- specfleet -----------------------------------------------------------------------------
def run_ours(engine: SpeculativeEngine, ids: list[int], tokens: int,
             spec: SpecSettings) -> Run:
    read0 = engine.target.rows_read
    out = engine.generate(ids, tokens, spec)
    t = out.telemetry
    return ({"tokens_per_second": t.effective_tokens_per_second,
             "generated": t.generated_tokens, "acceptance": t.acceptance,
             "tokens_per_verify": t.tokens_per_verify,
             # The step's wall time but the target's decode, a committed token
             # (Telemetry.host_seconds_per_token), and the logits rows Python read a token.
             "host_ms_per_token": 1000 * t.host_seconds_per_token,
             "rows_read_per_token": (engine.target.rows_read - read0) / max(1, len(out.tokens))},
            out.tokens)


def cold_then_warm(run: Callable[[], Run]) -> tuple[Result, Result]:
    """The same request twice on one drafter state. The warm result says whether it wrote
    the cold one's text again (:data:`KEPT`, 1 or 0): a repeat that parts from its first
    text at a near-tie has only its own text to draft from after it, so the warm rates of
    both sides follow how often each keeps it."""
    cold, cold_tokens = run()
    warm, warm_tokens = run()
    warm[KEPT] = float(warm_tokens == cold_tokens)
    return cold, warm


def forget(engine: SpeculativeEngine) -> None:
    """Cold drafter state: an empty output cache and fresh calibration (row costs kept)."""
    assert engine.suffix is not None
    engine.suffix = engine.suffix.cold()


# -- the run -------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions")
    ap.add_argument("--tokens", type=int, default=200, help="tokens generated per request")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads, both sides")
    ap.add_argument("--llama-server", default=os.environ.get(SERVER_ENV),
                    help=f"llama-server binary (default ${SERVER_ENV}); absent = ours only")
    ap.add_argument("--workloads", default=",".join(workloads()), help="comma list")
    ap.add_argument("--deterministic", action="store_true", help="deterministic mode")
    ap.add_argument("--gpu", action="store_true",
                    help="offload every layer of our engine (n_gpu_layers -1); a llama-server "
                         "beside it runs with its own build's defaults")
    ap.add_argument("--model", help="Gemma 3 270M Q4_K_M GGUF (default: the demo extra's "
                    "package; a path for a host that cannot install it)")
    ap.add_argument("--device-verify", choices=("auto", "on", "off"), default="auto",
                    help="greedy verify rows reduced on the device (auto: on a GPU only)")
    ap.add_argument("--markdown", action="store_true", help="also print a markdown table")
    args = ap.parse_args()

    configure_logging(level="warning")  # stdout carries only the summary
    model = args.model or str(gemma_q4_path())
    server = find_server(args.llama_server)
    if server is None:
        print(f"llama-server not found ({args.llama_server or '$' + SERVER_ENV + ' unset'}): "
              "running specfleet only; build it as docs/benchmarks.md says", file=sys.stderr)
    engine = SpeculativeEngine(EngineConfig(model, n_ctx=N_CTX, n_threads=args.threads,
                                            n_gpu_layers=-1 if args.gpu else 0,
                                            capacity=EngineCapacity(SpecMethod.SUFFIX,
                                                                    CAPACITY),
                                            deterministic=args.deterministic,
                                            device_verify={"auto": None, "on": True,
                                                           "off": False}[args.device_verify]))
    assert engine.suffix is not None
    print(f"row costs (x one row): {engine.suffix.costs.relative()}", file=sys.stderr)
    texts = {k: v for k, v in workloads().items() if k in args.workloads.split(",")}
    ids = {k: engine.model.tokenize(v, parse_special=True) for k, v in texts.items()}
    results: dict[str, dict[str, list[Result]]] = {w: {} for w in texts}

    def record(workload: str, name: str, r: Result, rep: int) -> None:
        results[workload].setdefault(name, []).append(r)
        print(f"[rep {rep + 1}/{args.reps}] {workload:12s} {name:22s} "
              f"{r['tokens_per_second']:7.1f} tok/s  acc {r.get('acceptance', 0):.2f}"
              + (f"  host {r['host_ms_per_token']:.3f} ms/tok" if "host_ms_per_token" in r
                 else "")
              + (f"  kept the cold text: {r[KEPT]:.0f}" if KEPT in r else ""),
              file=sys.stderr, flush=True)

    with optional_server(server, model, args.threads, N_CTX) as plain_url:
        for w in texts:  # warm-up: first decodes pay one-time allocations
            run_ours(engine, ids[w], 16, PLAIN)
            if plain_url:
                run_server(plain_url, ids[w], 16)
        for rep in range(args.reps):
            for w in texts:
                record(w, "specfleet_plain", run_ours(engine, ids[w], args.tokens, PLAIN)[0], rep)
                for name, spec in (("default", DEFAULT), ("suffix", SUFFIX)):
                    forget(engine)
                    cold, warm = cold_then_warm(
                        partial(run_ours, engine, ids[w], args.tokens, spec))
                    record(w, f"specfleet_{name}_cold", cold, rep)
                    record(w, f"specfleet_{name}_warm", warm, rep)
                if plain_url and server:
                    record(w, "server_plain", run_server(plain_url, ids[w], args.tokens)[0], rep)
                    with llama_server(server, model, args.threads, N_CTX,
                                      extra=("--spec-type", "ngram-mod")) as url:
                        cold, warm = cold_then_warm(partial(run_server, url, ids[w], args.tokens))
                        record(w, "server_ngram_mod_cold", cold, rep)
                        record(w, "server_ngram_mod_warm", warm, rep)
    costs = engine.suffix.costs.relative()
    engine.close()
    summary = summarize(results)
    summary["row_costs_end"] = costs
    print(json.dumps(summary, indent=2))
    if args.markdown:
        print(markdown(summary, list(texts)))



def summarize(results: dict[str, dict[str, list[Result]]]) -> dict[str, object]:
    """Per workload and configuration: medians, and ratios to both plain baselines."""
    summary: dict[str, object] = {}
    for workload, by_config in results.items():
        medians = {name: {k: (sum if k == KEPT else statistics.median)(
            r.get(k, 0.0) for r in runs) for k in runs[0]} | {"rounds": len(runs)}
            for name, runs in by_config.items()}
        for base in ("specfleet_plain", "server_plain"):
            if base in medians:
                rate = medians[base]["tokens_per_second"]
                for m in medians.values():
                    m[f"vs_{base}"] = m["tokens_per_second"] / rate if rate else 0.0
        entry = {name: {k: round(v, 3) for k, v in m.items()} for name, m in medians.items()}
        for phase in ("cold", "warm"):
            ours = by_config.get(f"specfleet_default_{phase}")
            peer = by_config.get(f"server_ngram_mod_{phase}")
            if ours and peer:
                entry[f"default_vs_ngram_mod_{phase}"] = paired(ours, peer)
        summary[workload] = entry
    return summary


def paired(ours: list[Result], peer: list[Result]) -> dict[str, float]:
    """Round by round (each round ran both, back to back): how the two compare, so a median
    lead is told from one that holds in most rounds."""
    ratios = [a["tokens_per_second"] / b["tokens_per_second"]
              for a, b in zip(ours, peer, strict=True) if b["tokens_per_second"]]
    return {"median": round(statistics.median(ratios), 3),
            "rounds_ahead": sum(r > 1.0 for r in ratios), "rounds": len(ratios),
            "min": round(min(ratios), 3), "max": round(max(ratios), 3)}


def markdown(summary: dict[str, object], names: list[str]) -> str:
    """Rows = configurations, columns = workloads: tok/s ratio to llama-server plain (or to
    specfleet plain without a server); then the default drafter against ngram-mod round by
    round, where llama-server ran."""
    entries = [summary[w] for w in names]
    assert all(isinstance(e, dict) for e in entries)
    tables = cast(list[dict[str, dict[str, float]]], entries)
    first = tables[0]
    base = "vs_server_plain" if "server_plain" in first else "vs_specfleet_plain"

    def row(label: str, key: str, cell: Callable[[dict[str, float]], str]) -> str:
        return f"| {label} | " + " | ".join(cell(e[key]) for e in tables) + " |"

    lines = [f"| ratio ({base[3:]}) | " + " | ".join(names) + " |",
             "|---|" + "---:|" * len(names)]
    lines += [row(config, config, lambda m: f"{m[base]:.2f} ({m['tokens_per_second']:.0f}, "
                                            f"acc {m.get('acceptance', 0):.2f})")
              for config in first if config.startswith(("specfleet", "server"))]
    lines += [row(f"default vs ngram-mod {phase}, round by round", key,
                  lambda r: f"{r['median']:.2f} ({r['rounds_ahead']:.0f}/{r['rounds']:.0f} "
                            f"rounds, {r['min']:.2f}-{r['max']:.2f})")
              for phase in ("cold", "warm") if (key := f"default_vs_ngram_mod_{phase}") in first]
    ours = [config for config in first if "host_ms_per_token" in first[config]]
    lines += ["| " + f"{config} host ms a token (x plain's) | " + " | ".join(
        f"{e[config]['host_ms_per_token']:.3f} "
        f"({e[config]['host_ms_per_token'] / e['specfleet_plain']['host_ms_per_token']:.2f}x, "
        f"rows read {e[config]['rows_read_per_token']:.2f})" for e in tables) + " |"
        for config in ours]
    kept = [config for config in first if KEPT in first[config]]
    if kept:
        lines.append("| warm kept its cold text, rounds (" + " / ".join(
            config.removesuffix("_warm") for config in kept) + ") | " + " | ".join(
            " / ".join(f"{e[c][KEPT]:.0f}" for c in kept) + f" of {e[kept[0]]['rounds']:.0f}"
            for e in tables) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
