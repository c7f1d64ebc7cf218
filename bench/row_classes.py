"""Which decode widths compute a row's logits alike, bit for bit, and how far a row's top-token
margin moves when its own width class or its KV history changes.

Greedy output leaves plain decoding, and a repeated request leaves its first answer, where
two computations of the same row round differently and a near-tie goes the other way. On a
CPU the backend picks kernels by the number of rows in a product (docs/engine.md,
"Deterministic mode"), so the widths fall into classes: within one, a row's logits are the
same bits whatever the width; across two, they are not. This finds the classes where the
engine runs (one model, one build, one backend), and measures the two sources of noise a
repeat meets:

- ``classes``: widths grouped by whether their rows equal, bit for bit, the same rows decoded
  at the group's first width (the same tokens at the same positions after the same prompt);
- ``history``: the same verify rows after their 16 history positions were decoded one row at
  a time (as plain steps write them) instead of in one batch: how far each row's margin of
  its top token moves (median, 90th percentile, max);
- ``row_class``: the same rows, the same history, decoded at a width of another class.

Gemma 3 270M Q4_K_M on an AVX-512 CPU, llama.cpp of llama-cpp-python 0.3.36: 8-63 rows are
one class and 64 rows up another (64 query rows switch the CPU flash-attention kernel to its
tiled path, ``GGML_FA_TILE_Q``); 1, 2-3, 4 and 5 rows differ from both and from each other
(the repacked 4-row product and its 1-3-row tail, the output layer's product below 8 rows).
A changed history moves the margins about as far as a changed class: median 0.12 and 0.14
(docs/benchmarks.md, "Warm partings").

    ./.venv/bin/python bench/row_classes.py [--model gemma|PATH] [--gpu] [--threads 2]
        [--depth 300]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.logs import configure_logging  # noqa: E402
from worker.llm import Batch, Context, ContextSpec, Model, ModelSpec  # noqa: E402
from worker.testmodels.gemma import gemma_q4_path  # noqa: E402

#: Widths compared; each one's first :data:`ROWS` rows (decoded in chunks of it where it is
#: narrower) are checked against the classes found so far.
WIDTHS = (1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 48, 63, 64, 65, 96, 128)
ROWS = 16
#: History positions decoded before the compared rows in the history measurement.
HISTORY = 16
#: Text the rows decode (any text: only the arithmetic is compared).
TEXT = Path(__file__).resolve().parents[1] / "docs" / "engine.md"


class Rows:
    """Decodes the same tokens after the same prompt in differently sized batches."""

    def __init__(self, context: Context, tokens: list[int], depth: int) -> None:
        self.context = context
        self.prompt, self.rest = tokens[:depth], tokens[depth:]
        self.batch = Batch(max(max(WIDTHS), depth))

    def logits(self, history: list[int], chunks: list[int]) -> np.ndarray:
        """Logits of the rows after the prompt and ``sum(history)`` positions (decoded in
        batches of the ``history`` sizes), decoded in batches of the ``chunks`` sizes."""
        ctx = self.context
        ctx.clear()
        ctx.decode(self.batch.set(self.prompt, 0, False))
        pos, rows = len(self.prompt), []
        for i, n in enumerate([*history, *chunks]):
            at = pos - len(self.prompt)
            ctx.decode(self.batch.set(self.rest[at:at + n], pos, True))
            if i >= len(history):
                rows.append(ctx.logits_rows(0, n).copy())
            pos += n
        return np.concatenate(rows)


def chunks(width: int, rows: int) -> list[int]:
    """Batches of ``width`` covering at least ``rows`` rows."""
    return [width] * -(-rows // width)


def classes(rows: Rows) -> list[list[int]]:
    """Widths grouped by bit-identical first :data:`ROWS` rows."""
    found: list[tuple[np.ndarray, list[int]]] = []
    for width in WIDTHS:
        z = rows.logits([], chunks(width, ROWS))[:ROWS]
        for first, members in found:
            if np.array_equal(first, z):
                members.append(width)
                break
        else:
            found.append((z, [width]))
        print(f"width {width}: class {len(found)}", file=sys.stderr, flush=True)
    return [members for _, members in found]


def margin_moves(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    """Per row: how far the margin of ``a``'s top token over its best rival moved in ``b``."""
    moves = []
    for x, y in zip(a, b, strict=True):
        top = int(np.argmax(x))
        rival_x = np.delete(x, top).max()
        rival_y = np.delete(y, top).max()
        moves.append(abs(float(x[top] - rival_x) - float(y[top] - rival_y)))
    return {"median": round(statistics.median(moves), 4),
            "p90": round(float(np.percentile(moves, 90)), 4), "max": round(max(moves), 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma", help="gemma or a GGUF path")
    ap.add_argument("--gpu", action="store_true", help="offload every layer (n_gpu_layers -1)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--depth", type=int, default=300, help="prompt tokens before the rows")
    args = ap.parse_args()
    configure_logging(level="warning")
    path = gemma_q4_path() if args.model == "gemma" else Path(args.model)
    spec = ContextSpec(n_ctx=4096, n_batch=512, n_ubatch=512, n_outputs_max=max(WIDTHS),
                       n_threads=args.threads)
    with Model(ModelSpec(str(path), n_gpu_layers=-1 if args.gpu else 0)) as model, \
            Context(model, spec) as context:
        tokens = model.tokenize(TEXT.read_text() * 2)
        rows = Rows(context, tokens, args.depth)
        out: dict[str, object] = {"model": path.name, "gpu": args.gpu, "depth": args.depth,
                                  "classes": classes(rows)}
        batched = rows.logits([HISTORY], [64])
        out["history"] = {
            "one_row_steps_vs_one_batch": margin_moves(batched,
                                                       rows.logits([1] * HISTORY, [64])),
            "four_row_steps_vs_one_batch": margin_moves(batched,
                                                        rows.logits([4] * (HISTORY // 4), [64])),
        }
        out["row_class"] = {
            "32_vs_64_rows": margin_moves(batched[:32], rows.logits([HISTORY], [32])),
            "one_row_steps_vs_64_rows": margin_moves(batched[:ROWS],
                                                     rows.logits([HISTORY], [1] * ROWS)),
        }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
