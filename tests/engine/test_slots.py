"""Several slots on one target context: every slot's output is its own request's plain greedy
output, token for token, whatever the other slots run beside it.

The slots differ in prompt, length, method (n-gram, MTP, none), draft width, adaptivity and
arrival time; some join while others are mid-generation, one is cancelled, one loads a prompt
longer than a prefill chunk while the others keep streaming. References come from a separate
one-slot engine decoding plain greedy (:func:`schedule.plain_greedy`). The tiny models are F32,
where batched and single-row logits agree, so identity is the bar.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.protocol import FinishReason, SpecMethod, SpecSettings
from worker.engine.config import PREFILL_CHUNK
from worker.engine.core.draft import Draft
from worker.engine.drafting.curve import CostCurve
from worker.engine.engine import EngineConfig, SpeculativeEngine
from worker.engine.proposers.head import DraftRequest
from worker.engine.slot import Slot, SlotRequest, SlotUpdate
from worker.launch import EngineCapacity

from .conftest import CHEAP_ROWS
from .schedule import Arrival, Run, plain_greedy, run_schedule

N_CTX = 512
N_MAX = 7
VOCAB = 256


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(length)]


def engine(model: Path, method: SpecMethod, slots: int, n_ctx: int = N_CTX,
           draft_max: int = N_MAX, row_budget: bool = False,
           row_costs: CostCurve | None = None) -> SpeculativeEngine:
    """The row budget trims drafts by timed row costs, which would make what each slot
    drafts depend on the machine's load; it is off except where a test says so. A KV
    stream per slot: the slots' logits must not depend on each other for token-exact
    comparison with one slot (EngineConfig.per_sequence_kv)."""
    capacity = EngineCapacity(method=method, draft_max=draft_max)
    return SpeculativeEngine(EngineConfig(str(model), n_ctx=n_ctx, n_threads=1, slots=slots,
                                          capacity=capacity, row_budget=row_budget,
                                          per_sequence_kv=True, row_costs=row_costs))


def req(p: list[int], n: int, method: SpecMethod = SpecMethod.NGRAM, width: int = N_MAX,
        **extra: object) -> SlotRequest:
    return SlotRequest(p, n, SpecSettings(method=method, draft_max=width, **extra))


def assert_exact(model: Path, arrivals: list[Arrival], run: Run, n_ctx: int = N_CTX) -> None:
    for i, (arrival, result) in enumerate(zip(arrivals, run.results, strict=True)):
        r = arrival.request
        expected = plain_greedy(model, tuple(r.prompt_tokens), r.max_tokens, n_ctx)
        if result.finish_reason is FinishReason.CANCELLED:
            assert result.tokens == expected[: len(result.tokens)], f"request {i} diverged"
        else:
            assert result.tokens == expected, f"request {i} diverged"
        assert result.telemetry.generated_tokens == len(result.tokens)
        assert run.streamed[i] == result.text
        assert result.telemetry.prompt_tokens == len(r.prompt_tokens)


def side_by_side(run: Run) -> int:
    """The most requests that verified in one step."""
    return max(len(v) for v in run.verified)


@pytest.fixture(scope="module", params=["dense", "hybrid"])
def ngram_engine(request: pytest.FixtureRequest, dense_model: Path,
                 hybrid_model: Path) -> Iterator[tuple[Path, SpeculativeEngine]]:
    """n-gram with 4 slots: KV trimming on the dense model, N snapshots on the hybrid."""
    model = dense_model if request.param == "dense" else hybrid_model
    with engine(model, SpecMethod.NGRAM, slots=4) as e:
        yield model, e


def test_ngram_slots_equal_plain_greedy(ngram_engine: tuple[Path, SpeculativeEngine]) -> None:
    model, e = ngram_engine
    arrivals = [
        Arrival(0, req(prompt(1, 8), 150, width=7)),
        Arrival(0, req(prompt(2, 30), 90, width=3, adaptive=True)),
        Arrival(0, req(prompt(3, 3), 120, width=1)),
        Arrival(0, req(prompt(4, 17), 60, SpecMethod.NONE)),
        Arrival(9, req(prompt(5, 40), 100, width=5)),       # joins mid-generation
        Arrival(25, req(prompt(6, 12), 80, width=7, adaptive=True)),
    ]
    run = run_schedule(e, arrivals)
    assert_exact(model, arrivals, run)
    assert side_by_side(run) == 4
    joined = next(s for s, v in enumerate(run.verified) if 4 in v)
    assert len(run.verified[joined]) > 1, "the late request never ran beside the others"
    spec_results = [r for a, r in zip(arrivals, run.results, strict=True)
                    if a.request.spec.method is SpecMethod.NGRAM]
    assert all(r.telemetry.acceptance > 0 for r in spec_results)
    assert sum(r.telemetry.accepted < r.telemetry.drafted for r in spec_results) >= 3, (
        "too few slots had rejected drafts: per-slot rollback went untested")


def test_mtp_slots_with_other_methods_equal_plain_greedy(hybrid_model: Path) -> None:
    """MTP slots draft together in batched draft decodes while n-gram and plain slots run in
    the same target batch."""
    arrivals = [
        Arrival(0, req(prompt(11, 8), 120, SpecMethod.MTP, width=2)),
        Arrival(0, req(prompt(12, 25), 150, SpecMethod.MTP, width=7, adaptive=True)),
        Arrival(0, req(prompt(13, 5), 100, SpecMethod.MTP, width=5, p_min=0.5)),
        Arrival(3, req(prompt(14, 14), 80, SpecMethod.NGRAM, width=4)),
        Arrival(12, req(prompt(15, 33), 90, SpecMethod.MTP, width=4)),
        Arrival(20, req(prompt(16, 9), 50, SpecMethod.NONE)),
    ]
    with engine(hybrid_model, SpecMethod.MTP, slots=4) as e:
        run = run_schedule(e, arrivals)
    assert_exact(hybrid_model, arrivals, run)
    assert side_by_side(run) == 4
    for a, r in zip(arrivals, run.results, strict=True):
        assert r.telemetry.spec_method == a.request.spec.method
        if a.request.spec.method is SpecMethod.MTP:
            assert 0 < r.telemetry.acceptance < 1


def test_mtp_suffix_slots_ask_the_head_together(hybrid_model: Path) -> None:
    """``mtp+suffix`` (what ``auto`` loads on a GGUF with a NextN head): the slots whose
    lookup leaves room ask the head in one batched draft per step, like ``mtp`` slots (each
    used to run the head in a decode of its own), and every output stays plain greedy."""
    arrivals = [Arrival(0, req(prompt(71 + i, 6 + 5 * i), 90, SpecMethod.MTP_SUFFIX, width=4))
                for i in range(3)]
    with engine(hybrid_model, SpecMethod.MTP_SUFFIX, slots=3, row_costs=CHEAP_ROWS) as e:
        asked: list[int] = []
        draft = e.head.draft

        def counted(requests: Sequence[DraftRequest]) -> list[Draft]:
            asked.append(len(requests))
            return draft(requests)

        e.head.draft = counted  # type: ignore[method-assign]
        run = run_schedule(e, arrivals)
    assert_exact(hybrid_model, arrivals, run)
    assert max(asked) == 3, asked
    assert all(r.telemetry.drafted > 0 for r in run.results)


def test_row_budget_trims_without_changing_any_slot(hybrid_model: Path) -> None:
    """With the row budget on, drafts are cut by timed costs (how far depends on the
    machine): whatever is cut, every slot's output stays its plain greedy output."""
    arrivals = [
        Arrival(0, req(prompt(51, 8), 100, SpecMethod.MTP, width=7)),
        Arrival(0, req(prompt(52, 20), 100, SpecMethod.NGRAM, width=7)),
        Arrival(4, req(prompt(53, 5), 100, SpecMethod.MTP, width=3)),
    ]
    with engine(hybrid_model, SpecMethod.MTP, slots=3, row_budget=True) as e:
        assert e.planner.steps is not None
        run = run_schedule(e, arrivals)
    assert_exact(hybrid_model, arrivals, run)


def test_cancel_stops_one_slot_and_leaves_the_others_exact(dense_model: Path) -> None:
    arrivals = [Arrival(0, req(prompt(s, 10), 120)) for s in (21, 22, 23)]
    cancelled_at: list[int] = []

    def cancel_second(step: int, updates: list[SlotUpdate], live: dict[int, Slot]) -> None:
        if step == 10 and 1 in live:
            e.cancel(live[1])
            cancelled_at.append(len(live[1].generated))

    with engine(dense_model, SpecMethod.NGRAM, slots=3) as e:
        run = run_schedule(e, arrivals, cancel_second)
        assert e.free_slots == 3
    assert run.results[1].finish_reason is FinishReason.CANCELLED
    assert len(run.results[1].tokens) == cancelled_at[0] > 0
    assert [run.results[i].finish_reason for i in (0, 2)] == [FinishReason.LENGTH] * 2
    assert_exact(dense_model, arrivals, run)


def test_limits_and_stop_strings_are_per_slot(dense_model: Path) -> None:
    n_ctx = 128
    long_prompt = prompt(31, 100)
    stop_prompt = prompt(32, 8)
    with engine(dense_model, SpecMethod.NGRAM, slots=3, n_ctx=n_ctx) as e:
        full = e.detokenize(plain_greedy(dense_model, tuple(stop_prompt), 120, n_ctx))
        stop = full[40:44]
        arrivals = [
            Arrival(0, req(long_prompt, 500)),                   # runs into the context end
            Arrival(0, SlotRequest(stop_prompt, 120, SpecSettings(method="ngram", draft_max=4),
                                   stop=[stop])),
            Arrival(0, req(prompt(33, 6), 1)),                   # one token only
        ]
        run = run_schedule(e, arrivals)
    context, stopped, one = run.results
    assert context.finish_reason is FinishReason.CONTEXT
    assert len(long_prompt) + len(context.tokens) == n_ctx + 1
    assert context.tokens == plain_greedy(dense_model, tuple(long_prompt), 500, n_ctx)[
        : len(context.tokens)]
    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.text == full[: full.find(stop)]
    assert one.finish_reason is FinishReason.LENGTH and len(one.tokens) == 1
    assert_exact(dense_model, arrivals[2:], Run(run.results[2:], run.streamed[2:]), n_ctx)


def test_long_prompt_is_prefilled_in_chunks_while_others_stream(hybrid_model: Path) -> None:
    n_ctx = 1536
    long_prompt = prompt(41, 1200)
    arrivals = [
        Arrival(0, req(prompt(42, 10), 200, SpecMethod.MTP, width=3)),
        Arrival(0, req(prompt(43, 20), 200, SpecMethod.NGRAM, width=5)),
        Arrival(6, req(long_prompt, 40, SpecMethod.MTP, width=4)),
    ]
    with engine(hybrid_model, SpecMethod.MTP, slots=3, n_ctx=n_ctx) as e:
        run = run_schedule(e, arrivals)
    assert_exact(hybrid_model, arrivals, run, n_ctx)
    loading = [s for s, waiting in enumerate(run.loading) if 2 in waiting]
    chunks = -(-(len(long_prompt) - 1) // PREFILL_CHUNK)
    assert len(loading) == chunks - 1, "the prompt was not loaded in bounded chunks"
    for s in [*loading, loading[-1] + 1]:
        assert {0, 1} <= run.verified[s], f"step {s}: a running slot stalled behind the prefill"


@pytest.fixture(scope="module")
def dense_three(dense_model: Path) -> Iterator[SpeculativeEngine]:
    with engine(dense_model, SpecMethod.NGRAM, slots=3) as e:
        yield e


ARRIVAL = st.tuples(st.integers(0, 40),                                 # arrival step
                    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=60),
                    st.integers(1, 80),                                 # max_tokens
                    st.integers(0, N_MAX))                              # width (0: plain)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedule=st.lists(ARRIVAL, min_size=1, max_size=6))
def test_random_schedules_equal_plain_greedy(dense_model: Path, dense_three: SpeculativeEngine,
                                             schedule: list[tuple[int, list[int], int, int]]
                                             ) -> None:
    arrivals = [Arrival(step, req(p, n, SpecMethod.NGRAM if w else SpecMethod.NONE, max(w, 1)))
                for step, p, n, w in schedule]
    run = run_schedule(dense_three, arrivals)
    assert_exact(dense_model, arrivals, run)
    assert dense_three.free_slots == 3
