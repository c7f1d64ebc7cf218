"""Structured outputs and tool calls end to end, through the real ``openai`` package (and
instructor and langchain on top of it) against one gateway and one Gemma 3 270M worker.

Gemma 270M base knows neither JSON Schema nor tools: whatever it writes is valid only because
the constraint masks every token it samples, so each output parsing and validating (greedy
and sampled, nested objects, arrays, enums, bounded numbers, optional fields, ``$defs``), and
every call naming an offered function with arguments its ``parameters`` accept, is the
constraint at work; without it these are prose.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from pydantic import BaseModel, Field

from .conftest import Deployment, deployed, deployment_settings

from service.workers import MODEL_NAME  # isort: skip

pytestmark = pytest.mark.gemma

#: Strings and lists are bounded, so a base model's longest answer still fits the budget.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "email": {"type": "string", "maxLength": 32},  # optional
        "address": {"$ref": "#/$defs/address"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                 "minItems": 1, "maxItems": 3},
        "score": {"type": "integer", "minimum": -5, "maximum": 5},
    },
    "required": ["name", "age", "role", "address", "tags", "score"],
    "additionalProperties": False,
    "$defs": {"address": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20},
                       "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["city", "zip"], "additionalProperties": False}},
}
ORDER = {
    "type": "object",
    "properties": {
        "items": {"type": "array", "maxItems": 2, "items": {
            "type": "object",
            "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                           "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "qty"], "additionalProperties": False}},
        "express": {"type": "boolean"},
        "note": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 16}]},
    },
    "required": ["items", "express", "note"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 16}},
                   "required": ["zone"], "additionalProperties": False}}}
TOOLS: list[Any] = [WEATHER, CLOCK]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
#: Two identical requests decode identically only without the prefix cache (a cached prompt's
#: last token is decoded alone, whose logits differ from the prefill's on quantized CPU kernels).
FRESH = {"specfleet": {"prefix_cache": False}}


@pytest.fixture(scope="module")
def gemma_fleet(gemma_path: Path, tmp_path_factory: pytest.TempPathFactory,
                ) -> Iterator[Deployment]:
    """One Gemma worker (two slots) and one gateway for the module."""
    with deployed(deployment_settings("st"), gemma_path, tmp_path_factory.mktemp("structured"),
                  worker="g1", args=("--ctx", "4096", "--slots", "2"),
                  register_timeout=180) as d:
        yield d


@pytest.fixture(scope="module")
def client(gemma_fleet: Deployment) -> openai.OpenAI:
    return openai.OpenAI(base_url=gemma_fleet.gateway.url + "/v1", api_key="unused",
                         max_retries=0, timeout=300)


def _constrained(reply: Any) -> int:
    return int(reply.specfleet["telemetry"]["constrained_tokens"])


def test_json_mode_always_parses(client: openai.OpenAI) -> None:
    for prompt, temperature, seed in (("Describe a cat.", 0.0, None),
                                      ("List two fruits.", 1.0, 7)):
        reply = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": prompt}], max_tokens=200,
            temperature=temperature, seed=seed, response_format={"type": "json_object"},
            extra_body={"specfleet": {"speculative": {"method": "ngram"}}})
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice
        assert isinstance(json.loads(choice.message.content or ""), dict)
        assert _constrained(reply) == reply.usage.completion_tokens  # type: ignore[union-attr]


@pytest.mark.parametrize("schema", [PERSON, ORDER], ids=["person", "order"])
def test_json_schema_outputs_validate(client: openai.OpenAI, schema: dict[str, Any]) -> None:
    """Greedy and sampled, strict and not, each output validates (jsonschema)."""
    for temperature, seed, strict in ((0.0, None, True), (1.0, 1, False)):
        reply = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "Fill in the record."}],
            max_tokens=300, temperature=temperature, seed=seed, response_format={
                "type": "json_schema",
                "json_schema": {"name": "record", "schema": schema, "strict": strict}})
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content or ""), schema)


#: Nothing bounded: numbers, integers, strings and arrays a base model fills until
#: ``max_tokens`` (issue 50: a ``number`` in [0, 1] ran to the budget as ``1.000…`` and 3 of
#: 10 such outputs did not parse).
UNBOUNDED = {
    "sentiment": {"type": "object", "properties": {
        "sentiment": {"type": "string"}, "score": {"type": "number", "minimum": 0,
                                                   "maximum": 1}},
        "required": ["sentiment", "score"]},
    "measures": {"type": "object", "properties": {
        "name": {"type": "string"}, "count": {"type": "integer"}, "ratio": {"type": "number"},
        "readings": {"type": "array", "items": {"type": "number"}}},
        "required": ["name", "count", "ratio", "readings"]},
    "lists": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string"}},
        "ids": {"type": "array", "items": {"type": "integer"}},
        "nested": {"type": "array", "items": {"type": "array", "items": {"type": "string"}}}},
        "required": ["tags", "ids", "nested"]},
}
#: What each is asked of: a prompt that invites long values.
ASKS = ["Rate the sentiment of 'I love it' with a precise score.",
        "Measure everything about the Eiffel tower, with many readings.",
        "List as many tags and ids as you can."]


def _digit_runs(value: Any) -> list[str]:
    """Every number's text in a JSON document parsed with numbers kept as written."""
    if isinstance(value, dict):
        return [run for v in value.values() for run in _digit_runs(v)]
    if isinstance(value, list):
        return [run for v in value for run in _digit_runs(v)]
    return [value] if isinstance(value, _Number) else []


class _Number(str):
    """A number's text as the document wrote it."""


def test_unbounded_schemas_always_parse_within_max_tokens(client: openai.OpenAI) -> None:
    """Issue 50's done-when: 30 schema-constrained requests over unbounded numbers,
    integers, strings and arrays, greedy and at temperature 0.9, 64 tokens each: every
    output parses and validates (the budget's close finishes what the model would not), no
    number runs past llama.cpp's 16 digits, and the closes were really steered to."""
    runs = [(name, ask, temperature, seed) for name in UNBOUNDED for ask in ASKS
            for temperature, seed in ((0.0, None), (0.9, 1), (0.9, 2), (0.9, 3), (0.9, 4))]
    runs = runs[:30]
    assert len(runs) == 30

    def ask(run: tuple[str, str, float, int | None]) -> tuple[str, Any]:
        name, prompt, temperature, seed = run
        return name, client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": prompt}], max_tokens=64,
            temperature=temperature, seed=seed, response_format={
                "type": "json_schema",
                "json_schema": {"name": name, "schema": UNBOUNDED[name], "strict": True}})

    with ThreadPoolExecutor(max_workers=2) as pool:  # the worker's two slots
        replies = list(pool.map(ask, runs))
    forced = 0
    for name, reply in replies:
        choice = reply.choices[0]
        content = choice.message.content or ""
        assert choice.finish_reason == "stop", (name, content)
        assert reply.usage.completion_tokens <= 64
        jsonschema.validate(json.loads(content), UNBOUNDED[name])
        numbers = _digit_runs(json.loads(content, parse_float=_Number, parse_int=_Number))
        assert all(len(run) <= 16 for n in numbers for run in re.findall(r"[0-9]+", n)), content
        forced += reply.specfleet["telemetry"]["grammar_forced_closes"]
    assert forced > 0


def test_a_budget_under_the_shortest_document_says_so(client: openai.OpenAI) -> None:
    """Three tokens cannot hold ``{"sentiment":"","score":0}``: the output is cut
    (``length``) and the reply's ``specfleet.note`` says why it may not parse."""
    reply = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": ASKS[0]}], max_tokens=3,
        temperature=0, response_format={"type": "json_schema", "json_schema": {
            "name": "sentiment", "schema": UNBOUNDED["sentiment"]}})
    assert reply.choices[0].finish_reason == "length"
    note = reply.specfleet["note"]  # type: ignore[attr-defined]
    assert "max_tokens 3" in note and "may not parse" in note, note


def test_the_openai_parse_helper_returns_the_model(client: openai.OpenAI) -> None:
    """``chat.completions.parse`` sends a strict schema made from a pydantic model."""
    class Step(BaseModel):
        action: Literal["add", "remove"]
        amount: int = Field(ge=1, le=99)

    class Plan(BaseModel):
        title: str = Field(max_length=20)
        steps: list[Step] = Field(max_length=2)

    reply = client.chat.completions.parse(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Plan a budget."}],
        max_tokens=200, temperature=0, response_format=Plan)
    plan = reply.choices[0].message.parsed
    assert isinstance(plan, Plan) and len(plan.steps) <= 2


def _check_call(call: Any, names: set[str]) -> dict[str, Any]:
    assert call.type == "function" and call.id and call.function.name in names, call
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, PARAMETERS[call.function.name])
    return dict(arguments)


@pytest.mark.parametrize("tool_choice", ["required", "named", "auto"])
def test_tools_produce_valid_calls(client: openai.OpenAI, tool_choice: str) -> None:
    choice: Any = {"type": "function", "function": {"name": "get_time"}} \
        if tool_choice == "named" else tool_choice
    names = {"get_time"} if tool_choice == "named" else set(PARAMETERS)
    # auto's message is free text: sampled, it runs to the budget (greedy is enough there)
    runs = ((0.0, None),) if tool_choice == "auto" else ((0.0, None), (1.0, 3))
    for temperature, seed in runs:
        reply = client.chat.completions.create(
            model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice=choice,  # type: ignore[arg-type]
            parallel_tool_calls=False, max_tokens=120, temperature=temperature, seed=seed)
        message, finish = reply.choices[0].message, reply.choices[0].finish_reason
        if tool_choice == "auto" and not message.tool_calls:  # a message instead
            assert finish in ("stop", "length") and message.content is not None
            assert not message.content.startswith("<tool_call>")
            continue
        assert finish == "tool_calls" and message.content is None, reply
        assert message.tool_calls is not None and len(message.tool_calls) == 1
        _check_call(message.tool_calls[0], names)


def test_parallel_calls_are_each_valid(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="required",
        max_tokens=160, temperature=1.0, seed=5)
    message = reply.choices[0].message
    if reply.choices[0].finish_reason == "tool_calls":
        assert message.tool_calls
        ids = [c.id for c in message.tool_calls]
        assert len(set(ids)) == len(ids)
        for call in message.tool_calls:
            _check_call(call, set(PARAMETERS))
    else:  # calls until the budget: every complete one still valid
        assert reply.choices[0].finish_reason == "length" and message.tool_calls
        for call in message.tool_calls[:-1]:
            _check_call(call, set(PARAMETERS))


def test_a_two_turn_tool_loop(client: openai.OpenAI) -> None:
    """A call, its result sent back (the SDK's own message object in the history), then an
    answer: the history with ``content: null`` + ``tool_calls`` and a ``tool`` turn runs."""
    first = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=[WEATHER], tool_choice="required",  # type: ignore[arg-type]
        parallel_tool_calls=False, max_tokens=100, temperature=0)
    call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
    _check_call(call, {"get_weather"})
    history: list[Any] = [*ASK, first.choices[0].message,
                          {"role": "tool", "tool_call_id": call.id,
                           "content": json.dumps({"temperature": 18, "sky": "clear"})}]
    second = client.chat.completions.create(
        model=MODEL_NAME, messages=history, tools=[WEATHER], max_tokens=60, temperature=0)
    answer = second.choices[0]
    assert answer.finish_reason in ("stop", "length", "tool_calls")
    if answer.message.tool_calls:
        _check_call(answer.message.tool_calls[0], {"get_weather"})
    else:
        assert answer.message.content
    # the history costs more prompt than the question alone: the turns were rendered
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # type: ignore[union-attr]


def test_streamed_calls_reassemble_to_the_same_call(client: openai.OpenAI) -> None:
    body: dict[str, Any] = dict(model=MODEL_NAME, messages=ASK, tools=TOOLS,
                                tool_choice="required", max_tokens=200, temperature=0,
                                extra_body=FRESH, parallel_tool_calls=False)
    whole = client.chat.completions.create(**body)
    state = ChatCompletionStreamState()
    deltas = []
    for chunk in client.chat.completions.create(**body, stream=True):
        state.handle_chunk(chunk)
        if chunk.choices and chunk.choices[0].delta.tool_calls:
            deltas.extend(chunk.choices[0].delta.tool_calls)
    streamed = state.get_final_completion().choices[0]
    assert streamed.finish_reason == whole.choices[0].finish_reason == "tool_calls"
    [got] = streamed.message.tool_calls or []
    [want] = whole.choices[0].message.tool_calls or []
    # the same call (each job names its own ids)
    assert (got.function.name, got.function.arguments) == (want.function.name,
                                                           want.function.arguments)
    assert got.id.startswith("call_") and got.id != want.id
    # OpenAI's shape: the first delta names the call, the later ones carry arguments only
    assert deltas[0].id and deltas[0].function.name and deltas[0].type == "function"
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in deltas[1:])
    assert len(deltas) > 1 and "".join(d.function.arguments or "" for d in deltas) == \
        want.function.arguments


def test_a_schema_that_cannot_compile_is_a_400_naming_it(client: openai.OpenAI) -> None:
    for extra, param, why in (
            ({"response_format": {"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": "object", "properties": {
                    "a": {"$ref": "#/$defs/missing"}}}}}}, "response_format", "missing"),
            ({"response_format": {"type": "sound"}}, "response_format.type", "'sound'"),
            ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
                "type": "integer", "minimum": 5, "maximum": 1}}}]},
             "tools.0.function.parameters", "json_schema"),
            ({"extra_body": {"specfleet": {"grammar": "start: foo"}}}, "specfleet.grammar",
             "foo")):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=8,
                                           **extra)
        error = info.value.body
        assert isinstance(error, dict) and error["param"] == param, error
        assert why in error["message"], error


def test_a_grammar_in_the_extension(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Pick one."}], max_tokens=16,
        temperature=1.0, seed=11, extra_body={"specfleet": {
            "grammar": 'root ::= ("yes" | "no") " " [0-9]', "grammar_syntax": "gbnf"}})
    text = reply.choices[0].message.content or ""
    assert text.split(" ")[0] in ("yes", "no") and text[-1].isdigit() and len(text) in (4, 5)


def test_instructor_in_tools_and_json_schema_modes(client: openai.OpenAI) -> None:
    import instructor

    class City(BaseModel):
        name: str = Field(max_length=24)
        country: str = Field(max_length=24)
        population: int = Field(ge=0, le=40_000_000)

    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        patched = instructor.from_openai(client, mode=mode)
        city = patched.chat.completions.create(
            model=MODEL_NAME, response_model=City, max_retries=0, max_tokens=120,
            temperature=0, messages=[{"role": "user", "content": "Tell me about Lyon."}])
        assert isinstance(city, City), mode


def test_langchain_structured_output_and_bound_tools(gemma_fleet: Deployment) -> None:
    from langchain_openai import ChatOpenAI

    class Answer(BaseModel):
        """An answer and how sure it is."""

        answer: str = Field(max_length=30)
        confidence: int = Field(ge=0, le=10)

    chat = ChatOpenAI(model=MODEL_NAME, base_url=gemma_fleet.gateway.url + "/v1",
                      api_key="unused", temperature=0, max_tokens=120,  # type: ignore[arg-type]
                      max_retries=0, timeout=300)  # type: ignore[call-arg]
    for method in ("json_schema", "function_calling"):
        answer = chat.with_structured_output(Answer, method=method).invoke(  # type: ignore[arg-type]
            "Is Redis fast?")
        assert isinstance(answer, Answer), method
    reply = chat.bind_tools([WEATHER], tool_choice="get_weather").invoke("Weather in Oslo?")
    [call] = reply.tool_calls  # type: ignore[attr-defined]
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], PARAMETERS["get_weather"])


def test_batch_lines_carry_formats_and_tools(client: openai.OpenAI) -> None:
    lines = [{"custom_id": "call", "body": {
                 "model": MODEL_NAME, "messages": ASK, "tools": TOOLS, "max_tokens": 80,
                 "tool_choice": "required", "parallel_tool_calls": False, "temperature": 0}},
             {"custom_id": "json", "body": {
                 "model": MODEL_NAME, "messages": [{"role": "user", "content": "An order."}],
                 "max_tokens": 120, "temperature": 0, "response_format": {
                     "type": "json_schema", "json_schema": {"name": "o", "schema": ORDER}}}}]
    upload = client.files.create(file=("in.jsonl", "\n".join(json.dumps(line)
                                                             for line in lines).encode()),
                                 purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    deadline = time.monotonic() + 240
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.5)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed" and batch.output_file_id, batch
    out = {line["custom_id"]: line["response"]["body"] for line in map(
        json.loads, client.files.content(batch.output_file_id).text.splitlines())}
    called = out["call"]["choices"][0]
    assert called["finish_reason"] == "tool_calls" and called["message"]["content"] is None
    [call] = called["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] in PARAMETERS
    jsonschema.validate(json.loads(call["function"]["arguments"]),
                        PARAMETERS[call["function"]["name"]])
    jsonschema.validate(json.loads(out["json"]["choices"][0]["message"]["content"]), ORDER)
