"""What a decode of r rows costs where the engine runs, and what changes that cost on a GPU.

The row-cost tables (worker/engine/drafting/curve.py, draft_cost.py) decide how wide to draft;
on a GPU two things move the true cost away from a naive timing, and this measures both:

- ``queued_ms`` against ``finished_ms``: one decode of r rows on an empty context, timed
  around ``llama_decode`` alone (what the tables timed until they waited for the device: on
  CUDA that call returns once the kernels are queued) and as the tables time it now
  (:func:`~worker.engine.drafting.curve.time_decodes`, which waits). On the CPU backend the
  two agree.
- ``steady_ms_per_step``: 300 steps decoding at a growing position, reading every row's
  argmax and rolling back all but two rows, as a verify does: at one row, at a constant 9
  and 33 rows, at widths alternating 8/9, and at random widths 2..17. llama.cpp's CUDA
  backend replays a captured CUDA graph only after two consecutive decodes of the same
  shape, so a constant width can run much cheaper per step than varying ones; on the CPU
  they differ by the rows' work only.
- the same for the widths of a speculative run (:func:`speculative_widths`: a plain row a
  step where nothing was drafted, else a verify of up to 8 drafts), decoded as drafted
  (``spec_raw``, ``drafting_raw`` without the plain steps) and padded to their buckets as
  ``--verify-buckets`` pads them (``spec_bucketed``, ``drafting_bucketed``:
  worker/engine/drafting/buckets.py). ``same_shape_share`` is the share of each pattern's
  steps with the previous step's row count, the steps a GPU can run from a captured graph;
  ``rows_per_step`` what the pads add. On a GPU, ``*_bucketed`` below ``*_raw`` says the
  replays are worth their pad rows.

Progress on stderr, JSON on stdout; the minimum of ``--reps`` repeats per width.

    ./.venv/bin/python bench/decode_timing.py [--model tiny|gemma|PATH] [--gpu] [--reps 7]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.logs import configure_logging  # noqa: E402
from worker.engine.drafting.buckets import bucket  # noqa: E402
from worker.engine.drafting.curve import time_decodes  # noqa: E402
from worker.llm import Batch, Context, ContextSpec, Model, ModelSpec  # noqa: E402
from worker.testmodels import build_tiny_models  # noqa: E402
from worker.testmodels.gemma import gemma_q4_path  # noqa: E402

WIDTHS = (1, 2, 4, 8, 16, 32, 64)
STEPS = 300
PROMPT_ROWS = 32


def queued(context: Context, batch: Batch, rows: int, reps: int) -> float:
    """Milliseconds of the fastest of ``reps`` ``rows``-row decodes on an empty context,
    timed without waiting for the device (as the row-cost tables did before)."""
    best = float("inf")
    for _ in range(reps):
        context.clear()
        t0 = time.perf_counter()
        context.decode(batch.set([0] * rows, 0, True))
        best = min(best, time.perf_counter() - t0)
        context.synchronize()  # before the next clear: only the timing leaves it out
    context.clear()
    return round(best * 1e3, 3)


def steady(context: Context, batch: Batch, widths: list[int],
           read: list[int] | None = None) -> float:
    """Milliseconds per step of verify-like decodes at ``widths``, one step after another;
    ``read[i]``: the rows of step i whose argmax is read (default: all; a padded step's
    pads are never read)."""
    context.clear()
    context.decode(batch.set([1] * PROMPT_ROWS, 0, False))
    context.synchronize()
    pos = PROMPT_ROWS
    t0 = time.perf_counter()
    for rows, wanted in zip(widths, read or widths, strict=True):
        context.decode(batch.set([2 + pos % 50] * rows, pos, True))
        context.logits_rows(0, wanted).argmax(axis=1)
        pos += min(2, rows)  # two rows accepted, the rest rolled back
        context.seq_rm(pos, -1)
    return round((time.perf_counter() - t0) / len(widths) * 1e3, 3)


#: A speculative run's verifies: drafts of up to this many tokens (n-gram's default width),
#: a plain step (nothing drafted) this share of the time.
SPEC_DRAFT_MAX = 8
PLAIN_SHARE = 0.3


def speculative_widths(rng: random.Random, plain_share: float) -> list[int]:
    """:data:`STEPS` verify widths as a speculative run decodes them: one row where nothing
    was drafted (``plain_share`` of the steps), else 1 + a draft of 1..:data:`SPEC_DRAFT_MAX`
    tokens (a drafter that cuts its drafts where its confidence falls)."""
    return [1 if rng.random() < plain_share else 1 + rng.randint(1, SPEC_DRAFT_MAX)
            for _ in range(STEPS)]


def padded(widths: list[int]) -> list[int]:
    """``widths`` as ``--verify-buckets`` decodes them: a verify padded to its bucket (one
    slot: at most a verify of the widest draft), a plain step as it is."""
    return [bucket(w, SPEC_DRAFT_MAX + 1) if w > 1 else w for w in widths]


def same_shape_share(widths: list[int]) -> float:
    """The share of steps with the previous step's row count: the ones ggml-cuda can run from
    a captured graph (the first step after a change never is)."""
    return round(sum(a == b for a, b in zip(widths, widths[1:], strict=False))
                 / max(1, len(widths) - 1), 3)


def measure(model_path: Path, gpu: bool, reps: int, threads: int) -> dict[str, object]:
    rng = random.Random(0)
    spec = speculative_widths(random.Random(1), PLAIN_SHARE)
    drafting = speculative_widths(random.Random(2), 0.0)
    patterns: dict[str, Callable[[], list[int]]] = {
        "w1": lambda: [1] * STEPS,
        "w9": lambda: [9] * STEPS,
        "w33": lambda: [33] * STEPS,
        "w8_9_alternating": lambda: [8, 9] * (STEPS // 2),
        "w2_to_17_random": lambda: [rng.randint(2, 17) for _ in range(STEPS)],
        "spec_raw": lambda: spec,
        "spec_bucketed": lambda: padded(spec),
        "drafting_raw": lambda: drafting,
        "drafting_bucketed": lambda: padded(drafting),
    }
    with Model(ModelSpec(str(model_path), n_gpu_layers=-1 if gpu else 0)) as model, \
            Context(model, ContextSpec(n_ctx=4096, n_batch=128, n_ubatch=128,
                                       n_threads=threads)) as context:
        batch = Batch(128)
        finished = time_decodes(context, batch, WIDTHS, reps=reps)
        out: dict[str, object] = {
            "queued_ms": {r: queued(context, batch, r, reps) for r in WIDTHS},
            "finished_ms": {r: round(finished[r] * 1e3, 3) for r in WIDTHS},
        }
        print(f"{model_path.name}: single decodes timed", file=sys.stderr, flush=True)
        widths = {name: make() for name, make in patterns.items()}
        raw = {"spec_bucketed": spec, "drafting_bucketed": drafting}
        out["steady_ms_per_step"] = {name: steady(context, batch, w, raw.get(name))
                                     for name, w in widths.items()}
        out["same_shape_share"] = {name: same_shape_share(w) for name, w in widths.items()}
        out["rows_per_step"] = {name: round(sum(w) / len(w), 2) for name, w in widths.items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny",
                    help="tiny (the tiny dense and Gemma-layout models), gemma, or a GGUF path")
    ap.add_argument("--gpu", action="store_true", help="offload every layer (n_gpu_layers -1)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=4)
    args = ap.parse_args()
    configure_logging(level="warning")
    with tempfile.TemporaryDirectory(prefix="specfleet-timing-") as tmp:
        if args.model == "tiny":
            tiny = build_tiny_models(Path(tmp))
            models = {"tiny-dense": tiny.dense, "tiny-gemma3": tiny.swa}
        else:
            models = {args.model: gemma_q4_path() if args.model == "gemma" else Path(args.model)}
        results = {name: measure(path, args.gpu, args.reps, args.threads)
                   for name, path in models.items()}
    print(json.dumps({"gpu": args.gpu, "reps": args.reps, "models": results}, indent=1))


if __name__ == "__main__":
    main()
