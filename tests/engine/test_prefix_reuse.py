"""Prefix reuse never changes a token: output with the prefix cache on equals plain greedy
decoding of the same prompt on an engine without it, whatever the slot held before.

Random schedules (hypothesis) draw prompts from a few shared documents, so slots keep finding
prefixes of earlier requests: whole ones (a conversation's next turn), part of one (the same
instructions, another question), identical prompts. They cancel requests mid-prompt and
mid-generation, and speculate with rejections, on the tiny F32 models where batched and
single-row logits agree: a dense model (n-gram; the KV is trimmed to any prefix), the hybrid
with MTP at D < N (compact rollback; the recurrent state is restored from prefix checkpoints),
and a sliding-window model (its old window cells are overwritten, so deep cuts need
checkpoints too), with one slot and with three.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.protocol import FinishReason, SpecMethod
from worker.engine.engine import EngineConfig, SpeculativeEngine
from worker.engine.prefix_cache import CHECKPOINT_SPACING, MemoryKind, PrefixCache
from worker.engine.slot import Slot, SlotRequest, SlotUpdate
from worker.launch import EngineCapacity

from .schedule import Arrival, Run, run_schedule

N_CTX = 1024
VOCAB = 256
N_MAX = 4
DEPTH = 2  # D < N on the hybrid: compact rollback, checkpoint + replay
DOCS = [[random.Random(d).randrange(VOCAB) for _ in range(160)] for d in range(3)]


class Reference:
    """Plain greedy continuations on a one-slot engine without a prefix cache."""

    def __init__(self, model: Path, n_ctx: int = N_CTX) -> None:
        self.engine = SpeculativeEngine(EngineConfig(
            str(model), n_ctx=n_ctx, n_threads=1, prefix_cache=False,
            capacity=EngineCapacity(method=SpecMethod.NONE)))
        self._seen: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def __call__(self, prompt: list[int], n: int) -> list[int]:
        key = (tuple(prompt), n)
        if key not in self._seen:
            self._seen[key] = self.engine.generate(prompt, n).tokens
        return self._seen[key]


def cached_engine(model: Path, method: SpecMethod, slots: int, depth: int | None = None,
                  n_ctx: int = N_CTX, **config: object) -> SpeculativeEngine:
    return SpeculativeEngine(EngineConfig(
        str(model), n_ctx=n_ctx, n_threads=1, slots=slots, row_budget=False,
        per_sequence_kv=True,
        capacity=EngineCapacity(method=method, draft_max=N_MAX, rollback_depth=depth),
        **config))  # type: ignore[arg-type]


SUBJECTS = {
    "dense": ("dense_model", SpecMethod.NGRAM, None),
    "hybrid": ("hybrid_model", SpecMethod.MTP, DEPTH),
    "swa": ("swa_model", SpecMethod.NGRAM, None),
}


@pytest.fixture(scope="module", params=[(name, slots) for name in SUBJECTS for slots in (1, 3)],
                ids=lambda p: f"{p[0]}-{p[1]}slots")
def subject(request: pytest.FixtureRequest) -> Iterator[tuple[SpeculativeEngine, Reference]]:
    name, slots = request.param
    fixture, method, depth = SUBJECTS[name]
    model = request.getfixturevalue(fixture)
    reference = Reference(model)
    with cached_engine(model, method, slots, depth) as engine:
        yield engine, reference
    reference.engine.close()


def assert_exact(reference: Reference, arrivals: list[Arrival], run: Run) -> None:
    for i, (arrival, result) in enumerate(zip(arrivals, run.results, strict=True)):
        r = arrival.request
        expected = reference(list(r.prompt_tokens), r.max_tokens)
        if result.finish_reason is FinishReason.CANCELLED:
            assert result.tokens == expected[:len(result.tokens)], f"request {i} diverged"
        else:
            assert result.tokens == expected, f"request {i} diverged"


#: A prompt: a prefix of one document (length), then a few tokens of its own.
PROMPT = st.tuples(st.integers(0, len(DOCS) - 1), st.integers(1, 160),
                   st.lists(st.integers(0, VOCAB - 1), max_size=6))
ARRIVAL = st.tuples(st.integers(0, 30), PROMPT, st.integers(1, 40),
                    st.one_of(st.none(), st.integers(0, 60)))  # cancel at this step, or never


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(schedule=st.lists(ARRIVAL, min_size=1, max_size=6))
def test_random_schedules_with_shared_prefixes_equal_plain_greedy(
        subject: tuple[SpeculativeEngine, Reference],
        schedule: list[tuple[int, tuple[int, int, list[int]], int, int | None]]) -> None:
    engine, reference = subject
    arrivals = [Arrival(step, SlotRequest(DOCS[d][:k] + tail, n))
                for step, (d, k, tail), n, _ in schedule]
    cancel_at = {i: at for i, (*_, at) in enumerate(schedule) if at is not None}

    def cancel(step: int, updates: list[SlotUpdate], live: dict[int, Slot]) -> None:
        for i, slot in live.items():
            if cancel_at.get(i) == step:
                engine.cancel(slot)

    run = run_schedule(engine, arrivals, cancel)
    assert_exact(reference, arrivals, run)
    assert engine.free_slots == engine.config.slots


def test_a_conversation_reuses_every_earlier_turn(
        subject: tuple[SpeculativeEngine, Reference]) -> None:
    """Each turn's prompt is the previous prompt, its answer and a new message: all but the
    new message (and the answer's last token, never decoded) comes from the cache, and the
    answers are plain greedy's."""
    engine, reference = subject
    prompt = DOCS[0][:40]
    for turn in range(4):
        result = engine.generate(prompt, 24)
        assert result.tokens == reference(prompt, 24), f"turn {turn} diverged"
        if turn:
            assert result.telemetry.cached_tokens == len(prompt) - 9
            assert result.telemetry.prefix_hits == 1
        prompt = prompt + result.tokens + DOCS[1][turn * 8:turn * 8 + 8]


def test_an_identical_prompt_is_served_from_the_cache(
        subject: tuple[SpeculativeEngine, Reference]) -> None:
    """Repeating a prompt keeps all of it but the last token (it opens the first verify):
    trimmed from the live sequence, or restored from the checkpoint at the prompt's end."""
    engine, reference = subject
    prompt = DOCS[2][:100]
    first = engine.generate(prompt, 30)
    again = engine.generate(prompt, 30)
    assert first.tokens == again.tokens == reference(prompt, 30)
    assert again.telemetry.cached_tokens == len(prompt) - 1
    kind = engine.prefix.kind if isinstance(engine.prefix, PrefixCache) else None
    if kind is MemoryKind.RECURRENT:
        assert again.telemetry.prefix_restores == 1


def test_a_request_that_opts_out_neither_reuses_nor_leaves_anything(
        dense_model: Path) -> None:
    reference = Reference(dense_model)
    with cached_engine(dense_model, SpecMethod.NGRAM, slots=1) as engine:
        prompt = DOCS[0][:80]
        engine.generate(prompt, 10)
        out = engine.admit(SlotRequest(prompt + [1], 10, prefix_cache=False))
        while out.phase.value != "done":
            engine.step()
        assert out.counters.cached_tokens == 0
        after = engine.generate(prompt + [1], 10)
        assert after.telemetry.cached_tokens == 0, "an opted-out request left its tokens"
        assert after.tokens == reference(prompt + [1], 10)
    reference.engine.close()


def test_reuse_off_prefills_everything(dense_model: Path) -> None:
    with cached_engine(dense_model, SpecMethod.NGRAM, slots=1, prefix_cache=False) as engine:
        prompt = DOCS[1][:60]
        engine.generate(prompt, 5)
        t = engine.generate(prompt, 5).telemetry
    assert (t.cached_tokens, t.prefix_hits, t.prefix_misses) == (0, 0, 0)


def test_a_failed_step_leaves_nothing_to_reuse(dense_model: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that raised may have left any state behind: its slots' sequences are cleared,
    never offered to the next request."""
    reference = Reference(dense_model)
    with cached_engine(dense_model, SpecMethod.NGRAM, slots=1) as engine:
        prompt = DOCS[2][:90]
        engine.generate(prompt, 10)
        engine.admit(SlotRequest(prompt + [3, 4], 20))
        engine.step()
        with monkeypatch.context() as m:
            m.setattr(engine.verifier, "step", _raise)
            with pytest.raises(RuntimeError, match="injected"):
                engine.step()
        result = engine.generate(prompt + [3, 4], 20)
        assert result.telemetry.cached_tokens == 0
        assert result.tokens == reference(prompt + [3, 4], 20)
    reference.engine.close()


def _raise(*args: object, **kwargs: object) -> None:
    raise RuntimeError("injected step failure")


def test_reuse_survives_host_fallback_and_a_model_reload(hybrid_model: Path,
                                                         dense_model: Path) -> None:
    """Compact rollback falling back to host checkpoints (fault injection) beside prefix
    reuse, then another engine on another model: every answer stays plain greedy's."""
    reference = Reference(hybrid_model)
    prompt = DOCS[0][:70]
    with cached_engine(hybrid_model, SpecMethod.MTP, slots=2, depth=DEPTH,
                       fail_device_checkpoint=True) as engine:
        for turn in range(3):
            result = engine.generate(prompt, 30)
            assert result.tokens == reference(prompt, 30), f"turn {turn} diverged"
            prompt = prompt + result.tokens + [7]
        assert engine.telemetry().host_fallbacks >= 1
        assert engine.telemetry().cached_tokens > 0
    reference.engine.close()
    dense = Reference(dense_model)
    with cached_engine(dense_model, SpecMethod.NGRAM, slots=1) as engine:
        assert engine.generate(prompt, 20).tokens == dense(prompt, 20)
    dense.engine.close()


def test_a_long_prompt_is_checkpointed_every_spacing(hybrid_model: Path) -> None:
    """A recurrent model can keep part of an earlier prompt only through a checkpoint: a long
    prompt leaves one every CHECKPOINT_SPACING tokens, and a request sharing just its
    beginning restores the deepest one below the shared part."""
    n_ctx = 2 * CHECKPOINT_SPACING + 128
    reference = Reference(hybrid_model, n_ctx)
    doc = [random.Random(7).randrange(VOCAB) for _ in range(2 * CHECKPOINT_SPACING + 50)]
    with cached_engine(hybrid_model, SpecMethod.MTP, slots=1, depth=DEPTH,
                       n_ctx=n_ctx) as engine:
        first = engine.generate(doc, 8)
        assert first.telemetry.prefix_checkpoint_saves == 3  # 512, 1024, the prompt's end
        deeper = doc[:2 * CHECKPOINT_SPACING + 20] + [8, 8]
        third = engine.generate(deeper, 16)  # the deepest of 512 and 1024 below the cut
        question = doc[:CHECKPOINT_SPACING + 100] + [9, 9, 9]
        second = engine.generate(question, 16)
    assert third.tokens == reference(deeper, 16)
    assert third.telemetry.cached_tokens == 2 * CHECKPOINT_SPACING
    assert second.tokens == reference(question, 16)
    assert second.telemetry.cached_tokens == CHECKPOINT_SPACING
    assert second.telemetry.prefix_restores == 1
    reference.engine.close()


def test_a_resumed_mtp_draft_drafts_as_a_fresh_one(hybrid_model: Path) -> None:
    """Greedy verification hides a wrong draft state (it only costs acceptance), so the MTP
    draft context a reuse resumes (live at the end of a turn, with its pending catch-up fed,
    or cut back to a checkpoint) is checked by what it drafts: the same drafts, accepted the
    same, as an engine that prefilled the whole prompt. (The tiny head leans on the token more
    than on the hidden state handed over, so a wrong hidden row would not show here; a draft
    KV left unfed or uncut does.)"""
    prompt = DOCS[1][:120]
    with cached_engine(hybrid_model, SpecMethod.MTP, slots=1, depth=DEPTH) as cached, \
            cached_engine(hybrid_model, SpecMethod.MTP, slots=1, depth=DEPTH,
                          prefix_cache=False) as fresh:
        first = cached.generate(prompt, 30)
        turn = prompt + first.tokens + [11, 12]
        for again, how in [(prompt, "checkpoint"), (turn, "live")]:
            reused = cached.generate(again, 30).telemetry
            plain = fresh.generate(again, 30).telemetry
            assert reused.prefix_hits == 1
            assert reused.prefix_restores == (how == "checkpoint")
            assert (reused.drafted_per_position, reused.accepted_per_position) == (
                plain.drafted_per_position, plain.accepted_per_position), how


def test_a_cut_below_the_sliding_window_restores_a_checkpoint(swa_model: Path) -> None:
    """Once a sequence outgrows its SWA cache, the oldest window cells are overwritten:
    cutting it back far below its end would decode with a broken window (llama.cpp does not
    complain), so the cut comes from a prefix checkpoint, while a cut near the end is still
    live."""
    n_ctx = 2048
    reference = Reference(swa_model, n_ctx)
    doc = [random.Random(9).randrange(VOCAB) for _ in range(1600)]
    with cached_engine(swa_model, SpecMethod.NGRAM, slots=1, n_ctx=n_ctx) as engine:
        engine.generate(doc, 8)
        assert engine.target.pos_min(0) > CHECKPOINT_SPACING + 100, "the window never moved"
        deep = doc[:CHECKPOINT_SPACING + 100] + [4, 4]
        far = engine.generate(deep, 16)
        assert far.tokens == reference(deep, 16)
        assert (far.telemetry.cached_tokens, far.telemetry.prefix_restores) == (
            CHECKPOINT_SPACING, 1)
        near = deep + far.tokens[:10] + [5]
        close = engine.generate(near, 16)
        assert close.tokens == reference(near, 16)
        assert close.telemetry.prefix_restores == 0
        assert close.telemetry.cached_tokens == len(deep) + 10
    reference.engine.close()
