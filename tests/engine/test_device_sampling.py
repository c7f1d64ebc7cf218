"""Sampling on the device: a request that samples from the temperature alone draws each verify
row's token on the device with the keyed uniform of its position (``Context.sample_on_device``
with ``KeyedDraws``), and no logits row reaches Python.

Run on the CPU backend with device verify forced on (``EngineConfig.device_verify``), on the
soft-output F32 tiny dense model: lookup speculation (n-gram, suffix) gives plain sampling's
very tokens seed for seed, one slot and several; plain sampling on the device gives the host's
tokens seed for seed (its 256 ids leave float32 rounding no boundary to tip), and every row
keeps its own draw (or top two, a greedy sequence's beside it) whatever the decode before and
whichever sequences sit idle; speculation on the device keeps the target distribution (a
chi-square that catches a verify accepting every draft); the top-k, top-p and min-p cuts are
drawn there too, seed for seed the host's; no logits row is read; and requests the device
cannot draw for (penalties, bias, logprobs, a grammar, the MTP head's sampled drafts, a device
without the draw's ops) still read their rows on the host.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from helpers import PROMPT

from shared.constraint import Constraint
from shared.protocol import SamplingParams, SpecMethod, SpecSettings
from worker.engine import sampling
from worker.engine.core.constraint import SlotConstraint
from worker.engine.core.draft import Draft
from worker.engine.engine import EngineConfig, SpeculativeEngine
from worker.engine.penalties import Penalties
from worker.engine.sampling import (
    DeviceRandomSampler,
    GreedySampler,
    KeyedDraws,
    RandomSampler,
    penalised_logits,
    target_distribution,
    verifies_on_device,
)
from worker.engine.slot import SlotRequest
from worker.launch import EngineCapacity
from worker.llm import Batch, Context, ContextSpec, Model, ModelSpec, device_sampling
from worker.llm.device_sampling import Greedy
from worker.testmodels import write_dense_llama
from worker.testmodels.recipe import Strengths

from .conftest import CHEAP_ROWS, SOFT_LOGIT_SCALE
from .test_device_verify import _run
from .test_sampling import (
    HOT,
    P_FLOOR,
    SAMPLES,
    compare,
    describe,
    first_tokens,
    homogeneity,
    marginal,
    p_value,
)
from .test_slots import N_CTX, prompt

PLAIN = SpecSettings(method=SpecMethod.NONE)
NGRAM = SpecSettings(method=SpecMethod.NGRAM, draft_max=6)
SUFFIX = SpecSettings(method=SpecMethod.SUFFIX, draft_max=6)
#: Temperature alone: what the device draws for.
WARM = SamplingParams(temperature=0.7)
SEEDS = range(16)
TOKENS = 60


def _engine(model: Path, slots: int = 1, device: bool = True,
            method: SpecMethod = SpecMethod.SUFFIX) -> SpeculativeEngine:
    """Loaded for the suffix drafter (it serves n-gram and plain requests too), one KV cache
    for every slot (device sampling needs it with several), rows priced cheap so drafts are
    verified."""
    return SpeculativeEngine(EngineConfig(
        str(model), n_ctx=N_CTX, n_threads=1, slots=slots,
        capacity=EngineCapacity(method=method, draft_max=7), row_costs=CHEAP_ROWS,
        row_budget=False, device_verify=device))


def _seeded(seed: int, params: SamplingParams = WARM) -> SamplingParams:
    return params.model_copy(update={"seed": seed})


@pytest.fixture(scope="module")
def soft_dense(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dense_llama(tmp_path_factory.mktemp("device-sampling") / "soft-dense.gguf",
                             strengths=Strengths(logit_scale=SOFT_LOGIT_SCALE))


@pytest.fixture(scope="module")
def device(soft_dense: Path) -> Iterator[SpeculativeEngine]:
    with _engine(soft_dense) as engine:
        assert engine.plan.device_verify
        yield engine


@pytest.fixture(scope="module")
def host(soft_dense: Path) -> Iterator[SpeculativeEngine]:
    with _engine(soft_dense, device=False) as engine:
        yield engine


@pytest.fixture(scope="module")
def copy_prompt(host: SpeculativeEngine) -> list[int]:
    """The prompt and its greedy continuation: text that repeats, so the lookup drafters
    draft from the first position on."""
    return [*PROMPT, *host.generate(PROMPT, 40, PLAIN).tokens]


@pytest.fixture(scope="module")
def plain_on_device(device: SpeculativeEngine, copy_prompt: list[int]) -> list[list[int]]:
    """Plain sampling on the device, one continuation per seed of :data:`SEEDS`."""
    return [device.generate(copy_prompt, TOKENS, PLAIN, sampling=_seeded(s)).tokens
            for s in SEEDS]


@pytest.mark.parametrize("spec", [NGRAM, SUFFIX], ids=["ngram", "suffix"])
def test_lookup_speculation_on_the_device_samples_plain_samplings_tokens(
        soft_dense: Path, copy_prompt: list[int], spec: SpecSettings,
        plain_on_device: list[list[int]]) -> None:
    """A point-mass draft is kept exactly when it is the row's own keyed draw, so every seed
    gives plain sampling's tokens, drafts rejected and accepted alike; and no logits row was
    read, the suffix drafter's margins included. (An engine of its own: what the suffix
    drafter learnt from other requests decides how far it drafts.)"""
    accepted = rejected = 0
    with _engine(soft_dense) as engine:
        for seed, plain in zip(SEEDS, plain_on_device, strict=True):
            run = engine.generate(copy_prompt, TOKENS, spec, sampling=_seeded(seed))
            assert run.tokens == plain, f"seed {seed}"
            accepted += run.telemetry.accepted
            rejected += run.telemetry.drafted - run.telemetry.accepted
        assert engine.target.rows_read == 0
    assert accepted > 0 and rejected > 0, "the drafts were never both kept and turned down"


@pytest.mark.parametrize("spec", [NGRAM, SUFFIX], ids=["ngram", "suffix"])
def test_several_slots_on_the_device_sample_plain_samplings_tokens(
        soft_dense: Path, copy_prompt: list[int], spec: SpecSettings) -> None:
    """Three sampled slots share every decode, three requests at a time: each request's
    tokens are those of the same requests sampled plainly three at a time, and no row was
    read. (Against plain sampling in three slots, not one: in one KV cache a row's logits
    move in their last bits with what the other slots hold, and seed 5 of these draws its
    18th token within 6e-6 of a boundary of the cumulative distribution, on the host too.)"""
    def three_at_a_time(engine: SpeculativeEngine, how: SpecSettings) -> list[list[int]]:
        requests = [SlotRequest(copy_prompt, TOKENS, how, _seeded(s)) for s in SEEDS[:9]]
        return [r.tokens for i in range(0, len(requests), 3)
                for r in _run(engine, requests[i:i + 3])]
    with _engine(soft_dense, slots=3) as engine:
        assert engine.plan.device_verify
        plain = three_at_a_time(engine, PLAIN)
        assert three_at_a_time(engine, spec) == plain
        assert engine.telemetry().accepted > 0
        assert engine.target.rows_read == 0


def test_plain_sampling_on_the_device_draws_the_hosts_tokens(
        host: SpeculativeEngine, copy_prompt: list[int],
        plain_on_device: list[list[int]]) -> None:
    """Seed for seed, plain sampling on the device (float32 softmax and cumulative sum on the
    device) gives the host's tokens (float64 cumulative sum): a uniform would have to land
    within ~1e-6 of a boundary of the cumulative distribution to tell them apart, which none
    of these draws does (docs/sampling.md, "Sampling on the device")."""
    rows = host.target.rows_read
    on_host = [host.generate(copy_prompt, TOKENS, PLAIN, sampling=_seeded(s)).tokens
               for s in SEEDS]
    assert host.target.rows_read - rows >= len(SEEDS) * TOKENS  # the host read every row
    assert plain_on_device == on_host
    assert len({tuple(t) for t in on_host}) == len(SEEDS)  # the seeds really sample


#: Layers the idle-layout test offloads (``SPECFLEET_TEST_GPU_LAYERS``: bench/gpu_check.py's
#: ``device-rows`` runs it with -1 on a GPU, where device verify is on by default).
GPU_LAYERS = int(os.environ.get("SPECFLEET_TEST_GPU_LAYERS", "0"))
#: Rows per sequence, decode after decode: rows move between sequences, and sequences go idle
#: and come back, so the graphs' sampler nodes move while their count stays (a dummy row built
#: for an idle sequence sits where a verifying sequence's rows sit in the next graph).
LAYOUTS = [(6, 1, 1), (1, 6, 1), (1, 1, 6), (2, 3, 2), (3, 2, 2),
           *[(2, 0, 1), (0, 2, 1), (1, 1, 0), (0, 1, 1), (3, 0, 1), (0, 3, 1), (1, 0, 3),
             (2, 2, 0), (0, 2, 2)] * 2]


#: What a sequence of the idle-layout test draws with, by kind: the temperature alone, or with
#: the top-k, top-p and min-p cuts, or with a bias and penalties (greedy too: "top2+").
DRAWN = {"keyed": WARM, "cut": SamplingParams(temperature=1.1, top_k=4, min_p=0.01),
         "nucleus": SamplingParams(temperature=1.3, top_p=0.8),
         "penalised": SamplingParams(temperature=1.0, repetition_penalty=1.3,
                                     frequency_penalty=0.4, logit_bias={9: 2.0}),
         "top2+": SamplingParams(repetition_penalty=1.6, presence_penalty=0.5)}


@pytest.mark.parametrize("kinds", [("top2", "top2", "top2"), ("top2", "keyed", "top2"),
                                   ("keyed", "keyed", "keyed"), ("cut", "top2", "keyed"),
                                   ("nucleus", "cut", "top2"), ("penalised", "top2+", "keyed")],
                         ids=["greedy", "mixed", "sampled", "cuts", "nucleus", "penalised"])
def test_every_row_is_its_own_while_sequences_go_idle(soft_dense: Path,
                                                     kinds: tuple[str, ...]) -> None:
    """Three sequences reduced on the device (their two best tokens, or a keyed draw, with or
    without cuts, of their raw or adjusted logits), rows
    spread over them differently at every decode and some idle, against a context that reads
    the same rows: every row's top two lead with the host's argmax, every draw is the host's
    draw from its logits and uniform. ggml's allocator reuses the last graph's memory plan,
    node by node, for a graph of as many nodes: a temperature input shared by one sequence's
    rows was overwritten once its rows moved to another sequence; and llama.cpp builds an
    idle sequence's sampler on a dummy row, whose result its own top_k left unflagged: rows
    took another sequence's ids, 13 decodes of 18 here, until every row's result was an
    output. The adjusted rows' chains grow (their histories do) while the others' stay."""
    spec = ContextSpec(n_ctx=3 * N_CTX, n_batch=32, n_ubatch=32, n_seq_max=3,
                       n_outputs_max=24, n_outputs_max_per_seq=8, n_threads=1)
    drawn = {seq: DRAWN[kind] for seq, kind in enumerate(kinds) if kind in DRAWN}
    seen: dict[int, list[int]] = {seq: [] for seq in range(len(kinds))}
    penalties = {seq: Penalties(params, seen[seq], 0)
                 for seq, params in drawn.items() if params.adjusted}
    hows: dict[int, bool | Greedy | KeyedDraws] = {
        seq: Greedy(penalties[seq]) if params.greedy else KeyedDraws(
            seq, params.temperature, params.top_k, params.min_p, params.top_p,
            penalties.get(seq)) for seq, params in drawn.items()}
    with Model(ModelSpec(str(soft_dense), n_gpu_layers=GPU_LAYERS)) as model, \
            Context(model, spec) as device, Context(model, spec) as host, Batch(32) as batch:
        for seq in range(len(kinds)):
            how = hows.get(seq, True)
            assert device.sample_on_device(seq, how) is how
        for step, layout in enumerate(LAYOUTS):
            batch.clear()
            rows, added = [], {}
            for seq, n in enumerate(layout):
                if n:
                    added[seq] = [(11 * step + 5 * seq + i) % 256 for i in range(n)]
                    row0 = batch.add(added[seq], len(seen[seq]), True, seq=seq)
                    rows += [(row0 + i, seq, len(seen[seq]) + i + 1) for i in range(n)]
            device.decode(batch)
            host.decode(batch)
            for row, seq, at in rows:
                logits = host.logits(row)
                before = [*seen[seq], *added[seq]][:at]
                how = hows.get(seq, True)
                if isinstance(how, KeyedDraws):
                    u = how.uniforms([at])[0]
                    want = target_distribution(logits, drawn[seq], before, 0).pick(u)
                    assert device.sampled(row) == want, f"decode {step} {layout}, row {row}"
                else:
                    params = drawn.get(seq, SamplingParams())
                    got = device.top2(row)[0]
                    want = int(np.argmax(penalised_logits(logits, params, before, 0)))
                    assert got == want, f"decode {step} {layout}, row {row}"
            for seq, tokens in added.items():
                seen[seq] += tokens
        assert device.rows_read == 0


@pytest.fixture(scope="module")
def plain_sample(host: SpeculativeEngine, copy_prompt: list[int]) -> Counter[tuple[int, ...]]:
    """Plain sampling's first two tokens on the HOST over the reference seeds (test_sampling's
    comparison: its speculative sample takes other seeds, so the two are independent)."""
    return first_tokens(host, copy_prompt, PLAIN, HOT, range(SAMPLES))


def test_speculation_on_the_device_keeps_the_target_distribution(
        device: SpeculativeEngine, copy_prompt: list[int],
        plain_sample: Counter[tuple[int, ...]]) -> None:
    """N-gram speculation drawing on the device against plain sampling on the host: the first
    token, the second and the pair are homogeneous."""
    results = compare(device, copy_prompt, NGRAM, HOT, lambda params: plain_sample)
    assert min(p for *_, p in results) > P_FLOOR, f"not the target's: {describe(results)}"


def test_a_verify_that_keeps_every_draft_is_caught(
        device: SpeculativeEngine, copy_prompt: list[int],
        plain_sample: Counter[tuple[int, ...]], monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison has the power to see a broken acceptance: a device verify that keeps
    every draft whatever the row drew makes the first token the copy's (too few bins left
    for the pair: the first token's homogeneity alone is tested)."""
    def keep_all(self: DeviceRandomSampler, ctx: Context, row0: int, pos0: int,
                 history: Sequence[int], draft: Draft,
                 mask: SlotConstraint) -> tuple[int, int]:
        n = len(draft.tokens)
        return n, self._choice(ctx, row0 + n)
    monkeypatch.setattr(DeviceRandomSampler, "verify", keep_all)
    spec_run = first_tokens(device, copy_prompt, NGRAM, HOT, range(10**6, 10**6 + SAMPLES))
    stat, df = homogeneity(marginal(plain_sample, 0), marginal(spec_run, 0))
    assert p_value(stat, df) < P_FLOOR, f"missed it: chi2 = {stat:.1f} on {df} df"


#: Cuts the device draws with, in an order that changes the graph's shape (the top-k cut, a
#: nucleus or none) from request to request (a new graph each time) and keeps it (new inputs
#: only: another temperature, min-p floor or top-p mass).
CUTS = [SamplingParams(temperature=0.9, top_k=12), SamplingParams(temperature=0.9, min_p=0.1),
        SamplingParams(temperature=1.2, top_k=30, min_p=0.05),
        SamplingParams(temperature=1.2, top_k=30), SamplingParams(temperature=0.9, top_k=12),
        SamplingParams(temperature=1.0, top_p=0.7), SamplingParams(temperature=1.4, top_p=0.9),
        SamplingParams(temperature=1.2, top_k=30, top_p=0.8, min_p=0.02)]


def test_cut_sampling_on_the_device_draws_the_hosts_tokens(soft_dense: Path) -> None:
    """Top-k, top-p and min-p cuts are drawn on the device too: one after another on the same
    sequence, plain sampling and n-gram speculation there give the host's tokens of the same
    run seed for seed, no row read; and the cuts took mass the draws would have landed in (the
    same seeds without them differ).

    Against the host's run of the same method on an engine of the same history, not plain's:
    this model has pairs of tokens whose logits are equal but for rounding, and the batches a
    row's keys and values were computed in round them, so where such a pair is the k-th
    largest or ends the nucleus the cut keeps one or the other by the batches' shapes (on the
    host as on the device; a near-tie, as a greedy one). An engine whose prefix cache holds
    the prompt from other batches parted from the host at the end of a nucleus (T 1.4, top-p
    0.9: ids 57 and 234 equal on one engine, 1.2e-7 apart on the other), so both engines
    here are fresh and are asked the same requests in the same order."""
    differ = _device_runs_as_host(soft_dense, CUTS, SEEDS[:6], 40,
                                  {"top_k": 0, "top_p": 1.0, "min_p": 0.0})
    assert differ >= len(CUTS) * 3, "the cuts never changed a draw"


def _device_runs_as_host(model: Path, requests: list[SamplingParams], seeds: range,
                         tokens: int, without: dict[str, object]) -> int:
    """Each of ``requests`` with each of ``seeds``, n-gram and plain, and plain with
    ``without`` (what is under test switched off), on a fresh engine that verifies on the
    device and a fresh one that reads its rows, asked the same requests in the same order:
    the tokens are equal and the device engine reads no row. Returns how many plain runs
    ``without`` changed."""
    differ = 0
    with _engine(model) as device, _engine(model, device=False) as host:
        text = [*PROMPT, *host.generate(PROMPT, 40, PLAIN).tokens]
        assert device.generate(PROMPT, 40, PLAIN).tokens == text[len(PROMPT):]
        rows = device.target.rows_read
        for params in requests:
            for seed in seeds:
                runs = []
                for spec, sampled in ((NGRAM, _seeded(seed, params)),
                                      (PLAIN, _seeded(seed, params)),
                                      (PLAIN, _seeded(seed, params.model_copy(update=without)))):
                    on_host = host.generate(text, tokens, spec, sampling=sampled).tokens
                    got = device.generate(text, tokens, spec, sampling=sampled).tokens
                    assert got == on_host, f"{sampled} {spec.method}"
                    runs.append(got)
                differ += runs[1] != runs[2]
        assert device.target.rows_read == rows
    return differ


#: Bias and penalties the device applies before its draw, alone and with cuts.
PENALISED = [SamplingParams(temperature=1.0, repetition_penalty=1.3),
             SamplingParams(temperature=1.1, presence_penalty=0.8, frequency_penalty=0.4),
             SamplingParams(temperature=0.9, logit_bias={7: 3.0, 100: -50.0}),
             SamplingParams(temperature=1.2, top_k=30, top_p=0.9, repetition_penalty=1.2,
                            frequency_penalty=0.3, logit_bias={12: 1.5})]
#: A greedy request with penalties: each row's top two of its adjusted logits.
GREEDY_PENALISED = SamplingParams(repetition_penalty=1.5, presence_penalty=0.4,
                                  logit_bias={3: 0.5})


def test_penalised_sampling_on_the_device_draws_the_hosts_tokens(soft_dense: Path) -> None:
    """The bias and the repetition, presence and frequency penalties are applied on the
    device, each verify row for the tokens it has seen (the committed ones and the drafts
    before it): plain sampling (greedy too) and n-gram speculation there give the host's
    tokens seed for seed, no row read, and the penalties changed the tokens (the same seeds
    without them differ). Fresh engines of one history, as the cut test's."""
    differ = _device_runs_as_host(soft_dense, [*PENALISED, GREEDY_PENALISED], SEEDS[:4], 60,
                                  {"repetition_penalty": 1.0, "presence_penalty": 0.0,
                                   "frequency_penalty": 0.0, "logit_bias": {}})
    assert differ >= len(PENALISED) * 2 + 1, "the penalties never changed a draw"


@pytest.mark.parametrize("greedy", [False, True], ids=["drawn", "greedy"])
def test_a_growing_history_grows_the_chain(soft_dense: Path, greedy: bool) -> None:
    """A row's adjustment covers every id its request has seen (the repetition penalty): as
    the history grows past the chain's room, the chain is replaced by a wider one before the
    decode, and every row's draw (or top token, greedy) is still the host's from its
    penalised logits."""
    params = SamplingParams(temperature=0.0 if greedy else 1.0, repetition_penalty=1.4,
                            frequency_penalty=0.2)
    spec = ContextSpec(n_ctx=N_CTX, n_batch=32, n_ubatch=32, n_seq_max=1, n_outputs_max=32,
                       n_outputs_max_per_seq=32, n_threads=1, device_top2=greedy)
    history = list(range(0, 60, 2))  # the prompt: 30 ids
    penalties = Penalties(params, history, 30)
    draws = Greedy(penalties) if greedy else KeyedDraws(9, 1.0, penalties=penalties)
    rooms = []
    with Model(ModelSpec(str(soft_dense), n_gpu_layers=GPU_LAYERS)) as model, \
            Context(model, spec) as device, \
            Context(model, replace(spec, device_top2=False)) as host, Batch(32) as batch:
        assert device.sample_on_device(0, draws) is draws
        for step in range(40):
            new = history if step == 0 else [(37 * step + 5 * i) % 256 for i in range(6)]
            batch.clear()
            batch.add(new, 0 if step == 0 else len(history), True, seq=0)
            row0 = batch.n_tokens - len(new)
            device.decode(batch)
            host.decode(batch)
            known = history if step == 0 else history + new
            for i in range(len(new)):
                at = (0 if step == 0 else len(history)) + i + 1
                z = host.logits(row0 + i)
                if isinstance(draws, Greedy):
                    want = int(np.argmax(penalised_logits(z, params, known[:at], 30)))
                    assert device.top2(row0 + i)[0] == want, f"step {step} row {i}"
                else:
                    u = draws.uniforms([at])[0]
                    want = target_distribution(z, params, known[:at], 30).pick(u)
                    assert device.sampled(row0 + i) == want, f"step {step} row {i}"
            if step:
                history += new
            chain = device._chains[0] if greedy else device._keyed[0]  # a test's peek
            assert chain.adjusting is not None
            rooms.append(chain.adjusting.capacity)
        assert device.rows_read == 0
    assert rooms[0] == 64 and rooms[-1] == 256 and 128 in rooms, rooms


def test_the_top_k_cut_keeps_every_id_tied_with_the_kth() -> None:
    """vLLM's rule, which the device's graph follows: ties at the k-th largest logit are kept
    (a rule that does not depend on how a sort orders them)."""
    logits = np.array([0.5, 3.0, 2.0, 2.0, 1.0, 2.0], dtype=np.float32)
    cut = target_distribution(logits, SamplingParams(temperature=1.0, top_k=2), [], 0)
    assert cut.ids.tolist() == [1, 2, 3, 5]
    one = target_distribution(logits, SamplingParams(temperature=1.0, top_k=1), [], 0)
    assert one.ids.tolist() == [1]


@pytest.mark.parametrize(("params", "logprobs", "grammar"), [
    (WARM, 2, None),
    (SamplingParams(), 2, None),
    (WARM, None, "[0-9a-f]{1,40}"),
], ids=["logprobs", "greedy-logprobs", "grammar"])
def test_requests_the_device_cannot_draw_for_read_their_rows(
        device: SpeculativeEngine, host: SpeculativeEngine, params: SamplingParams,
        logprobs: int | None, grammar: str | None) -> None:
    """Each is verified on the host: its sampler is the host's, its rows are read, and its
    tokens are an engine's without device verify, seed for seed."""
    request = SlotRequest(prompt(7, 12), 30, NGRAM, _seeded(3, params), logprobs=logprobs,
                          constraint=Constraint(kind="regex", grammar=grammar) if grammar
                          else None)
    rows = device.target.rows_read
    slot = device.admit(request)
    device.cancel(slot)
    device.step()
    assert type(slot.sampler) in (RandomSampler, GreedySampler)
    assert _run(device, [request])[0].tokens == _run(host, [request])[0].tokens
    assert device.target.rows_read > rows


def test_a_device_without_the_draws_ops_keeps_the_request_on_the_host(
        soft_dense: Path, host: SpeculativeEngine, copy_prompt: list[int],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the output device lacks an op of the draw (llama.cpp asks the sampler at attach),
    the sequence is not left with a sampler that samples nothing: it reads its rows, and the
    request samples as on the host."""
    monkeypatch.setattr(device_sampling, "device_supports_draws", lambda buft, shape: False)
    request = SlotRequest(copy_prompt, 30, NGRAM, _seeded(2))
    with _engine(soft_dense) as engine:
        slot = engine.admit(request)
        assert type(slot.sampler) is RandomSampler
        engine.cancel(slot)
        engine.step()
        assert _run(engine, [request])[0].tokens == _run(host, [request])[0].tokens
        assert engine.target.rows_read > 0


def test_a_nucleus_the_cpu_would_sort_slower_than_the_host_is_read(
        soft_dense: Path, host: SpeculativeEngine, copy_prompt: list[int],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU backend a nucleus is sorted on the device only for rows up to
    ``CPU_SORT_MAX`` ids (wider, ggml's one-thread sort costs more than the host's nucleus):
    with the bound below this model's 256 ids, a top-p request reads its rows and samples as
    on the host, while a top-k request beside it still draws on the device."""
    monkeypatch.setattr(device_sampling, "CPU_SORT_MAX", 128)
    nucleus = SlotRequest(copy_prompt, 30, NGRAM, _seeded(2, SamplingParams(temperature=0.9,
                                                                            top_p=0.8)))
    cut = SlotRequest(copy_prompt, 30, NGRAM, _seeded(2, SamplingParams(temperature=0.9,
                                                                        top_k=20)))
    with _engine(soft_dense) as engine:
        rows = engine.target.rows_read
        assert _run(engine, [cut])[0].tokens == _run(host, [cut])[0].tokens
        assert engine.target.rows_read == rows
        assert _run(engine, [nucleus])[0].tokens == _run(host, [nucleus])[0].tokens
        assert engine.target.rows_read > rows
    monkeypatch.setattr(device_sampling, "CPU_SORT_MAX", 256)
    with _engine(soft_dense) as engine:
        assert _run(engine, [nucleus])[0].tokens == _run(host, [nucleus])[0].tokens
        assert engine.target.rows_read == 0


def test_the_heads_sampled_drafts_are_verified_on_the_host(hybrid_model: Path) -> None:
    """A sampled request the MTP head drafts for reads its rows (its drafts carry the head's
    distribution); a plain one on the same engine draws on the device and reads none."""
    with _engine(hybrid_model, method=SpecMethod.MTP) as engine:
        assert engine.plan.device_verify
        mtp = engine.generate(PROMPT, 30, SpecSettings(method=SpecMethod.MTP, draft_max=4),
                              sampling=_seeded(1))
        rows = engine.target.rows_read
        assert rows > 0 and mtp.telemetry.drafted > 0
        engine.generate(PROMPT, 30, PLAIN, sampling=_seeded(1))
        assert engine.target.rows_read == rows


def test_which_requests_draw_on_the_device() -> None:
    """The one decision, its seed fixed there: a seeded request keeps its seed, an unseeded
    one is given one that its sampler then uses."""
    draws = verifies_on_device(_seeded(42), None, False)
    assert draws == KeyedDraws(42, WARM.temperature)
    cut = SamplingParams(temperature=0.8, top_k=9, min_p=0.2, seed=4)
    assert verifies_on_device(cut, None, False) == KeyedDraws(4, 0.8, 9, 0.2)
    nucleus = cut.model_copy(update={"top_p": 0.9})
    assert verifies_on_device(nucleus, None, False) == KeyedDraws(4, 0.8, 9, 0.2, 0.9)
    assert verifies_on_device(SamplingParams(), None, False) is True
    assert verifies_on_device(WARM, None, False, head_drafts=True) is False
    assert verifies_on_device(SamplingParams(), None, False, head_drafts=True) is True
    unseeded = verifies_on_device(WARM, None, False)
    assert isinstance(unseeded, KeyedDraws)
    sampler = sampling.make_sampler(WARM, 4, unseeded)
    assert isinstance(sampler, DeviceRandomSampler) and sampler.seed == unseeded.seed
    assert draws.uniforms([5, 6]) == [sampling.keyed_uniform(42, p, sampling.Stream.TARGET)
                                      for p in (5, 6)]
