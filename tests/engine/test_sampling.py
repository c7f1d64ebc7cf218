"""Speculative sampling keeps the target distribution, and a seed fixes the tokens.

The statistical tests compare speculative sampling with plain sampling on the soft-output
tiny hybrid (its head and trunk disagree often enough that drafts are rejected at every
depth, and compact rollback replays past ``D``): the first two tokens of many seeded
continuations are binned and a chi-square test of homogeneity is run between the two
samples (different seeds, so they are independent). Seeds are fixed, so each test is
deterministic; the sample sizes leave the correct code far below the bound and a broken
residual step far above it (``test_a_broken_residual_step_is_caught``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from helpers import PROMPT

from shared.protocol import SamplingParams, SpecMethod, SpecSettings
from worker.engine import sampling
from worker.engine.core.constraint import UNCONSTRAINED
from worker.engine.core.draft import Draft
from worker.engine.engine import EngineConfig, SpeculativeEngine
from worker.engine.logprobs import make_logprobs
from worker.engine.sampling import (
    Distribution,
    Stream,
    accept_or_resample,
    keyed_uniform,
    make_sampler,
    target_distribution,
)
from worker.engine.slot import SlotRequest
from worker.launch import EngineCapacity
from worker.testmodels import write_dense_llama, write_qwen35_hybrid
from worker.testmodels.recipe import Strengths

from .conftest import SOFT_LOGIT_SCALE

#: Continuations per sample: the chi-square statistic of two correct samples stays near its
#: degrees of freedom, a broken residual step lands in the thousands.
SAMPLES = 1500
#: Homogeneity is rejected below this p-value (seeds are fixed: the outcome is deterministic).
P_FLOOR = 1e-4
#: Bins with fewer pooled counts than this are merged into one "other" bin.
MIN_BIN = 10
#: Hot enough that the first tokens spread over a dozen bins and the head, trained without
#: the trunk's switch, disagrees with the target on the copy prompt (acceptance ~0.3).
HOT = SamplingParams(temperature=1.3)
#: Every stage of the distribution at once: penalties, temperature, top-k, top-p, min-p.
CUT = SamplingParams(temperature=1.3, top_k=50, top_p=0.95, min_p=0.01, presence_penalty=0.3,
                     repetition_penalty=1.1)


@pytest.fixture(scope="module")
def soft_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_qwen35_hybrid(tmp_path_factory.mktemp("soft-sampling") / "soft.gguf",
                                   strengths=Strengths(logit_scale=SOFT_LOGIT_SCALE)))


def _load(model: str, n: int, d: int) -> SpeculativeEngine:
    capacity = EngineCapacity(method=SpecMethod.MTP, draft_max=n, rollback_depth=d)
    return SpeculativeEngine(EngineConfig(model, n_ctx=512, n_threads=1, capacity=capacity))


@pytest.fixture(scope="module")
def soft_engine(soft_model: str) -> Iterator[SpeculativeEngine]:
    """The soft hybrid with an MTP head, loaded for N = 4, D = 2 (D < N)."""
    with _load(soft_model, 4, 2) as e:
        yield e


@pytest.fixture(scope="module")
def soft_engine_n2_d1(soft_model: str) -> Iterator[SpeculativeEngine]:
    """The same model loaded for N = 2, D = 1: D is fixed at load (a request cannot lower it,
    shared/capacity.py), so a shallower rollback needs its own engine."""
    with _load(soft_model, 2, 1) as e:
        yield e


@pytest.fixture(scope="module")
def copy_prompt(soft_engine: SpeculativeEngine) -> list[int]:
    """The prompt followed by its greedy continuation: text that repeats, so the n-gram
    lookup drafts from the first position on."""
    plain = SpecSettings(method=SpecMethod.NONE)
    return [*PROMPT, *soft_engine.generate(PROMPT, 40, plain).tokens]


#: Plain sampling's first tokens over the reference seeds, for given sampler settings.
PlainSample = Callable[[SamplingParams], Counter[tuple[int, ...]]]


@pytest.fixture(scope="module")
def plain_sample(soft_engine: SpeculativeEngine, copy_prompt: list[int]) -> PlainSample:
    """The reference every comparison is made against, drawn once per sampler settings: it is
    pure (one engine, one prompt, fixed seeds), so the tests that share a setting share it
    instead of each drawing the same ``SAMPLES`` continuations again."""
    drawn: dict[str, Counter[tuple[int, ...]]] = {}

    def sample(params: SamplingParams) -> Counter[tuple[int, ...]]:
        key = params.model_dump_json()
        if key not in drawn:
            drawn[key] = first_tokens(soft_engine, copy_prompt,
                                      SpecSettings(method=SpecMethod.NONE), params,
                                      range(SAMPLES))
        return drawn[key]
    return sample


def first_tokens(engine: SpeculativeEngine, prompt: list[int], spec: SpecSettings,
                 params: SamplingParams, seeds: range, k: int = 2) -> Counter[tuple[int, ...]]:
    out: Counter[tuple[int, ...]] = Counter()
    for seed in seeds:
        result = engine.generate(prompt, k + 2, spec,
                                 sampling=params.model_copy(update={"seed": seed}))
        out[tuple(result.tokens[:k])] += 1
    return out


def homogeneity(a: Counter[tuple[int, ...]], b: Counter[tuple[int, ...]]) -> tuple[float, int]:
    """Chi-square statistic of two equal-sized samples (small bins pooled) and its degrees
    of freedom."""
    pooled_a = pooled_b = 0
    stat, bins = 0.0, 0
    for key in set(a) | set(b):
        x, y = a[key], b[key]
        if x + y < MIN_BIN:
            pooled_a, pooled_b = pooled_a + x, pooled_b + y
            continue
        stat += (x - y) ** 2 / (x + y)
        bins += 1
    if pooled_a + pooled_b:
        stat += (pooled_a - pooled_b) ** 2 / (pooled_a + pooled_b)
        bins += 1
    return stat, bins - 1


def p_value(stat: float, df: int) -> float:
    """Upper tail of chi-square(df) (Wilson-Hilferty: ample for df >= 3 at these tails)."""
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def marginal(sample: Counter[tuple[int, ...]], i: int) -> Counter[tuple[int, ...]]:
    out: Counter[tuple[int, ...]] = Counter()
    for key, n in sample.items():
        out[key[i:i + 1]] += n
    return out


def compare(engine: SpeculativeEngine, prompt: list[int], spec: SpecSettings,
            params: SamplingParams, plain_sample: PlainSample,
            ) -> list[tuple[str, float, int, float]]:
    """Chi-square of plain vs speculative sampling for the first token, the second, and the
    pair: (what, statistic, degrees of freedom, p-value) each."""
    plain = plain_sample(params)
    spec_run = first_tokens(engine, prompt, spec, params, range(10**6, 10**6 + SAMPLES))
    tests = [("first token", marginal(plain, 0), marginal(spec_run, 0)),
             ("second token", marginal(plain, 1), marginal(spec_run, 1)),
             ("pair", plain, spec_run)]
    out = []
    for what, a, b in tests:
        stat, df = homogeneity(a, b)
        assert df >= 3, f"{what}: too few bins, the distribution is too peaked to test"
        out.append((what, stat, df, p_value(stat, df)))
    return out


def describe(results: list[tuple[str, float, int, float]]) -> str:
    return "; ".join(f"{w}: chi2 = {s:.1f} on {df} df, p = {p:.1e}" for w, s, df, p in results)


@pytest.mark.parametrize("engine, spec, params", [
    ("soft_engine", SpecSettings(method=SpecMethod.NGRAM, draft_max=4, rollback_depth=2), HOT),
    ("soft_engine", SpecSettings(method=SpecMethod.MTP, draft_max=4, rollback_depth=2), HOT),
    ("soft_engine_n2_d1", SpecSettings(method=SpecMethod.MTP, draft_max=2, rollback_depth=1),
     HOT),
    ("soft_engine", SpecSettings(method=SpecMethod.MTP, draft_max=4, rollback_depth=2), CUT),
], ids=["ngram-N4-D2", "mtp-N4-D2", "mtp-N2-D1", "mtp-N4-D2-cuts"])
def test_speculative_sampling_keeps_the_target_distribution(
        engine: str, copy_prompt: list[int], spec: SpecSettings, params: SamplingParams,
        plain_sample: PlainSample, request: pytest.FixtureRequest) -> None:
    """Plain sampling is the reference for every engine of the model: it draws from the
    target alone, so a seed gives the same plain tokens whatever the engine was loaded for."""
    loaded: SpeculativeEngine = request.getfixturevalue(engine)
    results = compare(loaded, copy_prompt, spec, params, plain_sample)
    assert min(p for *_, p in results) > P_FLOOR, f"not the target's: {describe(results)}"


@pytest.mark.parametrize("method", [SpecMethod.NGRAM, SpecMethod.MTP])
def test_a_broken_residual_step_is_caught(soft_engine: SpeculativeEngine,
                                          copy_prompt: list[int], method: SpecMethod,
                                          plain_sample: PlainSample,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The test above has the power to see a wrong rejection step: drawing a rejected
    position's token from ``p`` instead of the residual ``max(0, p - q)`` fails it."""
    monkeypatch.setattr(sampling.Distribution, "residual", lambda p, q: p)
    spec = SpecSettings(method=method, draft_max=4, rollback_depth=2)
    results = compare(soft_engine, copy_prompt, spec, HOT, plain_sample)
    assert min(p for *_, p in results) < P_FLOOR, f"missed the broken step: {describe(results)}"


def test_acceptance_integrates_to_the_target_for_any_draft_distribution() -> None:
    """Exact, not sampled: over a fine grid of the uniform, rejection sampling of a draft
    drawn from ``q`` outputs ``p``; and a point-mass draft's outcome is plain sampling's."""
    rng = np.random.default_rng(7)
    grid = (np.arange(1000) + 0.5) / 1000
    for _ in range(6):
        ids = np.sort(rng.choice(50, size=12, replace=False))
        p = Distribution(ids, rng.dirichlet(np.full(12, 0.5)))
        q_ids = np.sort(rng.choice(50, size=10, replace=False))
        q = Distribution(q_ids, rng.dirichlet(np.full(10, 0.5)))
        out: Counter[int] = Counter()
        for x, qx in zip(q_ids.tolist(), q.weights / q.total, strict=True):
            for u in grid:
                out[accept_or_resample(p, q, x, float(u))[1]] += qx / len(grid)
        for token, prob in zip(ids.tolist(), p.weights / p.total, strict=True):
            assert out[token] == pytest.approx(prob, abs=1e-2)
        for x in ids.tolist():
            point = Distribution.point(x)
            assert all(accept_or_resample(p, point, x, float(u))[1] == p.pick(float(u))
                       for u in grid[::7])


def test_the_distribution_applies_every_stage_in_order() -> None:
    logits = np.array([4.0, 3.0, 2.0, 1.0, 0.0, -1.0], dtype=np.float32)
    params = SamplingParams(temperature=0.5, top_k=4, top_p=0.95, min_p=0.05,
                            presence_penalty=1.0, repetition_penalty=2.0)
    # token 0 was in the prompt (repetition: 4 -> 2); token 1 was generated (3/2 - 1 = 0.5)
    dist = target_distribution(logits, params, history=[0, 1], n_prompt=1)
    z = np.array([2.0, 0.5, 2.0, 1.0, 0.0, -1.0]) / 0.5
    w = np.exp(z - z.max())
    keep = [0, 2, 3, 1]  # top-4 by penalised logit
    w_keep = w[keep] / w[keep].sum()
    order = np.argsort(-w_keep, kind="stable")
    nucleus = [keep[i] for i in order[: int(np.searchsorted(np.cumsum(w_keep[order]), 0.95)) + 1]]
    top = max(w[i] for i in nucleus)
    expected = sorted(i for i in nucleus if w[i] >= 0.05 * top)
    assert dist.ids.tolist() == expected
    assert dist.weights / dist.total == pytest.approx(w[expected] / w[expected].sum())


def test_keyed_uniforms_depend_on_seed_position_and_stream_only() -> None:
    draws = [keyed_uniform(s, pos, st) for s in range(20) for pos in range(50)
             for st in Stream]
    assert len(set(draws)) == len(draws)
    assert all(0.0 <= u < 1.0 for u in draws)
    assert abs(np.mean(draws) - 0.5) < 0.02
    assert keyed_uniform(3, 9, Stream.TARGET) == keyed_uniform(3, 9, Stream.TARGET)


def test_lookup_speculation_samples_the_very_tokens_of_plain_sampling(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """A point-mass draft is accepted exactly when the target's own keyed draw is that
    token, so n-gram speculation with a seed reproduces plain sampling with it, token for
    token, at any width (F32: batched and single-row logits agree)."""
    path = write_dense_llama(tmp_path_factory.mktemp("soft-dense") / "soft-dense.gguf",
                             strengths=Strengths(logit_scale=SOFT_LOGIT_SCALE))
    capacity = EngineCapacity(method=SpecMethod.NGRAM, draft_max=6)
    with SpeculativeEngine(EngineConfig(str(path), n_ctx=512, n_threads=1,
                                        capacity=capacity)) as e:
        drafted = 0
        for seed in range(12):
            params = SamplingParams(temperature=0.9, top_p=0.95, seed=seed)
            plain = e.generate(PROMPT, 60, SpecSettings(method=SpecMethod.NONE),
                               sampling=params).tokens
            for width in (1, 3, 6):
                run = e.generate(PROMPT, 60, SpecSettings(method=SpecMethod.NGRAM,
                                                          draft_max=width), sampling=params)
                assert run.tokens == plain, f"seed {seed}, width {width}"
                drafted += run.telemetry.drafted - run.telemetry.accepted
        assert drafted > 0, "no draft was ever rejected: the test exercised nothing"


def test_same_seed_same_tokens_across_engines_and_beside_other_slots(
        soft_engine: SpeculativeEngine, copy_prompt: list[int]) -> None:
    """MTP drafts are sampled from the head; with the same seed a second engine (another
    worker) and a busy engine whose other slots sample too give the same tokens. (This is
    also what caught the head chaining on other slots' hidden rows: llama.cpp's masked NextN
    rows are wrong for all but the first sequence of a draft decode with catch-up entries.)"""
    spec = SpecSettings(method=SpecMethod.MTP, draft_max=4, rollback_depth=2)
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    alone = soft_engine.generate(copy_prompt, 50, spec, sampling=params)
    assert alone.seed == 1234 and alone.telemetry.accepted < alone.telemetry.drafted
    assert soft_engine.generate(copy_prompt, 50, spec, sampling=params).tokens == alone.tokens

    model = str(soft_engine.config.model_path)
    config = EngineConfig(model, n_ctx=512, n_threads=1, slots=3, row_budget=True,
                          capacity=soft_engine.config.capacity, per_sequence_kv=True)
    with SpeculativeEngine(config) as busy:
        others = [busy.admit(SlotRequest(PROMPT, 70, spec, SamplingParams(temperature=1.3,
                                                                         seed=s)))
                  for s in (5, 6)]
        mine = busy.admit(SlotRequest(copy_prompt, 50, spec, params))
        results = {}
        while len(results) < 3:
            for update in busy.step():
                if update.result is not None:
                    results[update.slot.seq] = update.result
        assert results[mine.seq].tokens == alone.tokens
        assert all(results[o.seq].tokens for o in others)


def test_logprobs_are_the_raw_distribution_of_each_committed_token(
        soft_engine: SpeculativeEngine, copy_prompt: list[int]) -> None:
    spec = SpecSettings(method=SpecMethod.MTP, draft_max=4, rollback_depth=2)
    sampled = soft_engine.generate(copy_prompt, 12, spec, logprobs=3,
                                   sampling=SamplingParams(temperature=1.0, seed=5))
    plain = soft_engine.generate(copy_prompt, 12, SpecSettings(method=SpecMethod.NONE),
                                 logprobs=3, sampling=SamplingParams(temperature=1.0, seed=5))
    assert [lp.token for lp in sampled.logprobs] == sampled.tokens
    for lp in sampled.logprobs:
        assert len(lp.top_logprobs) == 3
        assert [t.logprob for t in lp.top_logprobs] == sorted(
            (t.logprob for t in lp.top_logprobs), reverse=True)
        assert lp.logprob <= lp.top_logprobs[0].logprob + 1e-9
        assert sum(math.exp(t.logprob) for t in lp.top_logprobs) <= 1 + 1e-6
    # the first token's row is the prompt's in both runs: the same numbers (to float noise:
    # one is a row of a wider verify batch)
    first, ref = sampled.logprobs[0].top_logprobs, plain.logprobs[0].top_logprobs
    assert [t.token for t in first] == [t.token for t in ref]
    assert [t.logprob for t in first] == pytest.approx([t.logprob for t in ref], abs=1e-5)


class _CountingRows:
    """A verify's logits block that records which rows the sampler reads."""

    def __init__(self, rows: np.ndarray) -> None:
        self.rows = rows
        self.read: list[int] = []

    def __getitem__(self, i: int) -> np.ndarray:
        self.read.append(i)
        return self.rows[i]


class _Rows:
    """A target stand-in whose last verify produced ``rows`` (argmax per row: ``best``)."""

    def __init__(self, best: list[int], n_vocab: int = 32) -> None:
        rows = np.zeros((len(best), n_vocab), dtype=np.float32)
        rows[np.arange(len(best)), best] = 1.0
        self.block = _CountingRows(rows)

    def logits_rows(self, row0: int, n: int) -> _CountingRows:
        assert row0 == 0 and n == len(self.block.rows)
        return self.block


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(logit_bias={3: 0.5}),
                                    SamplingParams(repetition_penalty=1.3)])
def test_greedy_verify_reads_no_row_after_the_first_rejection(params: SamplingParams) -> None:
    """A row is a whole vocabulary to reduce: the rows after the first disagreement decide
    nothing, and the greedy verify does not read them, penalised or not."""
    sampler = make_sampler(params, n_prompt=2)
    draft = Draft([5, 6, 7, 8])
    rejected = _Rows([5, 9, 7, 8, 4])  # row 1 prefers 9 over the drafted 6
    assert sampler.verify(rejected, 0, 1, [1, 2], draft, UNCONSTRAINED) == (1, 9)  # type: ignore[arg-type]
    assert rejected.block.read == [0, 1]
    accepted = _Rows([5, 6, 7, 8, 4])  # every draft kept, row 4 gives the bonus
    assert sampler.verify(accepted, 0, 1, [1, 2], draft, UNCONSTRAINED) == (4, 4)  # type: ignore[arg-type]
    assert accepted.block.read == [0, 1, 2, 3, 4]


class _OneRow:
    """A target stand-in whose last decode left one row of logits."""

    def __init__(self, row: np.ndarray) -> None:
        self.row = row

    def logits_rows(self, row0: int, n: int) -> np.ndarray:
        return self.row[None, :]


@pytest.mark.parametrize("ties", [[10, 20, 30, 40], [999, 998, 0, 5], [3, 50, 7]])
def test_alternatives_tied_at_the_last_place_go_to_the_lower_ids(ties: list[int]) -> None:
    """Which of several exactly tied ids fill the last places of ``top_logprobs`` must not
    depend on the rest of the row (a stream and a whole reply listed different ones)."""
    row = np.zeros(1000, dtype=np.float32)
    row[ties] = 1.0
    row[600] = 2.0
    model = type("Vocab", (), {"token_bytes": staticmethod(lambda t: b"x")})()
    reporter = make_logprobs(model, 3)  # type: ignore[arg-type]
    [reported] = reporter.report(_OneRow(row), 0, [600])  # type: ignore[arg-type]
    assert [t.token for t in reported.top_logprobs] == [600, *sorted(ties)[:2]]
