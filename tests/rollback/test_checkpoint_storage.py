"""Checkpoint storage: device first, a failed device save moves to the host for good.

The fault-injection switch makes llama.cpp's real device save fail (it is handed no room for
the state), so these tests run the same failure path a broken device checkpoint takes.
"""

from __future__ import annotations

from pathlib import Path

from helpers import PROMPT
from structlog.testing import capture_logs

from shared.protocol import CheckpointMode
from worker.engine.engine import SpeculativeEngine
from worker.engine.rollback.compact import CompactRollback
from worker.fitter.buffers import MIB, parse_buffers
from worker.llm import capture_llama_log

from .conftest import MATRIX_TOKENS, engine_for
from .oracle import OracleProposer

DRAFT_MAX, DEPTH = 5, 1
#: Generated tokens after which the drill breaks device saves.
BREAK_AFTER = 30


def compact(engine: SpeculativeEngine) -> CompactRollback:
    """The engine's rollback, which these depth-below-width settings make compact."""
    assert isinstance(engine.rollback, CompactRollback)
    return engine.rollback


def fallbacks(logs: list[dict[str, object]]) -> list[dict[str, object]]:
    return [entry for entry in logs if entry["event"] == "checkpoint.fallback"]


def test_device_save_failure_mid_generation_moves_to_host_for_good(
        hybrid_model: Path, hybrid_reference: list[int]) -> None:
    expected = hybrid_reference[:MATRIX_TOKENS]
    with engine_for(hybrid_model, DRAFT_MAX, DEPTH, CheckpointMode.DEVICE) as engine:
        rollback = compact(engine)
        store = rollback.stores[0]
        at_break: dict[str, object] = {}
        produced: list[int] = []

        def break_device(tokens: list[int], text: str) -> None:
            produced.extend(tokens)
            if len(produced) >= BREAK_AFTER and not at_break:
                at_break.update(mode=store.mode, saves=store.saves,
                                replays=rollback.replay_events[0])
                store.fail_device = True

        oracle = OracleProposer(expected, engine.model.n_vocab, seed=7)
        with capture_logs() as logs:
            first = engine.generate(PROMPT, MATRIX_TOKENS, proposer=oracle, on_tokens=break_device)
            first_plan = list(oracle.plan)
            store.fail_device = False  # the device "recovers": storage must stay on the host
            second = engine.generate(PROMPT, MATRIX_TOKENS, proposer=oracle)

    assert at_break["mode"] is CheckpointMode.DEVICE and at_break["saves"] > 0
    assert first.telemetry.replay_events > at_break["replays"], "no host restore after the break"
    for result, plan in ((first, first_plan), (second, oracle.plan)):
        assert result.tokens == expected
        assert result.telemetry.checkpoint_mode == "host"
        assert result.telemetry.checkpoint_saves == sum(p.width > DEPTH for p in plan)
        assert result.telemetry.replay_events == sum(p.rejected > DEPTH for p in plan) > 0
    assert first.telemetry.host_fallbacks == 1
    assert second.telemetry.host_fallbacks == 0
    [event] = fallbacks(logs)
    assert event["phase"] == "save"
    assert "fault injection" in str(event["reason"])


def test_reserve_allocates_the_device_checkpoint_before_any_request(
        hybrid_model: Path, hybrid_reference: list[int]) -> None:
    expected = hybrid_reference[:MATRIX_TOKENS]
    with engine_for(hybrid_model, DRAFT_MAX, DEPTH, CheckpointMode.DEVICE) as engine:
        rollback = compact(engine)
        with capture_llama_log() as at_start:
            reserved = rollback.reserve(engine.target).bytes_per_slot
        oracle = OracleProposer(expected, engine.model.n_vocab, seed=3)
        with capture_llama_log() as serving:
            result = engine.generate(PROMPT, MATRIX_TOKENS, proposer=oracle)

    allocated = parse_buffers(at_start).total("checkpoint")
    assert reserved > 0
    assert abs(allocated - reserved) <= 0.0005 * MIB  # the log prints 0.001 MiB
    assert parse_buffers(serving).total("checkpoint") == 0, "runtime allocated again"
    assert result.tokens == expected
    assert result.telemetry.checkpoint_mode == "device"
    assert result.telemetry.checkpoint_saves > 0 and result.telemetry.replay_events > 0


def test_fault_injection_at_start_reserves_host_storage(
        hybrid_model: Path, hybrid_reference: list[int]) -> None:
    expected = hybrid_reference[:MATRIX_TOKENS]
    with engine_for(hybrid_model, DRAFT_MAX, DEPTH, CheckpointMode.DEVICE,
                    fail_device=True) as engine:
        rollback = compact(engine)
        oracle = OracleProposer(expected, engine.model.n_vocab, seed=5)
        with capture_logs() as logs:
            reserved = rollback.reserve(engine.target).bytes_per_slot
            result = engine.generate(PROMPT, MATRIX_TOKENS, proposer=oracle)

    assert reserved > 0
    assert rollback.stores[0].mode is CheckpointMode.HOST
    [event] = fallbacks(logs)
    assert event["phase"] == "reserve"
    assert result.tokens == expected
    assert result.telemetry.checkpoint_mode == "host"
    assert result.telemetry.host_fallbacks == 0
    assert result.telemetry.replay_events == sum(p.rejected > DEPTH for p in oracle.plan) > 0
