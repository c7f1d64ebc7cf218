"""Verify on the device: a greedy unconstrained verify row comes back as its two best tokens
(llama.cpp's backend sampling, ``Context.sample_on_device``), never as a logits row in Python.

Run here on the CPU backend, where it is off by default (slower there) and forced on
(``EngineConfig.device_verify``): greedy output of every drafter equals plain greedy, one
slot and several, with no logits row read; slots that need the row (sampled, logprobs, a
grammar) read theirs beside device slots and are what they are on a host-only engine; a
sequence that serves both kinds in turn stays exact.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers import close_floats

from shared.constraint import Constraint
from shared.protocol import FinishReason, SamplingParams, SpecMethod, SpecSettings
from worker.engine.engine import EngineConfig, GenerationResult, SpeculativeEngine
from worker.engine.slot import SlotRequest
from worker.launch import EngineCapacity

from .conftest import CHEAP_ROWS, TOKENS
from .schedule import plain_greedy
from .test_slots import N_CTX, prompt


def _engine(model: Path, method: SpecMethod, slots: int = 1, device: bool = True,
            **config: Any) -> SpeculativeEngine:
    """Rows priced cheap so drafts are verified; ``config``: more of the engine's."""
    return SpeculativeEngine(EngineConfig(
        str(model), n_ctx=N_CTX, n_threads=1, slots=slots,
        capacity=EngineCapacity(method=method, draft_max=7), row_costs=CHEAP_ROWS,
        row_budget=False, device_verify=device, **config))


def _run(engine: SpeculativeEngine, requests: list[SlotRequest]) -> list[GenerationResult]:
    """Every request admitted at once, stepped to the end; results in request order."""
    slots = [engine.admit(r) for r in requests]
    results: dict[int, GenerationResult] = {}
    while engine.active:
        for update in engine.step():
            if update.result is not None:
                results[slots.index(update.slot)] = update.result
    return [results[i] for i in range(len(requests))]


@pytest.mark.parametrize(("fixture", "method"), [
    ("dense_model", SpecMethod.SUFFIX), ("dense_model", SpecMethod.NGRAM),
    ("hybrid_model", SpecMethod.MTP), ("hybrid_model", SpecMethod.MTP_SUFFIX)])
def test_one_slot_on_the_device_equals_plain_greedy_and_reads_no_row(
        request: pytest.FixtureRequest, fixture: str, method: SpecMethod) -> None:
    model: Path = request.getfixturevalue(fixture)
    p = prompt(0, 12)
    with _engine(model, method) as engine:
        assert engine.plan.device_verify
        result = engine.generate(p, TOKENS)
        assert engine.target.rows_read == 0
    assert result.telemetry.drafted > 0  # it really speculated
    assert result.tokens == plain_greedy(model, tuple(p), TOKENS, N_CTX)


@pytest.mark.parametrize("method", [SpecMethod.SUFFIX, SpecMethod.NGRAM])
def test_several_slots_on_the_device_equal_the_host_path(dense_model: Path,
                                                         method: SpecMethod) -> None:
    """Three slots in one KV cache: each slot's tokens are those of the same engine reading
    its rows on the host (the same schedule, the same logits), and no row was read."""
    requests = [SlotRequest(prompt(seed, 12), TOKENS) for seed in range(3)]
    with _engine(dense_model, method, slots=3) as device:
        assert device.plan.device_verify
        on_device = _run(device, requests)
        assert device.target.rows_read == 0
    with _engine(dense_model, method, slots=3, device=False) as host:
        on_host = _run(host, requests)
        assert host.target.rows_read > 0
    assert [r.tokens for r in on_device] == [r.tokens for r in on_host]
    assert sum(r.telemetry.drafted for r in on_device) > 0


@pytest.mark.parametrize(("fixture", "method", "config"), [
    ("hybrid_model", SpecMethod.MTP, {}), ("hybrid_model", SpecMethod.SUFFIX, {}),
    ("dense_model", SpecMethod.NGRAM, {"per_sequence_kv": True})],
    ids=["hybrid-mtp", "hybrid-suffix", "stream-per-slot"])
def test_slots_split_into_ubatches_verify_on_the_device_too(
        request: pytest.FixtureRequest, fixture: str, method: SpecMethod,
        config: dict[str, bool]) -> None:
    """Several slots whose decodes llama.cpp splits into ubatches (a recurrent model, a KV
    stream per slot) verify on the device, each slot's output plain greedy's, no row read.
    They were kept on the host while rows came back with another row's ids, which was put
    down to a reused graph; it was ggml's allocator handing a row's result another's memory
    (``test_device_sampling.py``, sequences going idle): undone, the hybrid's suffix slots
    part from plain here, and 13 of 15 random traffic runs of the hybrid on the device
    (``test_traffic.py``) did."""
    model: Path = request.getfixturevalue(fixture)
    requests = [SlotRequest(prompt(seed, 12), TOKENS) for seed in range(3)]
    with _engine(model, method, slots=3, **config) as engine:
        assert engine.plan.device_verify
        results = _run(engine, requests)
        assert engine.target.rows_read == 0
    assert [r.tokens for r in results] == [
        plain_greedy(model, tuple(r.prompt_tokens), TOKENS, N_CTX) for r in requests]
    assert sum(r.telemetry.drafted for r in results) > 0


def test_requests_that_need_their_rows_read_them_beside_device_slots(
        dense_model: Path) -> None:
    """A sampled request, one with logprobs and a constrained one share steps with a greedy
    one: each is what it is on an engine without device verify (the sampled one seed for
    seed), the greedy one stays exact, and only their rows were read."""
    p = prompt(7, 12)
    spec = SpecSettings(method=SpecMethod.NGRAM, draft_max=7)
    grammar = Constraint(kind="regex", grammar="[0-9a-f]{1,40}")
    requests = [SlotRequest(p, 40, spec, sampling=SamplingParams(temperature=0.8, seed=5)),
                SlotRequest(p, 40, spec, logprobs=2),
                SlotRequest(p, 40, spec, constraint=grammar),
                SlotRequest(p, 40, spec)]
    with _engine(dense_model, SpecMethod.NGRAM, slots=4) as device:
        mixed = _run(device, requests)
        assert device.target.rows_read > 0
    with _engine(dense_model, SpecMethod.NGRAM, slots=4, device=False) as host:
        alone = _run(host, requests)
    for got, want in zip(mixed, alone, strict=True):
        assert got.tokens == want.tokens
        assert [_sorted(lp.model_dump()) for lp in got.logprobs] == close_floats(
            [lp.model_dump() for lp in want.logprobs])
    assert mixed[3].tokens == plain_greedy(dense_model, tuple(p), 40, N_CTX)


def _sorted(logprob: dict[str, object]) -> dict[str, object]:
    """A token's logprob with its alternatives by token (``close_floats``' order)."""
    alternatives = logprob["top_logprobs"]
    assert isinstance(alternatives, list)
    return {**logprob, "top_logprobs": sorted(alternatives, key=lambda t: t["token"])}


def test_a_sequence_switches_between_device_and_host_verify(dense_model: Path) -> None:
    """One slot serves a greedy request (its chain on), a sampled one (off), a greedy one
    again (a fresh chain): each is exact."""
    p = prompt(3, 10)
    with _engine(dense_model, SpecMethod.NGRAM) as engine:
        first = engine.generate(p, 30)
        sampled = engine.generate(p, 30, sampling=SamplingParams(temperature=1.0, seed=9))
        rows = engine.target.rows_read
        again = engine.generate(p, 30)
        assert engine.target.rows_read == rows
    with _engine(dense_model, SpecMethod.NGRAM, device=False) as host:
        expected = host.generate(p, 30, sampling=SamplingParams(temperature=1.0, seed=9))
    reference = plain_greedy(dense_model, tuple(p), 30, N_CTX)
    assert first.tokens == again.tokens == reference
    assert sampled.tokens == expected.tokens
    assert first.finish_reason is FinishReason.LENGTH
