"""The engine plan: every load-time decision from the config and the model's facts, once.

The plan is a pure function of values, so most cases need no model; the last test checks that
an engine really builds what its plan says, on the real tiny models.
"""

from __future__ import annotations

import pytest

from shared.protocol import MAX_DRAFT, CheckpointMode, SpecMethod, SpecSettings, Telemetry
from worker.engine.config import draft_spec, target_spec
from worker.engine.engine import EngineConfig, SpeculativeEngine
from worker.engine.plan import ModelFacts, RollbackKind, plan_engine
from worker.engine.proposers.mtp import MtpDrafter, MtpUnavailableError
from worker.engine.rollback import RollbackStats
from worker.launch import EngineCapacity
from worker.testmodels import TinyModels

DENSE = ModelFacts("dense.gguf", recurrent=False, mtp_head=False)
HYBRID = ModelFacts("hybrid.gguf", recurrent=True, mtp_head=True)
TRUNK = ModelFacts("trunk.gguf", recurrent=True, mtp_head=False)


def config(method: SpecMethod, draft_max: int = 6, depth: int | None = None,
           slots: int = 1) -> EngineConfig:
    capacity = EngineCapacity(method=method, draft_max=draft_max, rollback_depth=depth)
    return EngineConfig("m.gguf", slots=slots, capacity=capacity, checkpoint=CheckpointMode.HOST)


@pytest.mark.parametrize(("fields", "reason"), [
    ({"draft_max": 0}, f"1 <= draft_max <= {MAX_DRAFT}"),
    ({"draft_max": MAX_DRAFT + 1}, f"1 <= draft_max <= {MAX_DRAFT}"),
    ({"draft_max": 3, "rollback_depth": 4}, "1 <= rollback_depth <= draft_max \\(3\\)"),
    ({"rollback_depth": 0}, "1 <= rollback_depth"),
])
def test_a_capacity_out_of_range_is_refused(fields: dict[str, int], reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        EngineCapacity(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("defaults", [
    SpecSettings(method=SpecMethod.NGRAM), SpecSettings(draft_max=4),
    SpecSettings(rollback_depth=2),
], ids=["method", "draft_max", "rollback_depth"])
def test_request_defaults_leave_the_capacity_to_the_capacity(defaults: SpecSettings) -> None:
    """What a request without settings runs with has one source for method, N and D: the
    capacity (admit fills them in); defaults that set them would be a second one."""
    with pytest.raises(ValueError, match="are its capacity"):
        EngineConfig("m.gguf", request_defaults=defaults)


def test_request_defaults_must_fit_the_width() -> None:
    """Checked against the width the plan settles on, given or defaulted."""
    with pytest.raises(ValueError, match="draft_min \\(3\\) must not exceed draft_max \\(2\\)"):
        plan_engine(EngineConfig("m.gguf", capacity=EngineCapacity(draft_max=2),
                                 request_defaults=SpecSettings(draft_min=3)), DENSE)
    with pytest.raises(ValueError, match="draft_min \\(9\\) must not exceed draft_max \\(8\\)"):
        plan_engine(EngineConfig("m.gguf", capacity=EngineCapacity(SpecMethod.NGRAM),
                                 request_defaults=SpecSettings(draft_min=9)), DENSE)
    with pytest.raises(ValueError, match="1 <= rollback_depth <= draft_max \\(8\\)"):
        plan_engine(EngineConfig("m.gguf", capacity=EngineCapacity(SpecMethod.MTP,
                                                                   rollback_depth=9)), HYBRID)


@pytest.mark.parametrize(("method", "facts", "slots", "width"), [
    (SpecMethod.AUTO, DENSE, 1, 127), (SpecMethod.SUFFIX, TRUNK, 1, 63),
    (SpecMethod.SUFFIX, DENSE, 2, 32), (SpecMethod.AUTO, TRUNK, 2, 32),
    (SpecMethod.AUTO, DENSE, 4, 17), (SpecMethod.SUFFIX, DENSE, 8, 8),
    (SpecMethod.AUTO, HYBRID, 1, 8), (SpecMethod.NGRAM, DENSE, 1, 8),
    (SpecMethod.MTP, HYBRID, 1, 8),
])
def test_an_unset_width_is_the_resolved_methods(method: SpecMethod, facts: ModelFacts,
                                                slots: int, width: int) -> None:
    """Suffix drafting gets a wide ceiling (it verifies only what pays): on one slot 127, a
    128-row verify of whole tiles, or 63 where the rollback keeps a state a draft position
    (a recurrent model); shared by slots, at most 32 and shrunk so a step of every slot stays
    within the rows eight default-width slots verify; the drafters that fill any width keep
    the protocol's 8 (auto on a model with a head is mtp+suffix)."""
    plan = plan_engine(EngineConfig("m.gguf", slots=slots, capacity=EngineCapacity(method)),
                       facts)
    assert plan.draft_max == width
    assert plan.capacity().draft_max == width
    assert slots == 1 or slots * (width + 1) <= 8 * 9


def test_auto_resolves_to_what_the_model_can_do() -> None:
    assert plan_engine(config(SpecMethod.AUTO), HYBRID).method is SpecMethod.MTP_SUFFIX
    assert plan_engine(config(SpecMethod.AUTO), TRUNK).method is SpecMethod.SUFFIX
    with pytest.raises(MtpUnavailableError, match="trunk.gguf has no MTP"):
        plan_engine(config(SpecMethod.MTP_SUFFIX), TRUNK)


def test_no_drafting_means_no_draft_width_and_no_snapshots() -> None:
    plan = plan_engine(config(SpecMethod.NONE, draft_max=6, depth=2), HYBRID)
    assert (plan.draft_max, plan.n_rs_seq, plan.rollback) == (0, 0, RollbackKind.SNAPSHOTS)
    assert not plan.checkpoints and not plan.mtp


@pytest.mark.parametrize(("facts", "depth", "kind", "n_rs_seq", "checkpoint"), [
    (DENSE, None, RollbackKind.KV_TRIM, 0, None),
    (DENSE, 2, RollbackKind.KV_TRIM, 0, None),
    (HYBRID, None, RollbackKind.SNAPSHOTS, 6, None),
    (HYBRID, 6, RollbackKind.SNAPSHOTS, 6, None),
    (HYBRID, 2, RollbackKind.COMPACT, 2, CheckpointMode.HOST),
])
def test_rollback_follows_the_model_and_the_depth(
        facts: ModelFacts, depth: int | None, kind: RollbackKind, n_rs_seq: int,
        checkpoint: CheckpointMode | None) -> None:
    plan = plan_engine(config(SpecMethod.NGRAM, draft_max=6, depth=depth, slots=3), facts)
    assert (plan.rollback, plan.n_rs_seq, plan.checkpoint, plan.slots) == (
        kind, n_rs_seq, checkpoint, 3)
    capacity = plan.capacity()
    assert capacity.rollback_depth == (None if facts is DENSE else n_rs_seq)
    assert (capacity.method, capacity.draft_max) == (SpecMethod.NGRAM, 6)


def test_rollback_stats_add_counts_and_keep_the_latest_state() -> None:
    before = RollbackStats(replay_events=2, replay_tokens=9, checkpoint_saves=5,
                           checkpoint_mode=CheckpointMode.DEVICE, rollback_depth=2)
    after = RollbackStats(replay_events=3, replay_tokens=12, checkpoint_saves=9,
                          host_fallbacks=1, checkpoint_mode=CheckpointMode.HOST,
                          host_fallback_reason="short_write", rollback_depth=2)
    share = after - before
    assert (share.replay_events, share.replay_tokens, share.checkpoint_saves,
            share.host_fallbacks) == (1, 3, 4, 1)
    assert share.checkpoint_mode is CheckpointMode.HOST
    assert share + share == RollbackStats(2, 6, 8, 2, CheckpointMode.HOST, "short_write",
                                          None, 2)


def test_telemetry_enums_keep_their_wire_strings() -> None:
    t = Telemetry(spec_method="mtp+suffix", checkpoint_mode="host")
    assert t.spec_method is SpecMethod.MTP_SUFFIX and t.checkpoint_mode is CheckpointMode.HOST
    wire = t.model_dump(mode="json")
    assert (wire["spec_method"], wire["checkpoint_mode"]) == ("mtp+suffix", "host")
    assert Telemetry.model_validate_json(t.model_dump_json()) == t


@pytest.mark.parametrize(("which", "capacity"), [
    ("dense", EngineCapacity(method=SpecMethod.NGRAM, draft_max=4)),
    ("hybrid", EngineCapacity(method=SpecMethod.AUTO, draft_max=5, rollback_depth=2)),
])
def test_the_engine_is_built_from_its_plan(tiny_models: TinyModels, which: str,
                                           capacity: EngineCapacity) -> None:
    cfg = EngineConfig(str(getattr(tiny_models, which)), n_ctx=256, n_threads=1,
                       capacity=capacity)
    with SpeculativeEngine(cfg) as engine:
        plan = engine.plan
        assert plan == plan_engine(cfg, ModelFacts.of(engine.model))
        assert (engine.method, engine.draft_max) == (plan.method, plan.draft_max)
        assert engine.target.n_rs_seq == plan.n_rs_seq
        assert isinstance(engine.head, MtpDrafter) == plan.mtp
        assert type(engine.rollback).__name__ == {
            RollbackKind.KV_TRIM: "KvTrimRollback", RollbackKind.SNAPSHOTS: "SnapshotRollback",
            RollbackKind.COMPACT: "CompactRollback"}[plan.rollback]
    engine.close()  # closing twice is harmless


def test_slots_share_one_kv_cache_unless_asked_per_sequence() -> None:
    """A step's uneven rows must reach llama.cpp as one ubatch: its default stream per
    sequence splits them (docs/engine.md, "Several slots"). A stream per sequence stays
    available for token-exact comparisons, deterministic mode always has one, and so do
    several slots of a recurrent model that roll back through snapshots."""
    base = config(SpecMethod.MTP, slots=4)
    assert target_spec(base, 0, 6).to_params().kv_unified
    assert draft_spec(base, 6).to_params().kv_unified
    per_sequence = EngineConfig("m.gguf", slots=4, capacity=base.capacity,
                                per_sequence_kv=True)
    assert not target_spec(per_sequence, 0, 6).to_params().kv_unified
    deterministic = EngineConfig("m.gguf", slots=4, capacity=base.capacity, deterministic=True)
    assert not target_spec(deterministic, 0, 6).to_params().kv_unified
    # Several slots rolling a recurrent state back through snapshots: a stream each
    # (tests/rollback/test_slots.py, uneven rows); one slot keeps the one cache.
    assert not target_spec(base, 6, 6).to_params().kv_unified
    one = EngineConfig("m.gguf", slots=1, capacity=base.capacity)
    assert target_spec(one, 6, 6).to_params().kv_unified
