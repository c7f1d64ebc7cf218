"""Per-slot rollback: several slots rejecting deep in the same step, each restored from its own
checkpoint and replayed, and none disturbing another's state.

Every slot drafts with its own oracle (the plain-greedy continuation of its own prompt,
corrupted on schedule), so every accepted-prefix length occurs in every slot and the replays
each slot must make are known in advance. The engine's per-slot counters are checked against
those schedules, and the output of every slot against its plain-greedy reference.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from engine.schedule import Arrival, plain_greedy, run_schedule

from shared.protocol import CheckpointMode, SpecMethod, SpecSettings
from worker.engine.engine import EngineConfig, SpeculativeEngine
from worker.engine.rollback.compact import CompactRollback
from worker.engine.slot import Slot, SlotRequest, SlotUpdate
from worker.launch import EngineCapacity

from .oracle import OracleProposer

N_CTX = 512
TOKENS = 80


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(length)]


def compact_engine(model: Path, slots: int, draft_max: int, depth: int, mode: CheckpointMode,
                   method: SpecMethod = SpecMethod.NGRAM) -> SpeculativeEngine:
    capacity = EngineCapacity(method=method, draft_max=draft_max, rollback_depth=depth)
    # No row budget: every oracle draft is verified as scheduled, so its rejection depth holds.
    return SpeculativeEngine(EngineConfig(str(model), n_ctx=N_CTX, n_threads=1, slots=slots,
                                          capacity=capacity, checkpoint=mode, row_budget=False,
                                          per_sequence_kv=True))


class ReplaysPerStep:
    """How many slots replayed in each step, from the rollback's per-sequence counters."""

    def __init__(self, rollback: CompactRollback) -> None:
        self.rollback = rollback
        self.before = list(rollback.replay_events)
        self.counts: list[int] = []

    def __call__(self, step: int, updates: list[SlotUpdate], live: dict[int, Slot]) -> None:
        now = list(self.rollback.replay_events)
        self.counts.append(sum(a != b for a, b in zip(now, self.before, strict=True)))
        self.before = now


@pytest.mark.parametrize("mode", list(CheckpointMode), ids=lambda m: m.value)
@pytest.mark.parametrize(("draft_max", "depth"), [(3, 1), (5, 2), (7, 1), (7, 3)])
def test_deep_rejections_of_several_slots_in_one_step_are_exact(
        hybrid_model: Path, draft_max: int, depth: int, mode: CheckpointMode) -> None:
    prompts = [prompt(100 + i, 5 + 7 * i) for i in range(5)]
    with compact_engine(hybrid_model, 4, draft_max, depth, mode) as engine:
        rollback = engine.rollback
        assert isinstance(rollback, CompactRollback)
        oracles = [OracleProposer(plain_greedy(hybrid_model, tuple(p), TOKENS, N_CTX),
                                  engine.model.n_vocab, seed=i) for i, p in enumerate(prompts)]
        # Four start together; the fifth joins when the first slot frees up.
        arrivals = [Arrival(0 if i < 4 else 5, SlotRequest(p, TOKENS, proposer=o))
                    for i, (p, o) in enumerate(zip(prompts, oracles, strict=True))]
        replays = ReplaysPerStep(rollback)
        run = run_schedule(engine, arrivals, replays)

    assert max(replays.counts) >= 2, "deep rejections never hit two slots in the same step"
    for oracle, result in zip(oracles, run.results, strict=True):
        assert result.tokens == oracle.reference
        assert oracle.observed == [p.accept for p in oracle.plan], "the schedule did not hold"
        assert set(oracle.observed) == set(range(draft_max + 1))
        deep = [p for p in oracle.plan if p.rejected > depth]
        assert deep
        t = result.telemetry
        assert t.replay_events == len(deep)
        assert t.replay_tokens == sum(p.accept + 1 for p in deep)
        assert t.checkpoint_saves == sum(p.width > depth for p in oracle.plan)
        assert t.checkpoint_mode == mode.value
        assert t.host_fallbacks == 0


def test_a_failed_device_checkpoint_moves_only_its_slot_to_the_host(hybrid_model: Path) -> None:
    prompts = [prompt(200 + i, 9 + i) for i in range(3)]
    with compact_engine(hybrid_model, 3, 5, 1, CheckpointMode.DEVICE) as engine:
        rollback = engine.rollback
        assert isinstance(rollback, CompactRollback)
        rollback.stores[1].fail_device = True  # only slot 1's device saves fail, for real
        oracles = [OracleProposer(plain_greedy(hybrid_model, tuple(p), TOKENS, N_CTX),
                                  engine.model.n_vocab, seed=7 + i) for i, p in enumerate(prompts)]
        arrivals = [Arrival(0, SlotRequest(p, TOKENS, proposer=o))
                    for p, o in zip(prompts, oracles, strict=True)]
        run = run_schedule(engine, arrivals)
        modes = [store.mode for store in rollback.stores]

    assert modes == [CheckpointMode.DEVICE, CheckpointMode.HOST, CheckpointMode.DEVICE]
    for i, (oracle, result) in enumerate(zip(oracles, run.results, strict=True)):
        t = result.telemetry
        assert result.tokens == oracle.reference
        assert t.replay_events == sum(p.rejected > 1 for p in oracle.plan) > 0
        assert t.checkpoint_mode == ("host" if i == 1 else "device")
        assert t.host_fallbacks == (1 if i == 1 else 0)


def test_mtp_slots_with_compact_rollback_are_exact(hybrid_model: Path) -> None:
    """The real MTP head drafting for three slots at once (batched draft decodes), D < N."""
    prompts = [prompt(300 + i, 6 + 5 * i) for i in range(3)]
    widths = [5, 3, 5]
    with compact_engine(hybrid_model, 3, 5, 1, CheckpointMode.DEVICE, SpecMethod.MTP) as engine:
        arrivals = [Arrival(3 * i, SlotRequest(p, 150, SpecSettings(method=SpecMethod.MTP,
                                                                      draft_max=w,
                                                                      rollback_depth=1,
                                                                      adaptive=i == 1)))
                    for i, (p, w) in enumerate(zip(prompts, widths, strict=True))]
        run = run_schedule(engine, arrivals)
    for p, result in zip(prompts, run.results, strict=True):
        assert result.tokens == plain_greedy(hybrid_model, tuple(p), 150, N_CTX)
        assert 0 < result.telemetry.acceptance < 1
    assert sum(r.telemetry.replay_events for r in run.results) > 0


def test_reserve_pins_one_checkpoint_per_slot(hybrid_model: Path) -> None:
    with compact_engine(hybrid_model, 4, 5, 1, CheckpointMode.DEVICE) as engine:
        rollback = engine.rollback
        assert isinstance(rollback, CompactRollback)
        per_slot = rollback.reserve(engine.target).bytes_per_slot
        assert per_slot > 0
        assert all(store.reserved_bytes() == per_slot for store in rollback.stores)
        assert all(engine.target.pos_max(seq) < 0 for seq in range(4)), "probe tokens left"
