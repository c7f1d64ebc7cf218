"""Deterministic mode: greedy output on Gemma Q4_K_M that does not depend on the drafter
(so on draft length and batch width), on the slot count or on the run.

The engines run in a fresh interpreter: the mode turns one of ggml's process-wide kernel
switches off, which ggml reads at the process's first matrix product (other tests have
decoded long before this one runs).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import specfleet

from worker.engine.config import EngineConfig
from worker.launch import DETERMINISTIC_CPU_ONLY
from worker.llm import Batch

PROMPTS = 20
MAX_TOKENS = 8

#: Runs every configuration twice (the second pass on the same engines, so with prefix reuse
#: and the suffix drafter's cache warm: other batch shapes again) in one process and prints
#: {config: [tokens per prompt]}.
CHILD = r"""
import json, sys
from shared.protocol import SpecMethod, SpecSettings
from worker.launch import EngineCapacity
from worker.engine.engine import EngineConfig, SpeculativeEngine
from worker.engine.slot import SlotRequest

model, n_prompts, max_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
texts = [f"Question {i}: in one paragraph, why is the number {i * 7 + 3} interesting?"
         for i in range(n_prompts)]
out, flags = {}, set()
for slots in (1, 4):
    config = EngineConfig(model, n_ctx=256, slots=slots, n_threads=2, deterministic=True,
                          capacity=EngineCapacity(SpecMethod.SUFFIX, 8))
    with SpeculativeEngine(config) as engine:
        ids = [engine.tokenize(t) for t in texts]
        for run in (1, 2):
            for method in (SpecMethod.NONE, SpecMethod.NGRAM, SpecMethod.SUFFIX):
                spec = SpecSettings(method=method, draft_max=8)
                results, pending, live = [None] * n_prompts, list(range(n_prompts)), {}
                while pending or live:
                    while pending and engine.free_slots:
                        i = pending.pop(0)
                        live[i] = engine.admit(SlotRequest(ids[i], max_tokens, spec))
                    for update in engine.step():
                        if update.result is not None:
                            i = next(k for k, s in live.items() if s is update.slot)
                            results[i] = update.result.tokens
                            flags.add(update.result.telemetry.deterministic)
                            del live[i]
                out[f"run{run}-{method}-{slots}"] = results
print(json.dumps({"tokens": out, "deterministic": sorted(flags)}))
"""


@pytest.mark.timeout(1200)  # 120 decodes of Gemma in a child process; ~2 min when quiet
def test_greedy_tokens_are_the_same_for_every_drafter_slot_count_and_run(
        gemma_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    child = subprocess.run([sys.executable, "-c", CHILD, str(gemma_path), str(PROMPTS),
                            str(MAX_TOKENS)], cwd=root, capture_output=True, text=True,
                           timeout=1500, check=False)
    assert child.returncode == 0, child.stderr[-3000:]
    report = json.loads(child.stdout.strip().splitlines()[-1])
    assert report["deterministic"] == [True], "every result's telemetry says its mode"
    runs: dict[str, list[list[int]]] = report["tokens"]
    reference = runs.pop("run1-none-1")
    assert len(reference) == PROMPTS and all(len(t) == MAX_TOKENS for t in reference)
    for name, tokens in runs.items():
        differ = [i for i, (a, b) in enumerate(zip(tokens, reference, strict=True)) if a != b]
        assert not differ, f"{name}: prompts {differ} differ from plain greedy on one slot"


def test_a_gpu_engine_refuses_deterministic_mode() -> None:
    with pytest.raises(ValueError, match="only guaranteed on the CPU backend"):
        EngineConfig("m.gguf", n_gpu_layers=-1, deterministic=True)
    assert "--device cpu" in DETERMINISTIC_CPU_ONLY


def test_every_sequence_is_padded_to_an_even_row_count() -> None:
    with Batch(16) as batch:
        batch.add([5, 6, 7], 10, True, seq=0)
        batch.add([8, 9], 4, False, seq=1)
        batch.add([3], 0, False, seq=2)
        pads = batch.pad_even()
        assert pads == [(0, 13), (2, 1)]
        raw = batch.raw
        assert batch.n_tokens == 8
        assert [raw.seq_id[r][0] for r in (6, 7)] == [0, 2]
        assert [raw.pos[r] for r in (6, 7)] == [13, 1]
        assert [bool(raw.logits[r]) for r in (6, 7)] == [True, False]
        batch.drop(len(pads))
        assert batch.n_tokens == 6


def test_the_worker_refuses_deterministic_on_a_gpu(dense_model: Path) -> None:
    result = specfleet("worker", "--model", str(dense_model), "--device", "cuda:0",
                       "--deterministic")
    assert result.returncode != 0
    assert "only guaranteed on the CPU backend" in result.stdout + result.stderr
