"""Batch invariance and cost of the embedding decodes: a text's vector alone against the same
text among 29 others of 1-40 words (6 shuffles, every input taken as the serving loop takes
them), and the milliseconds an input costs.

Two packings of the same Embedder context: ``embedder`` (``Embedder.embed_next``: a shape
that follows from the input, worker/engine/embedding.py) and ``one_decode`` (the packing it
replaced: every pending input that fits in one decode of the context's width). Reports the
worst cosine of a text with itself and how many of the 180 placements were the same float32
bits, then ms per input for one 4-token text, one 11-token query, the 30 texts and 200 texts
of 1-3 words. Hold the bench lock: ``flock /tmp/specfleet-bench.lock``.

    ./.venv/bin/python bench/embedding_invariance.py [--model gemma|gemma-f16|PATH]
        [--threads 2] [--tokens 512]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.logs import configure_logging  # noqa: E402
from worker.engine.config import EngineConfig, embedding_spec  # noqa: E402
from worker.engine.embedding import Embedder  # noqa: E402
from worker.llm import Batch, Model, ModelSpec  # noqa: E402
from worker.testmodels.gemma import gemma_f16_path, gemma_q4_path  # noqa: E402

WORDS = ("the", "cat", "sat", "on", "a", "mat", "while", "redis", "kept", "every", "key", "in",
         "memory", "and", "the", "fleet", "decoded", "tokens", "fast")
Packing = Callable[[Sequence[Sequence[int]]], list[np.ndarray]]


def one_decode(embedder: Embedder) -> Packing:
    """The replaced packing: the leading inputs whose tokens and sequences fit the context,
    in one decode."""
    batch = Batch(embedder.spec.n_batch)

    def embed(pending: Sequence[Sequence[int]]) -> list[np.ndarray]:
        used, n = 0, 0
        batch.clear()
        for tokens in pending:
            if n == embedder.spec.n_seq_max or used + len(tokens) > embedder.max_tokens:
                break
            batch.add(tokens, 0, True, seq=n)
            used, n = used + len(tokens), n + 1
        try:
            embedder.context.decode(batch)
            pooled = [embedder.context.pooled(seq).astype(np.float64) for seq in range(n)]
            return [(v / np.linalg.norm(v)).astype(np.float32) for v in pooled]
        finally:
            embedder.context.clear()
    return embed


def embed_all(embed: Packing, inputs: Sequence[Sequence[int]]) -> list[np.ndarray]:
    vectors: list[np.ndarray] = []
    while len(vectors) < len(inputs):
        vectors += embed(inputs[len(vectors):])
    return vectors


def invariance(embed: Packing, inputs: list[list[int]], rng: random.Random) -> dict[str, object]:
    alone = [embed([tokens])[0] for tokens in inputs]
    worst, same, placements = 1.0, 0, 0
    for _ in range(6):
        order = list(range(len(inputs)))
        rng.shuffle(order)
        for i, vector in zip(order, embed_all(embed, [inputs[i] for i in order]), strict=True):
            worst = min(worst, float(alone[i].astype(np.float64) @ vector.astype(np.float64)))
            same += bool(np.array_equal(alone[i], vector))
            placements += 1
    return {"worst_cosine": round(worst, 7), "same_bits": f"{same}/{placements}"}


def ms_per_input(embed: Packing, inputs: list[list[int]], repeats: int) -> float:
    embed_all(embed, inputs)
    start = time.perf_counter()
    for _ in range(repeats):
        embed_all(embed, inputs)
    return round((time.perf_counter() - start) / repeats / len(inputs) * 1000, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma", help="gemma, gemma-f16 or a GGUF path")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=512, help="the embedding context's tokens")
    args = ap.parse_args()
    configure_logging(level="warning")
    path = {"gemma": gemma_q4_path, "gemma-f16": gemma_f16_path}.get(
        args.model, lambda: Path(args.model))()
    with Model(ModelSpec(str(path))) as model:
        spec = embedding_spec(EngineConfig(model_path=str(path), n_threads=args.threads,
                                           embedding_tokens=args.tokens))
        assert spec is not None
        embedder = Embedder(model, spec)
        rng = random.Random(0)
        texts = [model.tokenize(" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40))))
                 for _ in range(30)]
        tiny = [model.tokenize(" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3))))
                for _ in range(200)]
        out: dict[str, object] = {"model": path.name, "threads": args.threads}
        try:
            for name, embed in (("one_decode", one_decode(embedder)),
                                ("embedder", embedder.embed_next)):
                out[name] = {
                    **invariance(embed, texts, random.Random(1)),
                    "ms_one_short_text": ms_per_input(embed, [model.tokenize("the cat sat")], 30),
                    "ms_one_query": ms_per_input(embed, [model.tokenize(
                        "which key does redis keep in memory for the fleet")], 20),
                    "ms_per_input_30_texts": ms_per_input(embed, texts, 4),
                    "ms_per_input_200_tiny": ms_per_input(embed, tiny, 2),
                }
        finally:
            embedder.close()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
