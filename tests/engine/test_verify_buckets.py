"""Replayable shapes (``EngineConfig.verify_buckets``, ``worker/engine/drafting/buckets.py``):
a step that verifies drafts is padded to one of a few row counts, so a GPU replays its decode
graph, and the planner prices a plan at the rows it pads to.

Forced on here on the CPU backend, where it is off by default (nothing replays there): greedy
output with pads equals plain greedy, one slot and several, on the dense model (pads trimmed)
and the hybrid (pads rolled back through the recurrent snapshots), with the n-gram, suffix and
MTP drafters; the pads never reach a slot (its sequence ends where its history does after
every step); every decode after the prompt has a bucket's row count; the policy's choices;
the planner's prices; the option carried from a worker's options into its engine, and refused
where it cannot be kept.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers import specfleet

from shared.protocol import SpecMethod, SpecSettings
from shared.settings import Settings
from worker.engine.drafting.buckets import NO_BUCKETS, ROW_BUCKETS, RowBuckets, bucket
from worker.engine.drafting.curve import CostCurve
from worker.engine.drafting.planner import DraftPlanner
from worker.engine.engine import EngineConfig, SpeculativeEngine
from worker.engine.slot import Phase, Slot, SlotRequest, SlotUpdate
from worker.fitter import FitError
from worker.launch import EngineCapacity, WorkerOptions
from worker.llm import Batch, Context
from worker.service.startup import load_engine

from .conftest import CHEAP_ROWS, TOKENS
from .schedule import Arrival, OnStep, plain_greedy, run_schedule
from .test_slots import N_CTX, assert_exact, prompt

N_MAX = 7


def _engine(model: Path, method: SpecMethod, slots: int = 1, buckets: bool | None = True,
            **config: Any) -> SpeculativeEngine:
    """Rows priced cheap so drafts are verified; several slots get a KV stream each unless
    ``config`` says (their logits then never depend on each other) and no row budget (what
    each drafts would follow the host's load)."""
    return SpeculativeEngine(EngineConfig(
        str(model), n_ctx=N_CTX, n_threads=1, slots=slots,
        capacity=EngineCapacity(method=method, draft_max=N_MAX), row_costs=CHEAP_ROWS,
        row_budget=False, verify_buckets=buckets, **{"per_sequence_kv": slots > 1, **config}))


class Widths:
    """The target as the verifier drives it, each decode's row count noted."""

    def __init__(self, context: Context) -> None:
        self._context = context
        self.rows: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    def decode(self, batch: Batch) -> None:
        self.rows.append(batch.n_tokens)
        self._context.decode(batch)


def _no_pad_stays(engine: SpeculativeEngine) -> OnStep:
    """A schedule's check after every step: each decoding slot's sequence ends at its last
    decoded token (the one before its ``last``), so no pad row stayed in it."""
    def check(step: int, updates: list[SlotUpdate], live: dict[int, Slot]) -> None:
        for slot in live.values():
            if slot.phase is Phase.DECODE:
                assert engine.target.pos_max(slot.seq) == len(slot.history) - 2, (
                    f"step {step}: sequence {slot.seq} holds positions past its history")
    return check


# -- the policy ---------------------------------------------------------------------------
def test_a_step_decodes_the_smallest_bucket_that_holds_it_within_its_cap() -> None:
    assert [bucket(r, 1024) for r in (0, 1, 2, 3, 5, 8, 9, 17, 33, 100)] == \
        [0, 1, 2, 4, 8, 8, 16, 24, 48, 128]
    assert bucket(5, 6) == 6  # the step's capacity is its last bucket
    assert bucket(40, 36) == 40  # never fewer rows than the step has
    assert bucket(2000, 4096) == 2000  # past the widest bucket: as it is
    assert list(ROW_BUCKETS) == sorted(ROW_BUCKETS)


def test_pads_fill_the_shortest_sequences_within_their_room() -> None:
    policy = RowBuckets(per_slot=8, n_ctx=100)
    assert policy.pads([3], [10], prefilling=False) == [1]
    assert policy.pads([5, 1, 1], [0, 0, 0], prefilling=False) == [0, 1, 0]
    assert policy.pads([8, 1, 1], [0, 0, 0], prefilling=False) == [0, 3, 3]
    # No draft in the step (a plain step repeats as it is), or a prompt chunk beside it.
    assert policy.pads([1, 1, 1], [0, 0, 0], prefilling=False) == [0, 0, 0]
    assert policy.pads([3], [10], prefilling=True) == [0]
    # A sequence holds at most per_slot rows, and stays within its context.
    assert RowBuckets(per_slot=4, n_ctx=100).pads([4, 2], [0, 0], prefilling=False) == [0, 2]
    assert RowBuckets(per_slot=8, n_ctx=20).pads([3], [16], prefilling=False) == [1]
    assert RowBuckets(per_slot=8, n_ctx=20).pads([3], [17], prefilling=False) == [0]
    assert NO_BUCKETS.pads([3, 5], [0, 0], prefilling=False) == [0, 0]


def test_the_planner_prices_a_plan_at_its_bucket() -> None:
    """Rows that cost their count: unbucketed, 12 rows cost 12 (their tile's end, timed
    widths around it) and every length pays alike; bucketed, 12 rows cost the 16 they
    decode, so the verify shape cuts an 11-token draft to 7 (8 rows, a bucket)."""
    curve = CostCurve({r: float(r) for r in (1, 2, 4, 8, 16, 32)}, steady={1: 0.5, 2: 1.0})
    plain = DraftPlanner(curve, 1, draft_max=15, replays=False, budget=False, shape=True)
    padded = DraftPlanner(curve, 1, draft_max=15, replays=False, budget=False, shape=True,
                          buckets=RowBuckets(16, 4096))
    assert plain.one_slot is not None and padded.one_slot is not None
    assert plain.one_slot.seconds[12] == 12.0
    assert padded.one_slot.seconds[9] == padded.one_slot.seconds[12] == 16.0
    assert padded.one_slot.seconds[3] == 4.0 and padded.one_slot.seconds[16] == 16.0
    assert plain.shape[11] == 11 and padded.shape[11] == 7
    # Plain steps (a row per busy slot) are never padded: their steady price stays.
    steps = DraftPlanner(curve, 2, draft_max=7, replays=True, budget=True, shape=False,
                         buckets=RowBuckets(8, 4096)).steps
    assert steps is not None
    assert steps.seconds[1:4] == [0.5, 1.0, 4.0]
    assert steps.seconds[5] == steps.seconds[8] == 8.0


# -- the engine ---------------------------------------------------------------------------
@pytest.mark.parametrize(("fixture", "method"), [
    ("dense_model", SpecMethod.NGRAM), ("dense_model", SpecMethod.SUFFIX),
    ("hybrid_model", SpecMethod.MTP), ("hybrid_model", SpecMethod.NGRAM)])
def test_one_slot_padded_to_buckets_equals_plain_greedy(
        request: pytest.FixtureRequest, fixture: str, method: SpecMethod) -> None:
    model: Path = request.getfixturevalue(fixture)
    p = prompt(0, 12)
    with _engine(model, method) as engine:
        assert engine.plan.verify_buckets
        widths = Widths(engine.verifier.target)
        engine.verifier.target = widths  # type: ignore[assignment]
        # Drafts of up to 5 of the engine's 7: a fully accepted one still carries pads.
        run = run_schedule(engine, [Arrival(0, SlotRequest(
            p, TOKENS, SpecSettings(method=method, draft_max=5)))], _no_pad_stays(engine))
    telemetry = run.results[0].telemetry
    assert telemetry.drafted > 0 and telemetry.padded_rows > 0  # it drafted, and padded
    # The prompt's decode aside, every decode had a bucket's rows (at most N + 1: one slot).
    assert set(widths.rows[1:]) <= {1, 2, 4, N_MAX + 1}, widths.rows
    assert run.results[0].tokens == plain_greedy(model, tuple(p), TOKENS, N_CTX)


@pytest.mark.parametrize("per_sequence_kv", [True, False])
def test_several_slots_padded_to_buckets_equal_plain_greedy(
        dense_model: Path, hybrid_model: Path, per_sequence_kv: bool) -> None:
    """Three slots arriving at different steps, their pads water-filled into the shortest
    sequences: every slot's output is its plain greedy one, on both models, with a KV stream
    per slot and with one cache for all (the F32 models' logits do not depend on what else
    the cache holds; the hybrid's batch is then split into ubatches of equal-length
    sequences, not in sequence order)."""
    for model in (dense_model, hybrid_model):
        arrivals = [Arrival(3 * i, SlotRequest(prompt(i, 10), 60 + 10 * i,
                                               SpecSettings(method=SpecMethod.NGRAM)))
                    for i in range(4)]
        with _engine(model, SpecMethod.NGRAM, slots=3,
                     per_sequence_kv=per_sequence_kv) as engine:
            run = run_schedule(engine, arrivals, _no_pad_stays(engine))
            telemetry = engine.telemetry()
        assert_exact(model, arrivals, run)
        assert telemetry.padded_rows > 0 and telemetry.drafted > 0


def test_pads_of_a_sequence_sampled_on_the_device_are_sampled_with_it(
        dense_model: Path) -> None:
    """With verify rows reduced on the device, a slot's pads are rows of its own sequence:
    sampled with it, so still no logits row reaches Python, and the output is exact. The
    request drafts 4 of the engine's 7: its 5-row verifies pad to 8."""
    p = prompt(4, 12)
    with _engine(dense_model, SpecMethod.NGRAM, device_verify=True) as engine:
        assert engine.plan.device_verify and engine.plan.verify_buckets
        result = engine.generate(p, TOKENS, SpecSettings(method=SpecMethod.NGRAM, draft_max=4))
        assert engine.target.rows_read == 0
    assert result.telemetry.padded_rows > 0
    assert result.tokens == plain_greedy(dense_model, tuple(p), TOKENS, N_CTX)


# -- the option ---------------------------------------------------------------------------
def test_auto_is_off_on_a_cpu_and_compact_rollback_is_refused(dense_model: Path,
                                                               hybrid_model: Path) -> None:
    with _engine(dense_model, SpecMethod.NGRAM, buckets=None) as auto:
        assert not auto.plan.verify_buckets
        assert auto.generate(prompt(1, 8), 20).telemetry.padded_rows == 0
    with pytest.raises(ValueError, match="verify_buckets"):
        SpeculativeEngine(EngineConfig(
            str(hybrid_model), n_ctx=N_CTX, n_threads=1, verify_buckets=True,
            capacity=EngineCapacity(method=SpecMethod.MTP, draft_max=4, rollback_depth=1)))
    with SpeculativeEngine(EngineConfig(  # auto: off there, not refused
            str(hybrid_model), n_ctx=N_CTX, n_threads=1, row_costs=CHEAP_ROWS,
            capacity=EngineCapacity(method=SpecMethod.MTP, draft_max=4,
                                    rollback_depth=1))) as compact:
        assert not compact.plan.verify_buckets


def test_the_worker_loads_what_it_was_asked_for(dense_model: Path, hybrid_model: Path,
                                                tmp_path: Path) -> None:
    """``--verify-buckets`` as the worker's startup carries it: through the fit into the
    engine's plan, on or off; with compact rollback the fit refuses it, naming it."""
    def options(model: Path, on: bool, **capacity: Any) -> WorkerOptions:
        return WorkerOptions(str(model), "m", n_ctx=256, budget_mib=256, fit_target_mib=0,
                             threads=1, verify_buckets=on,
                             capacity=EngineCapacity(method=SpecMethod.NGRAM, draft_max=4,
                                                     **capacity))
    settings = Settings(cost_cache_dir=str(tmp_path))
    for on in (True, False):
        loaded = load_engine(options(dense_model, on), 0, settings)
        try:
            assert loaded.engine.plan.verify_buckets is on
        finally:
            loaded.close()
    with pytest.raises((ValueError, FitError), match="verify_buckets"):
        load_engine(options(hybrid_model, True, rollback_depth=1), 0, settings)


def test_the_worker_refuses_a_bad_value_naming_the_option(dense_model: Path) -> None:
    proc = specfleet("worker", "--model", str(dense_model), "--verify-buckets", "maybe")
    assert proc.returncode != 0
    assert "--verify-buckets takes 'on', 'off' or 'auto', got 'maybe'" in proc.stderr
