"""The suffix drafter's own host time, replayed warm and cold (issue 47's CPU host ratio).

``bench/slots.py``'s host ms a token (a step's wall time less the target's decode) puts the
default drafter above plain's on a 2-core CPU (docs/benchmarks.md). This bench says how much of
it is the drafter's own (its Python and its native loops, ``_lookup.c``), measured apart from
everything else. Per K, one ``bench/slots.py``
round (Gemma 3 270M Q4_K_M, the default method, device verify on: no logits row is read) runs
once unrecorded for its host time, once with every suffix drafter's calls recorded (``start``,
``propose``, ``observe``) with what they read from outside (the clock their row costs learn
from, the target's margins, the draft bar), and a plain round of the same requests for its
host time, each on a fresh engine. The recorded calls are replayed on a copy of the drafters'
state as it was when the round began:

- **warm**: back to back, as on a GPU host (the decode runs on the device; the host's caches
  keep the drafter's data between steps);
- **cold**: with :data:`SWEEP_BYTES` swept between steps, as on a CPU host, where every decode
  streams the model's weights through the caches and the drafter's first touch of each object
  misses them.

Every replay's drafts must equal the recorded ones (a replay is the round's drafter, not an
approximation: a difference stops the bench), so the bench is also a deterministic check of a
drafter rewrite. Reported per K: the drafter's ms a committed token warm and cold (the best of
``--reps``), beside the round's host ms a token, default and plain.

    ./.venv/bin/python bench/drafter_host.py [--concurrency 1,8] [--tokens 96] [--reps 5]
        [--threads 2] [--markdown]

Progress goes to stderr, the JSON summary to stdout. Run it alone: the rounds are timed.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import slots  # noqa: E402

from shared.logs import configure_logging  # noqa: E402
from worker.engine.core.draft import Draft, VerifyOutcome  # noqa: E402
from worker.engine.drafting.bar import DraftBar  # noqa: E402
from worker.engine.engine import SpeculativeEngine  # noqa: E402
from worker.engine.proposers import suffix  # noqa: E402
from worker.engine.proposers.suffix import SuffixProposer, SuffixShared  # noqa: E402
from worker.testmodels.gemma import gemma_q4_path  # noqa: E402

#: What a cold replay sweeps between steps: twice this host's 32 MiB last-level cache.
SWEEP_BYTES = 64 * 1024 * 1024


@dataclass
class Recording:
    """One round's drafter calls, in order: ``(drafter, "start", prompt)``, ``(drafter,
    "propose", history length, width, p_min, bar level, drafted tokens)``, ``(drafter,
    "observe", VerifyOutcome)`` and ``(0, "step")`` where an engine step began; the clock's
    readings inside the drafter module and the margins the drafters read, in call order."""

    state: SuffixShared
    #: The tokens that end a generation (the model's, read before it is freed).
    ends: frozenset[int]
    events: list[tuple[Any, ...]] = field(default_factory=list)
    clock: list[float] = field(default_factory=list)
    margins: list[list[float]] = field(default_factory=list)


@contextmanager
def recording(engine: SpeculativeEngine) -> Iterator[Recording]:
    """Record what ``engine``'s suffix drafters do until the block ends."""
    shared = engine.suffix
    assert shared is not None, "the engine drafts by suffix lookup"
    rec = Recording(_copy(shared), frozenset(t for t in range(engine.model.n_vocab)
                                             if engine.model.is_eog(t)))
    start, propose, observe = SuffixProposer.start, SuffixProposer.propose, SuffixProposer.observe
    step, margins, clock = SpeculativeEngine._step, shared.margins, suffix.perf_counter

    def timed() -> float:
        rec.clock.append(clock())
        return rec.clock[-1]

    def read_margins(row0: int, tokens: Sequence[int]) -> list[float]:
        rec.margins.append(list(margins(row0, tokens)))
        return rec.margins[-1]

    def on_start(self: SuffixProposer, prompt: Sequence[int]) -> None:
        rec.events.append((id(self), "start", list(prompt)))
        start(self, prompt)

    def on_propose(self: SuffixProposer, history: Sequence[int], width: int,
                   p_min: float) -> Draft:
        draft = propose(self, history, width, p_min)
        rec.events.append((id(self), "propose", len(history), width, p_min,
                           shared.bar.level, list(draft.tokens)))
        return draft

    def on_observe(self: SuffixProposer, outcome: VerifyOutcome) -> None:
        rec.events.append((id(self), "observe", copy.copy(outcome)))
        observe(self, outcome)

    def on_step(self: SpeculativeEngine, during: Any) -> Any:
        rec.events.append((0, "step"))
        return step(self, during)

    patches: list[tuple[Any, str, Any]] = [
        (SuffixProposer, "start", on_start), (SuffixProposer, "propose", on_propose),
        (SuffixProposer, "observe", on_observe), (SpeculativeEngine, "_step", on_step),
        (suffix, "perf_counter", timed), (shared, "margins", read_margins)]
    saved = [(target, name, getattr(target, name)) for target, name, _ in patches]
    try:
        for target, name, value in patches:
            setattr(target, name, value)
        yield rec
    finally:
        for target, name, value in saved:
            setattr(target, name, value)


def _copy(shared: SuffixShared) -> SuffixShared:
    """What the drafters learn from traffic (row costs, output cache, calibration) copied;
    what they read from the engine kept as it is."""
    return replace(shared, costs=copy.deepcopy(shared.costs), cache=copy.deepcopy(shared.cache),
                   stats=copy.deepcopy(shared.stats))


def replay(rec: Recording, between_steps: Callable[[], None]) -> float:
    """Seconds the recorded drafter calls take again on a copy of the state they began from,
    ``between_steps`` run (untimed) where an engine step began. Raises where a draft differs
    from the recorded one."""
    clock, margins = iter(rec.clock), iter(rec.margins)
    bar = DraftBar(1)  # its level set to what each recorded proposal saw
    state = _copy(rec.state)
    shared = replace(state, margins=lambda row0, tokens: next(margins),
                     ends=rec.ends.__contains__, bar=bar)
    drafters: dict[int, SuffixProposer] = {}
    histories: dict[int, list[int]] = {}
    saved = suffix.perf_counter
    suffix.perf_counter = lambda: next(clock)
    total = 0.0
    try:
        for event in rec.events:
            who, kind = event[0], event[1]
            if kind == "step":
                between_steps()
                continue
            t0 = time.perf_counter()
            if kind == "start":
                histories[who] = list(event[2])
                drafters.setdefault(who, SuffixProposer(shared)).start(histories[who])
            elif kind == "propose":
                _, _, length, width, p_min, level, drafted = event
                bar.level = level
                history = histories[who]
                assert len(history) == length, "the replay lost the recorded histories"
                tokens = drafters[who].propose(history, width, p_min).tokens
                if tokens != drafted:
                    raise AssertionError(f"replayed draft {tokens} differs from the "
                                         f"recorded {drafted}")
            else:
                outcome: VerifyOutcome = event[2]
                drafters[who].observe(outcome)
                histories[who] += [*outcome.accepted, outcome.bonus]
            total += time.perf_counter() - t0
    finally:
        suffix.perf_counter = saved
    return total


def measure(args: argparse.Namespace, model: str, k: int) -> dict[str, float]:
    """One K: the recorded default round and a plain one (host ms a token each), and the
    recorded drafter calls replayed warm and cold."""
    slots.DEVICE_VERIFY[0] = True
    rounds: dict[str, dict[str, float]] = {}
    # Timed on an engine of its own (the recording's own calls cost a little), then the same
    # round on a fresh one, recorded.
    for name in ("default", "plain", "recorded"):
        engine = slots.open_engine(model, k, args.threads, gpu=False)
        try:
            warm_up = slots.round_requests(engine, k, 0, False)[:k]
            slots.together(engine, warm_up, 16, slots.METHODS["default"])
            requests = slots.round_requests(engine, k, 1, False)
            method = slots.METHODS["plain" if name == "plain" else "default"]
            if name == "recorded":
                with recording(engine) as rec:
                    rounds[name], _ = slots.together(engine, requests, args.tokens, method)
            else:
                rounds[name], _ = slots.together(engine, requests, args.tokens, method)
        finally:
            engine.close()
    default, plain = rounds["default"], rounds["plain"]
    sweep = np.ones(SWEEP_BYTES // 8)

    def sweep_caches() -> None:
        sweep.__iadd__(1.0)

    generated = rounds["recorded"]["generated"]
    warm = min(replay(rec, lambda: None) for _ in range(args.reps))
    cold = min(replay(rec, sweep_caches) for _ in range(args.reps))
    proposals = sum(1 for e in rec.events if e[1] == "propose")
    row = {"k": k, "generated": generated, "proposals": proposals,
           "steps": sum(1 for e in rec.events if e[1] == "step"),
           "default_host_ms_per_token": default["host_ms_per_token"],
           "plain_host_ms_per_token": plain["host_ms_per_token"],
           "drafter_warm_ms_per_token": 1000 * warm / generated,
           "drafter_cold_ms_per_token": 1000 * cold / generated}
    print(f"K={k}: host ms a token default {row['default_host_ms_per_token']:.3f}, plain "
          f"{row['plain_host_ms_per_token']:.3f}; the drafter alone {1000 * warm / generated:.3f}"
          f" warm, {1000 * cold / generated:.3f} cold ({proposals} proposals replayed, drafts "
          "equal)", file=sys.stderr, flush=True)
    return row


def markdown(rows: list[dict[str, float]]) -> str:
    lines = ["| K | host ms a token, plain | default | ratio | the drafter alone, cold | "
             "warm | default less the drafter (cold), vs plain |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        plain, default = r["plain_host_ms_per_token"], r["default_host_ms_per_token"]
        rest = default - r["drafter_cold_ms_per_token"]
        lines.append(f"| {r['k']} | {plain:.3f} | {default:.3f} | {default / plain:.2f} | "
                     f"{r['drafter_cold_ms_per_token']:.3f} | "
                     f"{r['drafter_warm_ms_per_token']:.3f} | {rest / plain:.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="1,8", help="slots (K), comma-separated")
    ap.add_argument("--tokens", type=int, default=96, help="tokens generated per request")
    ap.add_argument("--reps", type=int, default=5, help="replays of each kind (the best kept)")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    ap.add_argument("--markdown", action="store_true", help="also print a markdown table")
    args = ap.parse_args()
    configure_logging(level="warning")  # stdout carries only the summary
    model = str(gemma_q4_path())
    rows = [measure(args, model, int(k)) for k in args.concurrency.split(",")]
    print(json.dumps({"rows": rows}, indent=2))
    if args.markdown:
        print(markdown(rows))


if __name__ == "__main__":
    main()
