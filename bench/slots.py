"""Several sequences per engine: aggregate tok/s with K concurrent requests on one engine of
K slots, against the same K requests one at a time on one slot, side by side in one run.

Gemma 3 270M Q4_K_M, greedy, plain decoding, the default drafter (a request without
settings on a worker loaded with ``auto``: suffix drafting on a head-less model at its default
width, ``plan.default_draft_max``: 127 on one slot, 32 on two, 17 on four, 8 on eight) and
n-gram speculation (N 8, adaptive), K = 1, 2, 4, 8; every speculative row also says its
aggregate against plain at the same K (``vs_plain``: what goodput-aware drafting must keep
at or above 1 at every load). ``--deterministic`` runs every engine in deterministic mode
(docs/engine.md, "Deterministic mode"): compare its figures with a default run for the mode's cost.

Every round asks its own 2K requests of the task mix (round r's numbered from 2K r + 1;
``--same-requests``: 1..2K every round): greedy texts part at near-ties, and a single sample
of texts decides a ratio by which side's text its drafter can copy (:func:`round_requests`).

- ``slots``: one engine with ``slots = K`` serves 2K requests, K at a time: a finished
  request's slot takes the next one at once, as K concurrent clients keep a server busy
  (prefill included: every step mixes prompt chunks into the verify batch). Aggregate =
  generated tokens / wall time.
- ``sequential``: one engine with one slot runs the same 2K requests one after another.
- llama-server built from the same llama.cpp (``--llama-server PATH`` or
  ``$SPECFLEET_LLAMA_SERVER``; skipped with a message when absent): ``-np K`` with K
  concurrent clients sending the same 2K requests; ``--spec-type none`` beside plain,
  ``ngram-mod`` beside the default drafter and n-gram; each round's aggregate is also
  divided by its peer's of the same round (minutes apart, so load drift cancels):
  ``rounds_ahead_of_server`` of ``rounds_vs_server`` are above 1, ranging from
  ``round_vs_server_min`` to ``_max``; a median ratio within a few per cent of 1 is a tie
  unless the rounds agree. ``same_text_as_server`` is how much
  of the outputs the two wrote alike (:func:`same_text`): where it is low, a ratio compares
  different texts.

Then the time to first token of a request that arrives while 7 slots decode (p50/p95, and
the same request on an idle engine), and the fitted per-slot context and checkpoint
reservation for S = 1, 2, 4, 8 on Gemma and on the tiny hybrid (D = 1 vs D = N) under fixed
budgets. ``--gpu`` runs the engines with every layer offloaded (``n_gpu_layers = -1``).
Progress goes to stderr, the JSON summary to stdout, ``--markdown`` adds tables.

    ./.venv/bin/python bench/slots.py [--tokens 128] [--concurrency 1,2,4,8] [--reps 3]
        [--threads 2] [--methods plain,default,ngram] [--llama-server PATH] [--ttft-trials 10]
        [--gpu] [--model GGUF] [--deterministic] [--tasks mixed|copy] [--same-requests]
        [--sequential] [--device-verify auto|on|off] [--verify-buckets auto|on|off]
        [--markdown]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from peer_server import SERVER_ENV, complete, completion, find_server, llama_server  # noqa: E402
from prompts import MERGE_INTERVALS, chat_turn  # noqa: E402

from shared.logs import configure_logging  # noqa: E402
from shared.protocol import CheckpointMode, SpecMethod, SpecSettings  # noqa: E402
from worker.engine.engine import EngineConfig, SpeculativeEngine  # noqa: E402
from worker.engine.prefix_cache import common_prefix  # noqa: E402
from worker.engine.slot import Phase, SlotRequest  # noqa: E402
from worker.fitter import FitError, fit_worker  # noqa: E402
from worker.launch import EngineCapacity  # noqa: E402
from worker.testmodels import build_tiny_models  # noqa: E402
from worker.testmodels.gemma import gemma_q4_path  # noqa: E402

#: Per-slot context: every prompt plus its generation fits with room to spare.
N_CTX = 1024
#: n-gram speculation's width (and the memory table's n-gram rows).
DRAFT_MAX = 8
METHODS = {
    "plain": SpecSettings(method=SpecMethod.NONE),
    "default": SpecSettings(),
    "ngram": SpecSettings(method=SpecMethod.NGRAM, draft_max=DRAFT_MAX, adaptive=True),
}
SERVER_SPEC = {"plain": ("--spec-type", "none"), "default": ("--spec-type", "ngram-mod"),
               "ngram": ("--spec-type", "ngram-mod")}

CODE = MERGE_INTERVALS
ROWS = "\n".join(f"{i},item-{i * 7 % 13},{i * 3.25:.2f},{'yes' if i % 3 else 'no'}"
                 for i in range(1, 13))
#: Where a request's number goes (no two requests of a run are identical).
NUMBER = "{n}"
#: Copy-heavy requests, as spec_vs_plain asks them: Gemma's chat turn with the answer begun,
#: so the base model really copies (asked as bare text it rewrote the function instead:
#: acceptance ~0.7 at K = 1).
COPY_TASKS = [
    chat_turn(f"Request {NUMBER}. Rewrite the code exactly as it is, but rename the function "
              f"`merge_intervals` to `combine_ranges`. Output only the code.\n\n```python\n"
              f"{CODE}```", "```python\n"),
    chat_turn(f"Request {NUMBER}. Repeat the following Python code exactly, character for "
              f"character. Output only the code.\n\n```python\n{CODE}```", "```python\n"),
]
TASKS = [f"Request {NUMBER}. Copy this function exactly, renaming merge_intervals to "
         f"combine_ranges:\n\n{CODE}\n",
         f"Request {NUMBER}. Rewrite each CSV row (id,name,price,in_stock) as one JSON object "
         f"per line:\n\n{ROWS}\n",
         f"Request {NUMBER}. Copy this function exactly:\n\n{CODE}\n",
         f"Request {NUMBER}. Write a short story about a lighthouse keeper who finds a message "
         "in a bottle.\n"]
#: ``--tasks``: the mix above, or only the copy-heavy ones (the speculation ceiling).
TASK_SETS = {"mixed": TASKS, "copy": COPY_TASKS}
#: The task set of this run (``--tasks``).
CHOSEN_TASKS = [TASKS]


def prompts(engine: SpeculativeEngine, k: int, first: int = 1) -> list[list[int]]:
    """K different requests, numbered from ``first`` (the tasks cycled, each numbered so no
    two are identical)."""
    tasks = CHOSEN_TASKS[0]
    return [engine.model.tokenize(tasks[i % len(tasks)].replace(NUMBER, str(first + i)),
                                  parse_special=True) for i in range(k)]


def round_requests(engine: SpeculativeEngine, k: int, rep: int,
                   same: bool) -> list[list[int]]:
    """Round ``rep``'s 2K requests: its own sample of the task mix (numbered from
    ``2K * rep + 1``), or requests 1..2K in every round when ``same``.

    Greedy texts part at near-ties, and which text a request gets decides what any drafter
    can do with it: on requests 1-4 at K = 2 llama-server's request 1 writes a counting list
    (its first token a near-tie, margin 0.16) that its request 3 then writes again, drafted
    115 of 115 from ngram-mod's shared table, while ours writes the code and request 3 counts
    from scratch. Rounds that each ask other requests of the same tasks average over such
    draws; one fixed sample measures one draw (run X in docs/benchmarks.md)."""
    return prompts(engine, 2 * k, 1 if same else 2 * k * rep + 1)


#: Every engine of the run is deterministic (``--deterministic``).
DETERMINISTIC = [False]
#: ``--device-verify``: greedy verify rows reduced on the device (None: where it is a GPU).
DEVICE_VERIFY: list[bool | None] = [None]
#: ``--verify-buckets``: steps with drafts padded to replayable row counts (None: on a GPU).
VERIFY_BUCKETS: list[bool | None] = [None]


def open_engine(model: str, slots: int, threads: int, gpu: bool) -> SpeculativeEngine:
    """An engine loaded as a default worker is (``auto`` at its default width; it serves
    n-gram and plain requests too): each request says its method (METHODS)."""
    capacity = EngineCapacity(SpecMethod.AUTO)
    return SpeculativeEngine(EngineConfig(model, n_ctx=N_CTX, slots=slots, n_threads=threads,
                                          n_gpu_layers=-1 if gpu else 0, capacity=capacity,
                                          deterministic=DETERMINISTIC[0],
                                          device_verify=DEVICE_VERIFY[0],
                                          verify_buckets=VERIFY_BUCKETS[0]))


def together(engine: SpeculativeEngine, reqs: list[list[int]], tokens: int,
             spec: SpecSettings) -> tuple[dict[str, float], list[list[int]]]:
    """The requests on one engine, as many at a time as it has slots (a freed slot takes
    the next request before the next step); aggregate generated tok/s, and each request's
    tokens in request order."""
    t0, decode0 = time.perf_counter(), engine.decode_seconds
    read0 = engine.target.rows_read
    waiting, slots, steps = list(reqs), [], 0
    while waiting or engine.active:
        while waiting and engine.free_slots:
            slots.append(engine.admit(SlotRequest(waiting.pop(0), tokens, spec)))
        engine.step()
        steps += 1
    wall = time.perf_counter() - t0
    generated = sum(len(s.generated) for s in slots)
    rows = sum(s.counters.target_decodes + s.counters.drafted for s in slots)
    padded = sum(s.counters.padded_rows for s in slots)
    accepted = sum(s.counters.accepted for s in slots)
    drafted = sum(s.counters.drafted for s in slots)
    # Where a step's time goes: its rows and tokens, and its milliseconds (prefill included).
    rates = {"tok_s": generated / wall, "generated": generated, "wall_s": wall, "steps": steps,
             "ms_per_step": 1000 * wall / steps, "rows_per_step": rows / steps,
             # Rows added to reach replayable row counts (--verify-buckets), beside those.
             "padded_rows_per_step": padded / steps,
             "tokens_per_step": generated / steps,
             # What is not the target's decode: drafting, acceptance, bookkeeping, streaming.
             "host_ms_per_token": 1000 * (wall - engine.decode_seconds + decode0) / generated,
             "host_share": (wall - engine.decode_seconds + decode0) / wall,
             # Logits rows Python read (0 where every verify row was reduced on the device).
             "rows_read_per_token": (engine.target.rows_read - read0) / generated,
             "acceptance": accepted / drafted if drafted else 0.0,
             # The bar drafts had to clear at the end (1.1: the floor; higher: drafted steps
             # yielded less than plain ones, worker/engine/drafting/bar.py).
             "draft_bar": engine.planner.bar.level}
    if engine.planner.steps is not None and engine.planner.steps.predicted:
        # How far the row budget's step costs were off (1: exact; above 1: dearer than it
        # planned with).
        rates["step_cost_ratio"] = engine.planner.steps.observed / engine.planner.steps.predicted
    return rates, [list(s.generated) for s in slots]


def one_by_one(engine: SpeculativeEngine, reqs: list[list[int]], tokens: int,
               spec: SpecSettings) -> dict[str, float]:
    t0 = time.perf_counter()
    generated = sum(len(engine.generate(p, tokens, spec).tokens) for p in reqs)
    wall = time.perf_counter() - t0
    return {"tok_s": generated / wall, "generated": generated, "wall_s": wall}


#: A llama-server request that takes longer than this is reported as stalled, not waited for
#: (seen once: -np 8 with ngram-mod stopped computing mid-run on the loaded machine).
SERVER_TIMEOUT_S = 300.0


def server_together(url: str, reqs: list[list[int]], tokens: int,
                    clients: int) -> tuple[dict[str, float], list[list[int]]]:
    """``clients`` concurrent clients send ``reqs`` (each its next one when answered);
    aggregate tok/s and each request's tokens."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        answers = list(pool.map(lambda p: completion(url, p, tokens, SERVER_TIMEOUT_S), reqs))
    wall = time.perf_counter() - t0
    generated = sum(int(a["timings"]["predicted_n"]) for a in answers)  # type: ignore[index, misc]
    return ({"tok_s": generated / wall, "generated": generated, "wall_s": wall},
            [a["tokens"] for a in answers])  # type: ignore[misc]


def same_text(ours: list[list[int]], theirs: list[list[int]]) -> float:
    """How much of the outputs the two servers wrote alike: the mean, over requests, of the
    share of tokens before their texts first part. Greedy texts part at near-ties (the two
    servers batch rows differently), and a ratio between them is only a like-for-like one
    as far as the texts are the same: a request one server writes as a copy and the other
    does not is drafted at a different rate by any drafter."""
    return statistics.fmean(common_prefix(a, b) / max(1, min(len(a), len(b)))
                            for a, b in zip(ours, theirs, strict=True))


def _server_rates(args: argparse.Namespace, model: str, server: str, k: int,
                  reqs: list[list[int]],
                  ) -> tuple[dict[str, dict[str, float]], dict[str, list[list[int]]]]:
    """llama-server ``-np k`` under each spec type the methods compare with, run once each:
    the rates per spec type, and the texts of those that answered."""
    rates: dict[str, dict[str, float]] = {}
    texts: dict[str, list[list[int]]] = {}
    for spec in dict.fromkeys(SERVER_SPEC[m] for m in args.methods if m in SERVER_SPEC):
        try:
            with llama_server(server, model, args.threads, N_CTX * k, k, spec) as url:
                complete(url, reqs[0], 8, SERVER_TIMEOUT_S)  # warm-up
                rates[spec[1]], texts[spec[1]] = server_together(url, reqs, args.tokens, k)
        except (OSError, RuntimeError) as exc:  # urllib's errors are OSErrors
            rates[spec[1]] = {"error": f"{type(exc).__name__}: {exc}"}  # type: ignore[dict-item]
    return rates, texts


def _median_row(runs: list[dict[str, float]]) -> dict[str, float]:
    """Each figure's median over the repetitions (``runs``: one row per repetition)."""
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def throughput(args: argparse.Namespace, model: str, server: str | None) -> dict[str, object]:
    """For each K, ``--reps`` rounds of every method on the same 2K requests back to back,
    then llama-server on them (so load drift hits them alike); each round asks its own
    requests (:func:`round_requests`) and each figure is the median of its rounds. A round
    is a few seconds at K = 1, where one stray process moves a single run by 10-20 %. Our
    methods run in the opposite order every other round: on a host that slows through a run
    (llama-server plain at K = 1: 52 / 44 / 40 tok/s in run J's rounds), a fixed order
    favoured whichever ran first."""
    tables: dict[str, dict[str, dict[str, float]]] = {name: {} for name in args.methods}
    base = open_engine(model, 1, args.threads, args.gpu)
    for k in args.concurrency:
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in args.methods}
        served: dict[str, list[float]] = {}
        alike: dict[str, list[float]] = {}  # per method, per round: same_text vs its peer
        # Per method, per round: its aggregate over its peer's in the same round. Paired
        # rounds ran minutes apart, not a whole run, so load drift cancels in them.
        paired: dict[str, list[float]] = {}
        errors: dict[str, str] = {}
        for rep in range(args.reps):
            reqs = round_requests(base, k, rep, args.same_requests)
            outputs: dict[str, list[list[int]]] = {}
            for name in args.methods if rep % 2 == 0 else args.methods[::-1]:
                spec = METHODS[name]
                seq = one_by_one(base, reqs, args.tokens, spec) if args.sequential else None
                with open_engine(model, k, args.threads, args.gpu) as engine:
                    together(engine, reqs[:1], 8, spec)  # warm-up allocations
                    par, outputs[name] = together(engine, reqs, args.tokens, spec)
                row = {"slots_tok_s": par["tok_s"]} | {
                    key: par[key] for key in ("steps", "ms_per_step", "rows_per_step",
                                              "padded_rows_per_step",
                                              "tokens_per_step", "host_ms_per_token",
                                              "host_share", "rows_read_per_token",
                                              "acceptance", "draft_bar")}
                if "step_cost_ratio" in par:
                    row["step_cost_ratio"] = par["step_cost_ratio"]
                if seq is not None:
                    row |= {"sequential_tok_s": seq["tok_s"],
                            "ratio": par["tok_s"] / seq["tok_s"]}
                runs[name].append(row)
                print(f"[{rep + 1}/{args.reps}] {name:7s} K={k}: slots {par['tok_s']:6.1f} tok/s"
                      f" ({par['ms_per_step']:.2f} ms, {par['rows_per_step']:.1f} rows, "
                      f"{par['tokens_per_step']:.2f} tokens a step, host "
                      f"{par['host_ms_per_token']:.3f} ms a token ({par['host_share']:.0%}), "
                      f"{par['rows_read_per_token']:.2f} rows read a token, "
                      f"bar {par['draft_bar']:.2f})"
                      + (f", sequential {seq['tok_s']:6.1f}" if seq else ""),
                      file=sys.stderr, flush=True)
            if server:
                rates, texts = _server_rates(args, model, server, k, reqs)
                for spec_type, r in rates.items():
                    if "tok_s" in r:
                        served.setdefault(spec_type, []).append(r["tok_s"])
                    else:
                        errors[spec_type] = str(r["error"])
                for name, ours in outputs.items():
                    theirs = texts.get(SERVER_SPEC[name][1]) if name in SERVER_SPEC else None
                    if theirs is not None:
                        alike.setdefault(name, []).append(same_text(ours, theirs))
                        peer = rates[SERVER_SPEC[name][1]]["tok_s"]
                        paired.setdefault(name, []).append(runs[name][-1]["slots_tok_s"] / peer)
                print(f"[{rep + 1}/{args.reps}] llama-server -np {k}: " + ", ".join(
                    f"{spec} {r.get('tok_s', float('nan')):6.1f}" for spec, r in rates.items()),
                    file=sys.stderr, flush=True)
        for name in args.methods:
            row = _median_row(runs[name])
            srv = served.get(SERVER_SPEC[name][1], []) if name in SERVER_SPEC else []
            if srv:
                row["server_tok_s"] = statistics.median(srv)
                row["slots_vs_server"] = row["slots_tok_s"] / row["server_tok_s"]
                row["same_text_as_server"] = statistics.median(alike[name])
                row["rounds_ahead_of_server"] = sum(r > 1.0 for r in paired[name])
                row["rounds_vs_server"] = len(paired[name])
                row["round_vs_server_min"] = min(paired[name])
                row["round_vs_server_max"] = max(paired[name])
            elif name in SERVER_SPEC and SERVER_SPEC[name][1] in errors:
                row["server_error"] = errors[SERVER_SPEC[name][1]]  # type: ignore[assignment]
            tables[name][str(k)] = row
    base.close()
    plain = tables.get("plain", {})
    for rows in tables.values():
        for k, row in rows.items():
            if k in plain:
                row["vs_plain"] = row["slots_tok_s"] / plain[k]["slots_tok_s"]
            if "server_tok_s" in plain.get(k, {}):
                row["vs_server_plain"] = row["slots_tok_s"] / plain[k]["server_tok_s"]
    return dict(tables)


def ttft(args: argparse.Namespace, model: str) -> dict[str, object]:
    """First-token latency of a request arriving while 7 other slots decode."""
    spec = METHODS["default"]
    with open_engine(model, 8, args.threads, args.gpu) as engine:
        reqs = prompts(engine, 8)
        probe = reqs[-1]
        idle: list[float] = []
        busy: list[float] = []
        for _ in range(args.ttft_trials):
            t0 = time.perf_counter()
            engine.generate(probe, 1, spec)
            idle.append(time.perf_counter() - t0)
        background = [engine.admit(SlotRequest(p, 100_000, spec)) for p in reqs[:7]]
        while any(s.phase is Phase.PREFILL for s in background):
            engine.step()
        for _ in range(args.ttft_trials):
            for i, s in enumerate(background):  # keep 7 slots decoding
                if s.phase is Phase.DONE:
                    background[i] = engine.admit(SlotRequest(reqs[i], 100_000, spec))
            t0 = time.perf_counter()
            slot = engine.admit(SlotRequest(probe, 1, spec))
            while slot.phase is not Phase.DONE:
                engine.step()
            busy.append(time.perf_counter() - t0)
        for s in background:
            engine.cancel(s)
        while engine.active:
            engine.step()

    def pct(xs: list[float], q: float) -> float:
        return sorted(xs)[min(len(xs) - 1, round(q * (len(xs) - 1)))]

    summary = {"prompt_tokens": len(probe), "trials": args.ttft_trials,
               "busy_p50_s": statistics.median(busy), "busy_p95_s": pct(busy, 0.95),
               "idle_p50_s": statistics.median(idle), "idle_p95_s": pct(idle, 0.95)}
    print(f"TTFT with 7 slots decoding: p50 {summary['busy_p50_s'] * 1e3:.0f} ms, p95 "
          f"{summary['busy_p95_s'] * 1e3:.0f} ms (idle p50 {summary['idle_p50_s'] * 1e3:.0f} ms)",
          file=sys.stderr, flush=True)
    return summary


def memory(model: str, device: str) -> dict[str, object]:
    """Fitted per-slot context and checkpoint reservation per S under fixed budgets."""
    with tempfile.TemporaryDirectory() as tmp:
        hybrid = str(build_tiny_models(Path(tmp)).hybrid)
        cases = {
            "gemma_ngram": (model, 600.0, EngineCapacity(SpecMethod.NGRAM, DRAFT_MAX)),
            "hybrid_mtp_D1": (hybrid, 6.0, EngineCapacity(SpecMethod.MTP, 5, rollback_depth=1)),
            "hybrid_mtp_DN": (hybrid, 6.0, EngineCapacity(SpecMethod.MTP, 5)),
        }
        out: dict[str, object] = {}
        for name, (path, budget, capacity) in cases.items():
            rows: dict[str, object] = {}
            for s in (1, 2, 4, 8):
                try:
                    r = fit_worker(path, device=device, budget_mib=budget, fit_target_mib=0,
                                   slots=s, capacity=capacity, ctx_min=256,
                                   checkpoint=CheckpointMode.DEVICE).report
                except FitError as exc:
                    rows[str(s)] = {"error": str(exc).split(";")[0]}
                    continue
                rows[str(s)] = {"n_ctx_per_slot": r.n_ctx, "total_mib": r.total_bytes / 2**20,
                                "kv_mib": r.components["kv"] / 2**20,
                                "recurrent_and_snapshots_mib":
                                    (r.components["recurrent"] + r.components["snapshots"])
                                    / 2**20,
                                "checkpoint_reservation_mib":
                                    r.components["checkpoint_reservation"] / 2**20}
            out[name] = {"budget_mib": budget, "by_slots": rows}
    return out


def _cell(row: dict[str, float], key: str, fmt: str = ".1f") -> str:
    v = row.get(key)
    return format(v, fmt) if isinstance(v, float) else "-"


def _ahead(row: dict[str, float]) -> str:
    """"a/n (lo-hi)": rounds of n where the method's aggregate beat its peer's of the same
    round, and the range of those per-round ratios."""
    if "rounds_vs_server" not in row:
        return "-"
    return (f"{row['rounds_ahead_of_server']:.0f}/{row['rounds_vs_server']:.0f} "
            f"({row['round_vs_server_min']:.2f}-{row['round_vs_server_max']:.2f})")


def markdown(summary: dict[str, object]) -> str:
    lines = ["| method | K | slots tok/s | vs plain | llama-server -np K tok/s (its peer) "
             "| vs llama-server plain | vs its peer | rounds ahead of its peer "
             "| same text as its peer | ms a step | rows a step | tokens a step "
             "| host ms a token | host share | logits rows read a token |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, rows in summary["throughput"].items():  # type: ignore[union-attr, attr-defined]
        for k, r in rows.items():
            lines.append(f"| {name} | {k} | {_cell(r, 'slots_tok_s')} | "
                         f"{_cell(r, 'vs_plain', '.2f')} | {_cell(r, 'server_tok_s')} | "
                         f"{_cell(r, 'vs_server_plain', '.2f')} | "
                         f"{_cell(r, 'slots_vs_server', '.2f')} | {_ahead(r)} | "
                         f"{_cell(r, 'same_text_as_server', '.2f')} | "
                         f"{_cell(r, 'ms_per_step', '.2f')} | {_cell(r, 'rows_per_step', '.1f')} "
                         f"| {_cell(r, 'tokens_per_step', '.2f')} "
                         f"| {_cell(r, 'host_ms_per_token', '.3f')} "
                         f"| {_cell(r, 'host_share', '.2f')} "
                         f"| {_cell(r, 'rows_read_per_token', '.2f')} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128, help="tokens generated per request")
    ap.add_argument("--concurrency", default="1,2,4,8", help="comma list of K")
    ap.add_argument("--methods", default=",".join(METHODS), help="comma list")
    ap.add_argument("--tasks", choices=sorted(TASK_SETS), default="mixed",
                    help="request mix: copy, CSV->JSON and prose (mixed), or copying only")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads, both sides")
    ap.add_argument("--llama-server", default=os.environ.get(SERVER_ENV),
                    help=f"llama-server binary (default ${SERVER_ENV}); absent = ours only")
    ap.add_argument("--reps", type=int, default=3,
                    help="interleaved rounds per K (medians are reported), each with its own "
                         "requests of the task mix")
    ap.add_argument("--same-requests", action="store_true",
                    help="every round asks requests 1..2K (one sample of texts)")
    ap.add_argument("--ttft-trials", type=int, default=10)
    ap.add_argument("--sequential", action="store_true",
                    help="also run the 2K requests one at a time on one slot (slots vs sequential)")
    ap.add_argument("--gpu", action="store_true", help="offload every layer (n_gpu_layers -1)")
    ap.add_argument("--model", help="Gemma 3 270M Q4_K_M GGUF (default: the demo extra's "
                    "package; a path for a host that cannot install it)")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: "
                    "throughput,ttft,memory")
    ap.add_argument("--deterministic", action="store_true",
                    help="every engine in deterministic mode (compare with a run without)")
    ap.add_argument("--device-verify", choices=("auto", "on", "off"), default="auto",
                    help="greedy verify rows reduced on the device (auto: on a GPU only)")
    ap.add_argument("--verify-buckets", choices=("auto", "on", "off"), default="auto",
                    help="steps with drafts padded to row counts a GPU replays (auto: on a "
                         "GPU only)")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    DETERMINISTIC[0] = args.deterministic
    DEVICE_VERIFY[0] = {"auto": None, "on": True, "off": False}[args.device_verify]
    VERIFY_BUCKETS[0] = {"auto": None, "on": True, "off": False}[args.verify_buckets]
    args.concurrency = [int(k) for k in args.concurrency.split(",")]
    args.methods = args.methods.split(",")
    CHOSEN_TASKS[0] = TASK_SETS[args.tasks]
    skip = set(args.skip.split(","))

    configure_logging(level="warning")
    model = args.model or str(gemma_q4_path())
    server = find_server(args.llama_server)
    if server is None and "throughput" not in skip:
        print(f"llama-server not found ({args.llama_server or '$' + SERVER_ENV + ' unset'}): "
              "running specfleet only; build it as docs/benchmarks.md says", file=sys.stderr)
    summary: dict[str, object] = {"tokens": args.tokens, "threads": args.threads,
                                  "gpu": args.gpu, "n_ctx_per_slot": N_CTX,
                                  "draft_max": DRAFT_MAX, "deterministic": args.deterministic,
                                  "device_verify": args.device_verify,
                                  "verify_buckets": args.verify_buckets,
                                  "tasks": args.tasks, "same_requests": args.same_requests}
    if "throughput" not in skip:
        summary["throughput"] = throughput(args, model, server)
    if "ttft" not in skip:
        summary["ttft"] = ttft(args, model)
    if "memory" not in skip:
        summary["memory"] = memory(model, "cuda:0" if args.gpu else "cpu")
    print(json.dumps(summary, indent=2))
    if args.markdown and "throughput" in summary:
        print(markdown(summary))


if __name__ == "__main__":
    main()
