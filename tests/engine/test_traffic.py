"""Traffic as a worker sees it: requests of every kind (speculative and plain, greedy, with
logprobs, sampled with and without top-k and min-p cuts) arriving at random steps, on engines
with everything a GPU engine turns on by default: rows verified on the device and verify
steps padded to replayable shapes (forced on here), and the MTP head drafting for several
slots of the hybrid. Every greedy output must
equal plain greedy decoding of its prompt alone, token for token (the tiny models are F32);
the sampled requests must finish with their lengths.

The dense engine keeps a KV stream per sequence, as every multi-slot exactness test on the F32
models does (docs/engine.md, "Several slots"): in one shared cache a sequence's new cells fill
the holes another left, its attention then sums its cells in another order, and on the tiny
dense model that difference grows from 1e-6 to 6e-2 within a dozen tokens (5 of 80 random runs
parted from plain at margins of 0.4-3 nats, with or without speculation; 0 of 80 with streams).
The hybrid gets a stream per sequence anyway.

Each schedule is random (prompts that repeat themselves so the lookup drafters find drafts,
lengths, arrival steps, which kind), seeded: three bugs were found by this kind of traffic
and by no fixed schedule (docs/engine.md: a rebuilt sampled graph handing a row another
row's result; several slots of a hybrid rolled back from another state, with one KV cache,
and with sequences out of order in a decode).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from shared.protocol import SamplingParams, SpecMethod, SpecSettings
from worker.engine.engine import EngineConfig, SpeculativeEngine
from worker.engine.slot import SlotRequest
from worker.launch import EngineCapacity
from worker.llm import Batch

from .conftest import CHEAP_ROWS
from .schedule import Arrival, plain_greedy, run_schedule

N_CTX = 512
REQUESTS = 48
GREEDY_KINDS = ("draft", "ngram", "plain", "logprobs")
#: The sampled requests' cuts, by request number (not drawn: each seed keeps its schedule): a
#: sequence that draws on the device gets a new sampler when its next request cuts to another
#: top-k, and its graph is rebuilt beside the others' rows.
CUTS: list[dict[str, Any]] = [{}, {"top_k": 20}, {"min_p": 0.05}, {"top_k": 7, "min_p": 0.02}]


def _request(rng: random.Random, kind: str, draft: SpecMethod, index: int) -> SlotRequest:
    """One request of ``kind``: a prompt of a few tokens repeated, 5-39 tokens to write. Half
    the prompts come from a pool of six, some with a token more: cached prefixes and earlier
    outputs are reused."""
    source = random.Random(rng.randrange(6)) if rng.random() < 0.5 else rng
    base = [source.randrange(1, 250) for _ in range(source.randrange(3, 12))]
    prompt = (base * source.randrange(1, 4))[:40] + [rng.randrange(1, 250)] * rng.randrange(2)
    spec = {"ngram": SpecSettings(method=SpecMethod.NGRAM, draft_max=5),
            "plain": SpecSettings(method=SpecMethod.NONE)}.get(kind, SpecSettings(method=draft))
    sampling = (SamplingParams(temperature=0.8, seed=index, **CUTS[index % len(CUTS)])
                if kind == "sampled" else SamplingParams())
    return SlotRequest(prompt, rng.randrange(5, 40), spec, sampling,
                       logprobs=2 if kind == "logprobs" else None)


@pytest.mark.parametrize(("fixture", "slots", "draft", "config"), [
    ("dense_model", 4, SpecMethod.SUFFIX,
     {"device_verify": True, "verify_buckets": True, "per_sequence_kv": True}),
    ("hybrid_model", 3, SpecMethod.MTP, {}),
    ("hybrid_model", 3, SpecMethod.MTP, {"device_verify": True}),
    ("hybrid_model", 4, SpecMethod.MTP_SUFFIX, {"device_verify": True}),
], ids=["dense-device-buckets", "hybrid-mtp", "hybrid-mtp-device", "hybrid-mtp-suffix-device"])
@pytest.mark.parametrize("seed", [5, 8, 13, 116, 119])
def test_random_traffic_keeps_every_greedy_output_plain(
        request: pytest.FixtureRequest, fixture: str, slots: int, draft: SpecMethod,
        config: dict[str, Any], seed: int) -> None:
    model: Path = request.getfixturevalue(fixture)
    rng = random.Random(seed)
    kinds = [rng.choice([*GREEDY_KINDS, "draft", "sampled"]) for _ in range(REQUESTS)]
    requests = [_request(rng, kind, draft, i) for i, kind in enumerate(kinds)]
    arrivals, step = [], 0
    for r in requests:
        step += rng.choice([0, 0, 1, 3, 8])
        arrivals.append(Arrival(step, r))
    with SpeculativeEngine(EngineConfig(
            str(model), n_ctx=N_CTX, n_threads=1, slots=slots, row_costs=CHEAP_ROWS,
            row_budget=False, capacity=EngineCapacity(method=SpecMethod.AUTO, draft_max=7),
            **config)) as engine:
        for key in ("device_verify", "verify_buckets"):
            if key in config:
                assert getattr(engine.plan, key) is config[key]  # really on
        orders = _record_sequence_orders(engine)
        results = run_schedule(engine, arrivals).results
        drafted = engine.telemetry().drafted
    parted = [f"request {i} ({kind}): {r.tokens} for {want}"
              for i, (kind, req, r) in enumerate(zip(kinds, requests, results, strict=True))
              if kind != "sampled"
              and r.tokens != (want := plain_greedy(model, tuple(req.prompt_tokens),
                                                    req.max_tokens, N_CTX))]
    assert not parted, parted
    assert all(len(r.tokens) == req.max_tokens or r.finish_reason.value != "length"
               for req, r in zip(requests, results, strict=True))
    assert drafted > 0
    # llama.cpp's recurrent memory needs a decode's sequences in ascending order (verify.py):
    # rows of sequences 2, 0, 1 in one verify, then a rollback, parted seed 116 from plain.
    assert all(order == sorted(order) for order in orders)
    assert any(len(set(order)) > 1 for order in orders)  # several slots shared decodes


def _record_sequence_orders(engine: SpeculativeEngine) -> list[list[int]]:
    """The sequence id of every row of every target decode from now on, in batch order."""
    orders: list[list[int]] = []
    target = engine.target
    decode = target.decode

    def recorded(batch: Batch) -> None:
        raw = batch.raw
        orders.append([raw.seq_id[i][0] for i in range(batch.n_tokens)])
        decode(batch)

    target.decode = recorded  # type: ignore[method-assign]
    return orders
