"""Constrained output that always parses within ``max_tokens``: llama.cpp's cap on a number's
digits, the shortest close a grammar allows from where its matcher stands, and the budget's
steering to it, in the engine with every drafter.

Everything runs against real llguidance matchers compiled for the project's byte-level tiny
models (token id = byte), whose random weights write byte soup: an output that parses here
parses because the constraint made it, and a budget the soup would overrun is the one the
close has to save.
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import numpy as np
import pytest

from coordinator.openai_api.structured import Tools
from shared.constraint import Constraint, ConstraintKind
from shared.protocol import (
    FinishReason,
    FunctionDefinition,
    SamplingParams,
    SpecMethod,
    SpecSettings,
    ToolDefinition,
)
from shared.tool_calls import CALL_SEPARATOR, MARKER, render_call
from worker.engine.constraint.close import close_plan
from worker.engine.constraint.matcher import bind, compile_grammar
from worker.engine.constraint.numbers import MAX_DIGITS, number_cap
from worker.engine.constraint.tokenizer import GrammarVocab, grammar_vocab
from worker.engine.core.constraint import SlotConstraint
from worker.engine.core.telemetry import SpecCounters
from worker.engine.engine import EngineConfig, GenerationResult, SpeculativeEngine
from worker.engine.slot import SlotRequest
from worker.launch import EngineCapacity
from worker.llm import Model, ModelSpec

from .schedule import Arrival, run_schedule
from .test_constraints import _homogeneity

#: Unbounded numbers, integers, strings and arrays: nothing but the budget ends a byte soup.
UNBOUNDED = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "score": {"type": "number"},
                   "count": {"type": "integer"},
                   "tags": {"type": "array", "items": {"type": "string"}},
                   "ratio": {"type": "number", "minimum": 0, "maximum": 1}},
    "required": ["name", "score", "count", "tags", "ratio"],
    "additionalProperties": False,
}
#: Its shortest document, one byte a token: what the tiny vocabulary needs at the least.
SHORTEST = len('{"name":"","score":0,"count":0,"tags":[],"ratio":0}')


def json_schema(schema: dict[str, Any]) -> Constraint:
    return Constraint(kind=ConstraintKind.JSON_SCHEMA, json_schema=schema)


JSON_OBJECT = Constraint(kind=ConstraintKind.JSON_OBJECT)


@pytest.fixture(scope="module")
def model(byte_models: dict[str, Path]) -> Iterator[Model]:
    with Model(ModelSpec(str(byte_models["dense"]))) as loaded:
        yield loaded


@pytest.fixture(scope="module")
def vocab(model: Model) -> GrammarVocab:
    return grammar_vocab(model)


def ids(text: str) -> list[int]:
    """The byte vocabulary's tokens of ``text`` (token id = byte)."""
    return list(text.encode())


def text_of(tokens: list[int]) -> str:
    return bytes(tokens).decode()


def allowed(constraint: SlotConstraint, path: list[int]) -> set[str]:
    """The characters the constraint lets a row have after ``path``."""
    logits = np.zeros(256, dtype=np.float32)
    return {chr(t) for t in np.nonzero(np.isfinite(constraint.masked(path, logits)))[0]
            if t < 255}


# -- the number cap --------------------------------------------------------------------------
def test_the_cap_counts_digit_runs_outside_strings(vocab: GrammarVocab) -> None:
    """16 digits in a row of a number, then no more: counted again after ``.``, ``e`` or any
    other byte, never inside a string (an escaped quote does not end one), and from the
    opening text on when the output's JSON starts there (before it, or when the output
    opens otherwise, nothing is capped)."""
    def run(cap_opening: str, text: str) -> list[bool]:
        cap = number_cap(vocab, cap_opening.encode())
        state, overs = cap.start, []
        for token in ids(text):
            state, over = cap.step(state, token)
            overs.append(over)
        return overs

    digits = "1234567890123456"
    assert len(digits) == MAX_DIGITS
    assert not any(run("", f"[{digits}.{digits}e-{digits}]"))
    assert run("", f"[{digits}7]")[-2]  # the 17th digit in a row
    assert run("", f"[1.{digits}9")[-1]
    assert not any(run("", f'["{digits * 3}", "a\\"{digits * 2}"]'))
    assert run("", f'["a\\"", {digits}0]')[-2]  # the escaped quote did not end the string
    assert run(MARKER, f'{MARKER}\n{{"n": {digits}0}}')[-2]
    assert not any(run(MARKER, f"the answer is {digits * 2}"))
    # what a mask leaves out: from the 16th digit in a row, every digit
    cap = number_cap(vocab, b"")
    state = cap.start
    for token in ids(digits[:-1]):
        state, _ = cap.step(state, token)
    assert not cap.forbidden(state)[ord("7")]
    forbidden = cap.forbidden(cap.step(state, ord("6"))[0])
    assert forbidden[ord("7")] and not forbidden[ord(".")] and not forbidden[ord(",")]


@pytest.mark.parametrize("constraint, prefix", [
    (json_schema({"type": "object", "properties": {"x": {"type": "number"}},
                  "required": ["x"], "additionalProperties": False}), '{"x":'),
    (json_schema({"type": "object", "properties": {"x": {"type": "number", "minimum": 0,
                                                         "maximum": 1}},
                  "required": ["x"], "additionalProperties": False}), '{"x":1.'),
    (json_schema({"type": "object", "properties": {"x": {"type": "integer"}},
                  "required": ["x"], "additionalProperties": False}), '{"x":-'),
    (JSON_OBJECT, '{"x":[2,'),
    (Tools([ToolDefinition(function=FunctionDefinition(name="f"))], "required").constraint(None),
     f'{MARKER}\n{{"name": "f", "arguments": {{"n":'),
    (Tools([ToolDefinition(function=FunctionDefinition(name="f"))], "auto").constraint(None),
     f'{MARKER}\n{{"name": "f", "arguments": {{"n":0.'),
], ids=["number", "number-in-0-1", "integer", "json-object", "tool-call", "tool-or-text"])
def test_masks_cap_numbers_as_llama_cpp_does(model: Model, constraint: Constraint,
                                             prefix: str) -> None:
    """The issue's ``1.000…``: wherever a number is written (a JSON schema's, bounded or
    not, an integer, a json_object's, a tool call's arguments), after 16 digits in a row
    the mask allows no 17th, only what ends the run; a string's digits are not capped."""
    constraint_ = bind(compile_grammar(constraint, model), model, SpecCounters())
    path = ids(prefix + "9" * MAX_DIGITS if not prefix.endswith("1.") else prefix + "0" * 16)
    assert allowed(constraint_, path[:-1]) & set("0123456789")
    after = allowed(constraint_, path)
    assert not after & set("0123456789"), after
    assert after, "something ends the number"
    string = compile_grammar(json_schema({"type": "string"}), model)
    assert set("0123456789") <= allowed(bind(string, model, SpecCounters()),
                                        ids('"' + "7" * 40))


def test_where_the_json_starts_is_the_constraints_to_say() -> None:
    """The JSON kinds are JSON from their first byte and take no ``json_from``; a tool-call
    grammar says where its JSON starts: at once when every alternative is JSON, at the call
    marker when free text may stand in its place."""
    assert json_schema(UNBOUNDED).json_opening() == JSON_OBJECT.json_opening() == ""
    with pytest.raises(ValueError, match="takes no 'json_from'"):
        Constraint(kind=ConstraintKind.JSON_OBJECT, json_from="")
    tools = [ToolDefinition(function=FunctionDefinition(name="f"))]
    assert Tools(tools, "required").constraint(None).json_opening() == ""
    assert Tools(tools, "auto").constraint(JSON_OBJECT).json_opening() == ""
    assert Tools(tools, "auto").constraint(None).json_opening() == MARKER
    grammar = Constraint(kind=ConstraintKind.LARK, grammar='start: "1"')
    assert grammar.json_opening() is None


def test_free_text_beside_tool_calls_is_not_capped(model: Model) -> None:
    """``auto`` without a format allows a message of any text: digits there are the model's
    own (the cap arms only once the output opens with the call marker)."""
    tools = Tools([ToolDefinition(function=FunctionDefinition(name="f"))], "auto")
    constraint = bind(compile_grammar(tools.constraint(None), model), model, SpecCounters())
    assert set("0123456789") <= allowed(constraint, ids("call me at " + "5" * 30))


# -- the shortest close ------------------------------------------------------------------------
@pytest.mark.parametrize("constraint, prefix, close", [
    (json_schema(UNBOUNDED), '{"name":"ab', '","score":0,"count":0,"tags":[],"ratio":0}'),
    (json_schema(UNBOUNDED), '{"name":"","score":-1.5e', '0,"count":0,"tags":[],"ratio":0}'),
    (json_schema(UNBOUNDED), '{"name":"","score":1,"count":2,"tags":["x","y', '"],"ratio":0}'),
    (JSON_OBJECT, "", "{}"),
    (JSON_OBJECT, '{"a":[{"b":"c', '"}]}'),
    (JSON_OBJECT, '{"a":{', "}}"),
    (JSON_OBJECT, '{"a":tr', "ue}"),
    (Constraint(kind=ConstraintKind.REGEX, grammar="[a-c]{2,}[0-9]"), "ab", "0"),
], ids=["string", "exponent", "array", "empty", "nested", "open-object", "literal", "regex"])
def test_close_plan_is_the_short_way_out(model: Model, vocab: GrammarVocab,
                                         constraint: Constraint, prefix: str,
                                         close: str) -> None:
    """From where the matcher stands, the plan closes what is open, the grammar's shortest
    way (closers before openers, required keys forced, the shortest number), leaves the
    matcher where it stood, and is None under a limit shorter than itself."""
    compiled = compile_grammar(constraint, model)
    matcher = compiled.matcher
    assert matcher.consume_tokens(ids(prefix))
    cap = compiled.cap
    state = cap.start if cap else 0
    for token in ids(prefix):
        state = cap.step(state, token)[0] if cap else 0
    before = matcher.compute_bitmask()
    plan = close_plan(matcher, vocab, 100, cap, state)
    assert plan is not None and text_of(plan) == close
    assert matcher.compute_bitmask() == before and not matcher.is_error()
    assert close_plan(matcher, vocab, len(close) - 1, cap, state) is None
    assert matcher.consume_tokens(plan) and matcher.is_accepting()
    assert close_plan(matcher, vocab, 0, cap, state) == []


def test_the_shortest_document_is_measured_at_compile(model: Model) -> None:
    """What a budget is measured against: the shortest document from the start."""
    compiled = compile_grammar(json_schema(UNBOUNDED), model)
    assert compiled.shortest == SHORTEST
    assert compiled.closes_within(SHORTEST) and not compiled.closes_within(SHORTEST - 1)
    assert compiled.budget_note(SHORTEST) is None
    note = compiled.budget_note(5)
    assert note is not None and "max_tokens 5" in note and f"{SHORTEST} tokens" in note


# -- the budget, with an adversary for a model ---------------------------------------------------
def adversarial_run(model: Model, constraint: Constraint, budget: int,
                    seed: int) -> tuple[str, int]:
    """Decode ``budget`` tokens as a model that never wants to stop would: each step a random
    allowed token (end tokens never, openers and digits often), settled, committed. Returns
    the text and how many tokens the budget steered."""
    rng = random.Random(seed)
    counters = SpecCounters()
    slot = bind(compile_grammar(constraint, model), model, counters, budget)
    out: list[int] = []
    steered = 0
    logits = np.zeros(256, dtype=np.float32)
    while len(out) < budget:
        choices = [t for t in np.nonzero(np.isfinite(slot.masked([], logits)))[0] if t < 255]
        if not choices:
            break
        wanted = rng.choice([t for t in choices if chr(t) in '{["0123456789,:a'] or choices)
        token = slot.settle([], int(wanted))
        steered += token != wanted
        if token == 255:  # the engine commits what came before an end token
            slot.commit(0, [])
            break
        out.append(token)
        if slot.commit(0, [token]):
            break
    assert counters.grammar_forced_closes == (1 if steered else 0)
    return text_of(out), steered


@pytest.mark.parametrize("constraint, schema", [
    (json_schema(UNBOUNDED), UNBOUNDED), (JSON_OBJECT, {"type": "object"})],
    ids=["schema", "json-object"])
def test_a_runaway_model_still_closes_within_the_budget(model: Model, constraint: Constraint,
                                                        schema: dict[str, Any]) -> None:
    """Whatever the model reaches for (nested openers, endless digits and strings), from the
    shortest document's length up every budget ends in a document that parses and
    validates, within the budget: each token it picks is kept only while a close still fits
    after it."""
    shortest = compile_grammar(constraint, model).shortest
    assert shortest is not None
    steered = 0
    for budget in range(shortest, shortest + 40, 3):
        for seed in range(4):
            text, n = adversarial_run(model, constraint, budget, seed)
            assert len(text) <= budget
            jsonschema.validate(json.loads(text), schema)
            steered += n
    assert steered  # the budget, not the adversary, ended these


def test_a_runaway_tool_call_still_closes_within_the_budget(model: Model) -> None:
    """The same for tool calls (parallel ones allowed): every budget from the shortest call up
    ends in whole calls, each naming the function with arguments its ``parameters`` accept,
    and a next call that would not fit is never begun (the end token is taken instead)."""
    parameters = {"type": "object", "properties": {"city": {"type": "string"},
                                                   "days": {"type": "integer"}},
                  "required": ["city", "days"], "additionalProperties": False}
    tools = Tools([ToolDefinition(function=FunctionDefinition(name="forecast",
                                                              parameters=parameters))],
                  "required")
    constraint = tools.constraint(None)
    shortest = compile_grammar(constraint, model).shortest
    assert shortest == len(render_call("forecast", '{"city":"","days":0}'))
    call = re.escape(render_call("forecast", "@")).replace("@", "(.*?)")
    steered = 0
    for budget in range(shortest, shortest + 40, 3):
        for seed in range(4):
            text, n = adversarial_run(model, constraint, budget, seed)
            assert len(text) <= budget
            calls = text.split(CALL_SEPARATOR + MARKER)
            assert calls, text
            for i, one in enumerate(calls):
                match = re.fullmatch(call, one if i == 0 else MARKER + one, re.DOTALL)
                assert match, text
                jsonschema.validate(json.loads(match.group(1)), parameters)
            steered += n
    assert steered


def test_a_model_with_no_end_token_is_never_steered_to_an_end(dense_model: Path) -> None:
    """The hex-piece test vocabulary (token id -> its hex digits) has no end token, so a close
    that ends where the grammar may end has no token to steer to: after ``1`` of ``1(23)*``
    with one token left, a ``2`` (which only ``3`` closes) is kept, not replaced by
    llguidance's end id (256, past the model's logits, no token at all: committed, it aborted
    the process in llama.cpp's token lookup). A close that is a token is still steered to:
    after ``12`` with one token left, ``32`` becomes ``3``."""
    with Model(ModelSpec(str(dense_model))) as hexes:
        assert [hexes.token_bytes(t) for t in (1, 2, 3, 0x23, 0x32)] == [
            b"1", b"2", b"3", b"23", b"32"]
        regex = Constraint(kind=ConstraintKind.REGEX, grammar="1(23)*")
        slot = bind(compile_grammar(regex, hexes), hexes, SpecCounters(), 2)
        assert not slot.commit(0, [1])
        assert slot.settle([], 2) == 2
        assert slot.settle([], 0x23) == 0x23
        slot = bind(compile_grammar(regex, hexes), hexes, SpecCounters(), 3)
        assert not slot.commit(0, [1, 2])
        assert slot.settle([], 0x32) == 3

# -- in the engine -------------------------------------------------------------------------------
def open_engine(model: Path, method: SpecMethod) -> SpeculativeEngine:
    capacity = EngineCapacity(method=method, draft_max=7)
    return SpeculativeEngine(EngineConfig(str(model), n_ctx=1024, n_threads=1, slots=1,
                                          capacity=capacity, row_budget=False,
                                          per_sequence_kv=True))


def generate(engine: SpeculativeEngine, constraint: Constraint, max_tokens: int,
             method: SpecMethod, sampling: SamplingParams | None = None) -> GenerationResult:
    request = SlotRequest(engine.tokenize("Reply with JSON: "), max_tokens,
                          SpecSettings(method=method), sampling=sampling or SamplingParams(),
                          constraint=constraint, prefix_cache=False)
    return run_schedule(engine, [Arrival(0, request)]).results[0]


DRAFTERS = {"ngram": ("dense", SpecMethod.NGRAM), "mtp": ("hybrid", SpecMethod.MTP)}


@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
def test_outputs_close_within_max_tokens(byte_models: dict[str, Path], drafter: str) -> None:
    """Byte soup under an unbounded schema, at budgets a little over its shortest document:
    greedy and sampled, plain and speculative, every output parses and validates and ends
    ``stop`` at or before ``max_tokens``, counted as a forced close; greedy speculative output
    is still plain's token for token (a draft the close would replace is cut before its
    verify, so no disagreeing draft is ever accepted)."""
    name, method = DRAFTERS[drafter]
    with open_engine(byte_models[name], method) as engine:
        for max_tokens in (SHORTEST, SHORTEST + 9, SHORTEST + 23):
            plain = generate(engine, json_schema(UNBOUNDED), max_tokens, SpecMethod.NONE)
            spec = generate(engine, json_schema(UNBOUNDED), max_tokens, method)
            assert spec.tokens == plain.tokens
            for seed in (1, 2):
                sampled = SamplingParams(temperature=0.9, seed=seed)
                for result in (plain, spec,
                               generate(engine, json_schema(UNBOUNDED), max_tokens,
                                        SpecMethod.NONE, sampled),
                               generate(engine, json_schema(UNBOUNDED), max_tokens, method,
                                        sampled)):
                    assert len(result.tokens) <= max_tokens
                    assert result.finish_reason is FinishReason.STOP, result.text
                    jsonschema.validate(json.loads(result.text), UNBOUNDED)
                    assert result.telemetry.grammar_forced_closes == 1


def test_a_budget_under_the_shortest_document_is_cut_and_said(
        byte_models: dict[str, Path], model: Model) -> None:
    """Where even the shortest document does not fit, nothing is steered: the output is cut
    (``length``) and the compiled grammar's note says why, for the job's final event."""
    with open_engine(byte_models["dense"], SpecMethod.NGRAM) as engine:
        result = generate(engine, json_schema(UNBOUNDED), SHORTEST - 1, SpecMethod.NGRAM)
    assert result.finish_reason is FinishReason.LENGTH
    assert result.telemetry.grammar_forced_closes == 0
    with pytest.raises(ValueError):
        json.loads(result.text)
    note = compile_grammar(json_schema(UNBOUNDED), model).budget_note(SHORTEST - 1)
    assert note is not None and "may not parse" in note


def first_and_last(engine: SpeculativeEngine, method: SpecMethod, seed0: int,
                   draws: int) -> tuple[Counter[str], set[str]]:
    """``draws`` sampled outputs of ``[a-l]*Z`` in two tokens: the first characters' counts and
    every last character."""
    grammar = Constraint(kind=ConstraintKind.REGEX, grammar="[a-l]*Z")
    firsts: Counter[str] = Counter()
    lasts: set[str] = set()
    for i in range(draws):
        result = generate(engine, grammar, 2, method,
                          SamplingParams(temperature=1.0, seed=seed0 + i))
        firsts[result.text[:1]] += 1
        lasts.add(result.text[-1:])
    return firsts, lasts


def test_sampling_keeps_its_distribution_up_to_the_close(byte_models: dict[str, Path]) -> None:
    """Two tokens for ``[a-l]*Z``: the first is the model's (any of a-l leaves room for the
    ``Z``), the second must be the ``Z`` (the close replaces whatever letter was drawn). MTP
    drafts the second letter from the masked head, the guide cuts it (the close would replace
    it) and the verify's own draw is settled to ``Z``: every output ends ``Z``, and the first
    character's distribution is plain sampling's (chi-square homogeneity)."""
    with open_engine(byte_models["soft"], SpecMethod.MTP) as engine:
        plain, plain_last = first_and_last(engine, SpecMethod.NONE, 0, 400)
        spec, spec_last = first_and_last(engine, SpecMethod.MTP, 10_000, 400)
    assert plain_last == spec_last == {"Z"}
    assert len(plain) >= 6, plain
    assert _homogeneity(plain, spec) > 1e-3, (plain, spec)

