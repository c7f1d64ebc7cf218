"""Structured output in the engine: a constraint masks the target distribution of every
verify row, forced runs are verified as drafts, and the matcher follows the slot.

The tiny models here are the project's seeded F32 ones with a byte-level vocabulary (token
id = byte), so the grammar engine sees real text: with random weights their unconstrained
output is byte soup, so every JSON document below exists only because the mask bit. Greedy
constrained output with every drafter must equal constrained plain decoding token for token;
sampled output must keep the masked distribution (and does not when the mask reaches the
draft only, which the chi-square test switches on to see it fail).
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import jsonschema  # type: ignore[import-untyped]
import pytest
from helpers import PROMPT
from llguidance import LLMatcher

from shared.constraint import Constraint, ConstraintKind
from shared.protocol import FinishReason, SamplingParams, SpecMethod, SpecSettings
from worker.engine.constraint.tokenizer import grammar_vocab
from worker.engine.core.constraint import UNCONSTRAINED
from worker.engine.core.draft import Draft, VerifyOutcome
from worker.engine.engine import EngineConfig, GenerationResult, SpeculativeEngine
from worker.engine.proposers.none import NoDraft
from worker.engine.slot import SlotRequest
from worker.engine.verify import Verifier
from worker.launch import EngineCapacity
from worker.llm import LlamaError

from .schedule import Arrival, run_schedule

N_MAX = 7
MAX_TOKENS = 400

#: $defs, nested objects, arrays, enums, bounded numbers, optional fields: every string is
#: bounded, so a random model's output ends where the grammar does.
ORDER = {
    "type": "object",
    "properties": {
        "user": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 6},
            "id": {"type": "integer", "minimum": 1, "maximum": 999}},
            "required": ["name", "id"], "additionalProperties": False},
        "items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 2,
                  "maxItems": 3},
        "status": {"enum": ["open", "closed", "pending"]},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "note": {"type": "string", "maxLength": 4},
    },
    "required": ["user", "items", "status", "score"],
    "additionalProperties": False,
    "$defs": {"item": {"type": "object", "properties": {
        "sku": {"type": "string", "maxLength": 3},
        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 2}},
        "required": ["sku", "qty", "tags"], "additionalProperties": False}},
}
#: Many fixed keys: most of the output is forced.
RECORD = {
    "type": "object",
    "properties": {key: {"type": "integer", "minimum": 0, "maximum": 9}
                   for key in ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot")},
    "required": ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot"],
    "additionalProperties": False,
}
SCHEMAS = {"order": ORDER, "record": RECORD}
LARK = Constraint(kind=ConstraintKind.LARK, grammar='start: "<" item "," item ("," item)? ">"\n'
                                      'item: "ab" /[0-9]/ | "cd" /[a-c]{1,3}/')


def schema(name: str) -> Constraint:
    return Constraint(kind=ConstraintKind.JSON_SCHEMA, json_schema=SCHEMAS[name])


def open_engine(model: Path, method: SpecMethod, slots: int = 1,
                rollback_depth: int | None = None) -> SpeculativeEngine:
    capacity = EngineCapacity(method=method, draft_max=N_MAX, rollback_depth=rollback_depth)
    return SpeculativeEngine(EngineConfig(str(model), n_ctx=1024, n_threads=1, slots=slots,
                                          capacity=capacity, row_budget=False,
                                          per_sequence_kv=True))


#: The drafters: (model, method the engine loads for).
DRAFTERS = {"ngram": ("dense", SpecMethod.NGRAM), "suffix": ("dense", SpecMethod.SUFFIX),
            "mtp": ("hybrid", SpecMethod.MTP)}


@pytest.fixture(scope="module")
def engines(byte_models: dict[str, Path]) -> Iterator[dict[str, SpeculativeEngine]]:
    opened = {name: open_engine(byte_models[model], method)
              for name, (model, method) in DRAFTERS.items()}
    yield opened
    for engine in opened.values():
        engine.close()


def run(engine: SpeculativeEngine, prompt: Sequence[int], constraint: Constraint | None,
        method: SpecMethod, **extra: object) -> GenerationResult:
    request = SlotRequest(list(prompt), MAX_TOKENS, SpecSettings(method=method),
                          constraint=constraint, prefix_cache=False, **extra)  # type: ignore[arg-type]
    return run_schedule(engine, [Arrival(0, request)]).results[0]


def prompt_of(engine: SpeculativeEngine, text: str) -> list[int]:
    return engine.tokenize(text)


@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_greedy_constrained_equals_plain(engines: dict[str, SpeculativeEngine], drafter: str,
                                         name: str) -> None:
    """Every drafter's constrained greedy output is constrained plain decoding's, token for
    token, and a document that parses and validates; the mask really bit (unconstrained,
    the same prompt gives no JSON) and the grammar's completion ended it (``stop``)."""
    engine = engines[drafter]
    method = DRAFTERS[drafter][1]
    prompt = prompt_of(engine, f"Reply with one {name} as JSON: ")
    plain = run(engine, prompt, schema(name), SpecMethod.NONE)
    spec = run(engine, prompt, schema(name), method)
    assert spec.tokens == plain.tokens
    assert plain.finish_reason is spec.finish_reason is FinishReason.STOP
    jsonschema.validate(json.loads(spec.text), SCHEMAS[name])
    free = run(engine, prompt, None, SpecMethod.NONE)
    with pytest.raises(ValueError):
        json.loads(free.text[: len(spec.text)])
    t = spec.telemetry
    assert t.constrained_tokens == len(spec.tokens)
    assert t.target_decodes < plain.telemetry.target_decodes  # drafts and forced runs paid
    assert t.forced_tokens > 0
    assert free.telemetry.constrained_tokens == free.telemetry.forced_tokens == 0


@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
def test_grammar_constrained_equals_plain(engines: dict[str, SpeculativeEngine],
                                          drafter: str) -> None:
    """A Lark grammar (alternatives, repetition, regex terminals) behaves the same way."""
    engine = engines[drafter]
    prompt = prompt_of(engine, "list: ")
    plain = run(engine, prompt, LARK, SpecMethod.NONE)
    spec = run(engine, prompt, LARK, DRAFTERS[drafter][1])
    assert spec.tokens == plain.tokens
    assert spec.text.startswith("<") and spec.text.endswith(">")
    assert spec.finish_reason is FinishReason.STOP


@pytest.mark.parametrize("drafter", ["ngram", "mtp"])
def test_several_slots(byte_models: dict[str, Path], drafter: str) -> None:
    """Four slots stepped together (two schemas, a grammar, one unconstrained; MTP drafts
    them in one batched chain) each give their own request's solo plain output: one slot's
    matcher never sees another's tokens."""
    prompts = ["order: ", "record: ", "list: ", "free text: "]
    constraints = [schema("order"), schema("record"), LARK, None]
    model, method = DRAFTERS[drafter]
    with open_engine(byte_models[model], method, slots=4) as engine:
        solo = [run(engine, prompt_of(engine, p), c, SpecMethod.NONE).tokens
                for p, c in zip(prompts, constraints, strict=True)]
        arrivals = [Arrival(i, SlotRequest(prompt_of(engine, p), MAX_TOKENS if c else 60,
                                           SpecSettings(method=method),
                                           constraint=c, prefix_cache=False))
                    for i, (p, c) in enumerate(zip(prompts, constraints, strict=True))]
        together = run_schedule(engine, arrivals)
    assert [r.tokens for r in together.results][:3] == solo[:3]
    assert together.results[3].tokens == solo[3][:60]
    assert max(len(v) for v in together.verified) == 4  # they really ran side by side


def test_jump_forward_in_one_decode(byte_models: dict[str, Path]) -> None:
    """Forced runs are verified as drafts, in one decode each: with a drafter that never
    drafts, a grammar of two fixed runs around one free character takes two decodes (the
    first run plus its bonus, the free character's; the second run, which completes it)
    instead of one per token, and says the same."""
    grammar = Constraint(kind=ConstraintKind.LARK, grammar='start: "abcdef" /[0-9]/ "ghijk"')
    with open_engine(byte_models["dense"], SpecMethod.NGRAM) as engine:
        prompt = prompt_of(engine, "code: ")
        plain = run(engine, prompt, grammar, SpecMethod.NONE)
        jump = run(engine, prompt, grammar, SpecMethod.NGRAM, proposer=NoDraft())
    assert jump.tokens == plain.tokens and len(plain.tokens) == 12
    assert plain.telemetry.target_decodes == 12
    assert jump.telemetry.target_decodes == 2
    assert jump.telemetry.forced_tokens == 11
    assert jump.telemetry.drafted == jump.telemetry.accepted == 11


class GrammarOracle:
    """Proposes the known constrained output up to a scheduled depth (past the grammar's
    forced run), then a different token the grammar allows there and more allowed tokens up
    to the width: the mask cuts none of it, the target rejects all of it from that depth.
    The depth cycles through 0..width, so rejections of every depth occur, deep ones too."""

    def __init__(self, reference: Sequence[int], engine: SpeculativeEngine,
                 constraint: Constraint) -> None:
        self.reference = list(reference)
        self._vocab = grammar_vocab(engine.model)
        self._grammar = constraint.llguidance_grammar()
        self._n_prompt = 0
        self._turn = 0
        #: Depth of every rejected tail the oracle proposed.
        self.rejections: list[int] = []

    def start(self, prompt: Sequence[int]) -> None:
        self._n_prompt = len(prompt)
        self._turn = 0
        self.rejections = []

    def propose(self, history: Sequence[int], width: int, p_min: float) -> Draft:
        done = len(history) - self._n_prompt
        truth = self.reference[done:done + width]
        matcher = LLMatcher(self._vocab.tokenizer, self._grammar, log_level=0)
        assert matcher.consume_tokens(self.reference[:done])
        depth = max(self._turn % (width + 1), len(matcher.compute_ff_tokens()))
        self._turn += 1
        if depth >= len(truth):
            return Draft(truth)
        assert matcher.consume_tokens(truth[:depth])
        draft = truth[:depth]
        avoid = truth[depth]
        while len(draft) < width:
            token = next((t for t in range(self._vocab.n_vocab) if t != avoid
                          and t not in self._vocab.eog and matcher.validate_tokens([t]) == 1),
                         None)
            if token is None:
                break
            assert matcher.consume_token(token)
            draft.append(token)
            avoid = -1
        if len(draft) > depth:
            self.rejections.append(len(draft) - depth)
        return Draft(draft)

    def observe(self, outcome: VerifyOutcome) -> None:
        """Stateless."""


def test_matcher_rolls_back_with_the_slot(byte_models: dict[str, Path]) -> None:
    """Drafts the grammar allows but the target rejects, at every depth, on the hybrid with
    compact rollback (D = 2 < N: deeper rejections restore a checkpoint and replay): the
    matcher rolls back with the slot every time, so the output is still constrained plain
    decoding's and nothing valid was cut. Without the rollback (the matcher left standing
    after the rejected drafts) the next masks would be a wrong state's."""
    constraint = schema("order")
    with open_engine(byte_models["hybrid"], SpecMethod.MTP, rollback_depth=2) as engine:
        prompt = prompt_of(engine, "order: ")
        plain = run(engine, prompt, constraint, SpecMethod.NONE)
        oracle = GrammarOracle(plain.tokens, engine, constraint)
        spec = run(engine, prompt, constraint, SpecMethod.MTP, proposer=oracle)
    assert spec.tokens == plain.tokens
    t = spec.telemetry
    assert t.mask_cut_drafts == 0
    assert max(oracle.rejections) > 2 and t.replay_events > 0
    assert t.drafted > t.accepted


def _chi2_tail(stat: float, df: int) -> float:
    """Upper tail of chi-square(df), Wilson-Hilferty (ample at these tails)."""
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def _homogeneity(a: Counter[str], b: Counter[str]) -> float:
    """p-value of the chi-square test that two samples come from one distribution."""
    keys = sorted(set(a) | set(b))
    na, nb = sum(a.values()), sum(b.values())
    stat = 0.0
    for k in keys:
        total = a[k] + b[k]
        for observed, n in ((a[k], na), (b[k], nb)):
            expected = total * n / (na + nb)
            stat += (observed - expected) ** 2 / expected
    return _chi2_tail(stat, max(len(keys) - 1, 1))


#: Draws per sample: enough for the wrong variant's forbidden tokens to show at once.
DRAWS = 600
ALPHABET = Constraint(kind=ConstraintKind.REGEX, grammar="[a-l][a-l]")


def plain_sample(engine: SpeculativeEngine, prompt: list[int], method: SpecMethod,
                 seed0: int) -> Counter[str]:
    """The first generated character of ``DRAWS`` sampled generations, by character."""
    counts: Counter[str] = Counter()
    params = SamplingParams(temperature=1.0)
    for i in range(DRAWS):
        request = SlotRequest(prompt, 2, SpecSettings(method=method),
                              sampling=params.model_copy(update={"seed": seed0 + i}),
                              constraint=ALPHABET)
        result = run_schedule(engine, [Arrival(0, request)]).results[0]
        counts[engine.detokenize(result.tokens[:1]) or "<end>"] += 1
    return counts


@pytest.mark.parametrize("draft_only", [False, True], ids=["masked-target", "draft-only"])
def test_sampling_keeps_the_masked_distribution(byte_models: dict[str, Path], draft_only: bool,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """MTP drafts sampled from the masked head, verified by rejection sampling against the
    masked target: the first character's distribution is plain constrained sampling's
    (chi-square homogeneity). With the mask on the draft only (the verify rows unmasked)
    the same test fails: the target's forbidden characters come through."""
    with open_engine(byte_models["soft"], SpecMethod.MTP) as engine:
        prompt = prompt_of(engine, "pick: ")
        plain = plain_sample(engine, prompt, SpecMethod.NONE, seed0=0)
        if draft_only:
            accept = Verifier._accept
            monkeypatch.setattr(Verifier, "_accept", lambda self, job, row0, alone: accept(
                self, replace(job, constraint=UNCONSTRAINED), row0, alone))
        spec = plain_sample(engine, prompt, SpecMethod.MTP, seed0=10_000)
    assert set(plain) <= set("abcdefghijkl") and len(plain) >= 6  # the mask spreads over many
    p_value = _homogeneity(plain, spec)
    if draft_only:
        assert p_value < 1e-6, (plain, spec)
    else:
        assert p_value > 1e-3, (plain, spec)


def test_constraint_the_vocabulary_cannot_spell(dense_model: Path) -> None:
    """On the hex-piece test vocabulary no token spells ``{``: a JSON constraint is a
    ValueError at admission naming the problem, nothing is placed, and a grammar over what
    the vocabulary does spell runs (its tokenizer hashes text, so forced bytes are spelled
    by the pieces themselves)."""
    with open_engine(dense_model, SpecMethod.NGRAM) as engine:
        with pytest.raises(ValueError, match="json_schema constraint: this model's vocab"):
            engine.admit(SlotRequest(PROMPT, 5, constraint=schema("record")))
        assert engine.free_slots == 1
        hexes = Constraint(kind=ConstraintKind.REGEX, grammar="7[0-9a-f]{3}")
        result = run(engine, PROMPT, hexes, SpecMethod.NGRAM)
    assert len(result.text) == 4 and result.text[0] == "7"
    assert result.finish_reason is FinishReason.STOP


HEXES = Constraint(kind=ConstraintKind.REGEX, grammar="[0-9a-f]{1,40}")


@pytest.mark.parametrize("method", [SpecMethod.NGRAM, SpecMethod.SUFFIX])
def test_drafts_that_complete_a_grammar_on_a_model_with_no_end_token(
        dense_model: Path, method: SpecMethod) -> None:
    """The hex-piece test vocabulary has no end token (llguidance's is a virtual id past its
    256 logits). On a prompt that repeats, the drafter drafts the output up to where the
    grammar is complete, where only that end is allowed: the token that completes it is
    verified as the last row's pick, so the generation stops there as plain decoding does,
    on one slot and two, greedy and sampled, with a budget the close watches (30) and one it
    does not (400). The row after such a draft once took an id the grammar forbids (42 hex
    digits), or, with the close watched, llguidance's end id 256, which aborted the process
    in llama.cpp's token lookup; ``token_bytes`` now refuses such an id with an exception."""
    with open_engine(dense_model, method, slots=2) as engine:
        with pytest.raises(LlamaError, match="token 256 is not in this model's vocabulary"):
            engine.model.token_bytes(engine.model.n_vocab)
        prompt = [*PROMPT, *engine.generate(PROMPT, 40, SpecSettings(method=SpecMethod.NONE)
                                            ).tokens]

        def request(max_tokens: int, sampling: SamplingParams,
                    spec: SpecMethod = method) -> SlotRequest:
            return SlotRequest(prompt, max_tokens, SpecSettings(method=spec),
                               sampling=sampling, constraint=HEXES, prefix_cache=False)

        for sampling in (SamplingParams(), SamplingParams(temperature=0.7, seed=3)):
            for max_tokens in (30, 400):
                runs = [run_schedule(engine, [Arrival(0, request(max_tokens, sampling))]
                                     * slots).results for slots in (1, 2)]
                for result in (r for rs in runs for r in rs):
                    assert re.fullmatch("[0-9a-f]{40}", result.text), result.text
                    assert result.finish_reason is FinishReason.STOP
                    assert result.telemetry.accepted > 0  # drafts carried the output
                if sampling.temperature == 0:
                    plain = run_schedule(engine, [Arrival(0, request(
                        max_tokens, sampling, SpecMethod.NONE))]).results[0]
                    assert {tuple(r.tokens) for rs in runs for r in rs} == {tuple(plain.tokens)}
