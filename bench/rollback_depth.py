"""Compact rollback vs full-depth rollback: what does D = 1 cost or save at N = 5 with MTP?

Runs, side by side in one process and interleaved round-robin so machine noise hits every
configuration alike, the tiny hybrid model (``qwen35`` with a NextN head, written on the fly)
with MTP drafting at draft maximum N = 5 under: full-depth rollback (D = N, one snapshot per
draft position), compact rollback D = 1 with device checkpoints, and D = 1 with host
checkpoints. Prints progress on stderr and a JSON summary on stdout: per configuration the
medians of tokens/s, acceptance, replay events/tokens and checkpoint saves, the median of the
per-rep ratio to full depth, plus the recurrent memory llama.cpp allocated for the target
context and the checkpoint it reserved.

    ./.venv/bin/python bench/rollback_depth.py [--reps N] [--tokens N] [--threads T]

Rates are the engine's ``effective_tokens_per_second``: the decode loop's wall time, drafting,
checkpoints and replays included, prefill excluded. Logging is configured as a worker's (JSON,
info level, so every ``rollback.replay`` event is rendered) but written to ``/dev/null``: its
cost is measured without drowning the progress lines.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.logs import configure_logging  # noqa: E402
from shared.protocol import CheckpointMode, SpecMethod  # noqa: E402
from worker.engine.engine import EngineConfig, SpeculativeEngine  # noqa: E402
from worker.engine.rollback.compact import CompactRollback  # noqa: E402
from worker.fitter.buffers import parse_buffers  # noqa: E402
from worker.launch import EngineCapacity  # noqa: E402
from worker.llm import capture_llama_log  # noqa: E402
from worker.testmodels import write_qwen35_hybrid  # noqa: E402

DRAFT_MAX = 5
PROMPT = [5, 17, 42, 99, 3, 250, 8, 61]
N_CTX = 2048
#: name -> (rollback depth D, checkpoint storage)
CONFIGS = {
    f"full_depth_D{DRAFT_MAX}": (DRAFT_MAX, CheckpointMode.DEVICE),
    "compact_D1_device": (1, CheckpointMode.DEVICE),
    "compact_D1_host": (1, CheckpointMode.HOST),
}
METRICS = ("tokens_per_second", "decode_tokens_per_second", "acceptance",
           "mean_accepted_length", "target_decodes", "replay_events", "replay_tokens",
           "checkpoint_saves")


def open_engine(model: Path, depth: int, mode: CheckpointMode,
                threads: int) -> tuple[SpeculativeEngine, dict[str, int]]:
    """An MTP engine at N = 5 and depth D, with its checkpoint reserved as a worker does, and
    the recurrent and checkpoint bytes llama.cpp reported while building it."""
    capacity = EngineCapacity(SpecMethod.MTP, DRAFT_MAX, rollback_depth=depth)
    with capture_llama_log() as lines:
        engine = SpeculativeEngine(EngineConfig(str(model), n_ctx=N_CTX, n_threads=threads,
                                                capacity=capacity, checkpoint=mode))
        reserved = (engine.rollback.reserve(engine.target).bytes_per_slot
                    if isinstance(engine.rollback, CompactRollback) else 0)
    # Only the target has recurrent state: qwen35's MTP draft context holds just the NextN
    # layer's KV, so every "RS buffer" line is the target's.
    return engine, {"n_rs_seq": engine.target.n_rs_seq,
                    "target_recurrent_bytes": parse_buffers(lines).total("recurrent"),
                    "checkpoint_reserved_bytes": reserved}


def run(engine: SpeculativeEngine, tokens: int) -> dict[str, float]:
    t = engine.generate(PROMPT, tokens).telemetry
    return {"tokens_per_second": t.effective_tokens_per_second,
            "decode_tokens_per_second": t.tokens_per_second, "acceptance": t.acceptance,
            "mean_accepted_length": t.mean_accepted_length, "target_decodes": t.target_decodes,
            "replay_events": t.replay_events,
            "replay_tokens": t.replay_tokens, "checkpoint_saves": t.checkpoint_saves}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7, help="repetitions per configuration")
    ap.add_argument("--tokens", type=int, default=1000, help="tokens generated per run")
    ap.add_argument("--threads", type=int, default=1, help="llama.cpp threads")
    args = ap.parse_args()
    configure_logging(level="info", fmt="json", stream=open(os.devnull, "w"))  # noqa: SIM115

    with tempfile.TemporaryDirectory() as tmp:
        model = write_qwen35_hybrid(Path(tmp) / "tiny-qwen35-mtp.gguf")
        engines = {name: open_engine(model, depth, mode, args.threads)
                   for name, (depth, mode) in CONFIGS.items()}
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in CONFIGS}
        outputs: dict[str, list[int]] = {}
        for rep in range(args.reps):
            for name, (engine, _) in engines.items():
                r = run(engine, args.tokens)
                runs[name].append(r)
                print(f"[rep {rep + 1}/{args.reps}] {name:20s} {r['tokens_per_second']:8.1f} tok/s"
                      f"  replays {r['replay_events']:4.0f} / {r['replay_tokens']:4.0f} tokens",
                      file=sys.stderr, flush=True)
        for name, (engine, _) in engines.items():
            outputs[name] = engine.generate(PROMPT, args.tokens).tokens
            engine.close()
    same = len({tuple(tokens) for tokens in outputs.values()}) == 1
    print(json.dumps(summarize(runs, {n: m for n, (_, m) in engines.items()}, same, args),
                     indent=2))


def summarize(runs: dict[str, list[dict[str, float]]], memory: dict[str, dict[str, int]],
              identical: bool, args: argparse.Namespace) -> dict[str, object]:
    summary: dict[str, object] = {"model": "tiny qwen35 + NextN (F32)", "draft_max": DRAFT_MAX,
                                  "tokens": args.tokens, "reps": args.reps,
                                  "threads": args.threads, "outputs_identical": identical}
    full = runs[f"full_depth_D{DRAFT_MAX}"]
    for name, rs in runs.items():
        medians = {key: round(statistics.median(r[key] for r in rs), 3) for key in METRICS}
        # Paired within each rep (the runs were adjacent in time), then the median: machine
        # load drifts between reps far more than between neighbouring runs.
        paired = [r["tokens_per_second"] / f["tokens_per_second"]
                  for r, f in zip(rs, full, strict=True)]
        medians["ratio_to_full_depth"] = round(statistics.median(paired), 3)
        summary[name] = {**medians, **memory[name]}
    return summary


if __name__ == "__main__":
    main()
