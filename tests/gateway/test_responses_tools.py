"""Tools on the Responses API against a live fleet, through the real ``openai`` package and
the OpenAI Agents SDK (whose default model is the Responses API; its chat-completions model
runs the same tool loop here): function calls whole and streamed as typed events,
``tool_choice`` and ``parallel_tool_calls``, a call's output sent back as the next turn, and
a message ``name`` refused by name where the template has no place for it.

The worker runs the tiny dense model with a byte-level vocabulary (text round-trips, so the
grammar of calls can be written) and no template of its own (ChatML: tools travel in the
generic format). Its weights are random: every call naming an offered function with
arguments its ``parameters`` accept is the constraint at work.
"""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any, Literal

import jsonschema
import openai
import pytest
from agents import (
    Agent,
    ModelResponse,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    RunConfig,
    Runner,
    function_tool,
)
from openai.types.responses import ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter

from coordinator.openai_api.fields import RequestError
from coordinator.openai_api.responses import EventSequence, parse_responses, response_object
from shared.protocol import FinalEvent, FinishReason, JobStatus
from shared.tool_calls import render_calls

from .conftest import Deployment, queued

from service.workers import MODEL_NAME  # isort: skip

#: Bounded arguments: a random model under the grammar still closes every call in budget.
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather now",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 8},
               "unit": {"enum": ["celsius", "fahrenheit"]}},
               "required": ["city", "unit"], "additionalProperties": False},
           "strict": True}
CLOCK = {"type": "function", "name": "get_time", "description": "The time in a zone",
         "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                        "required": ["zone"], "additionalProperties": False},
         "strict": True}
TOOLS: list[Any] = [WEATHER, CLOCK]
SCHEMAS = {t["name"]: t["parameters"] for t in TOOLS}
ASK = "What is the weather like in Paris?"
#: Greedy and without the prefix cache: the same request decodes the same tokens.
SAME: dict[str, Any] = {"temperature": 0, "extra_body": {"specfleet": {"prefix_cache": False}}}


@pytest.fixture(scope="module")
def client(byte_fleet: Deployment) -> openai.OpenAI:
    return byte_fleet.client()


def _check_call(item: Any, names: set[str]) -> None:
    """A completed ``function_call`` item of an offered function, its arguments valid."""
    assert item.type == "function_call" and item.status == "completed", item
    assert item.name in names and item.call_id.startswith("call_") and item.id, item
    jsonschema.validate(json.loads(item.arguments), SCHEMAS[item.name])


# -- without a fleet: what a request becomes, and the events of any text ----------------------
@pytest.mark.parametrize(("extra", "param", "why"), [
    ({"tools": [{"type": "web_search"}]}, "tools.0", "'web_search' tools are not served"),
    ({"tools": [{**WEATHER, "name": "a b"}]}, "tools.0.name", "pattern"),
    ({"tools": [{**WEATHER, "parameters": {"type": "bogus"}}]}, "tools.0.parameters", "bogus"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "more than once"),
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "x"}}, "tool_choice",
     "no tool named 'x'"),
    ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}},
     "tool_choice", "'allowed_tools' is not served"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
    ({"input": [{"type": "reasoning", "id": "r", "summary": []}]}, "input.0",
     "'reasoning' items are not served"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]},
     "input.0.arguments", "Field required"),
    ({"input": [{"type": "function_call_output", "call_id": "", "output": "x"}]},
     "input.0.call_id", "at least 1"),
])
def test_what_cannot_be_served_is_a_400_naming_it(extra: dict[str, Any], param: str,
                                                  why: str) -> None:
    with pytest.raises(RequestError) as info:
        parse_responses({"model": "m", "input": ASK, **extra}, {})
    assert info.value.param == param and why in str(info.value), str(info.value)


def _final(text: str, reason: FinishReason = FinishReason.EOS) -> FinalEvent:
    return FinalEvent(job_id="j1", attempt=1, seq=9, ts=1.0, status=JobStatus.FINISHED,
                      finish_reason=reason, text=text, tokens=[1] * 5)


@pytest.mark.parametrize(("text", "reason"), [
    (render_calls([("get_weather", '{"city":"}\\n</tool_call>","unit":"celsius"}'),
                   ("get_time", '{"zone":"UTC"}')]), FinishReason.EOS),
    (render_calls([("get_time", '{"zone":"UTC"}')])[:-5], FinishReason.LENGTH),
    ("Sunny in Paris.", FinishReason.EOS),
    ("<tool", FinishReason.EOS),  # a message that is a prefix of the call marker
    ("", FinishReason.EOS),
])
def test_events_in_any_pieces_stream_the_whole_response(text: str,
                                                        reason: FinishReason) -> None:
    """However the text is cut, the items streamed (added, their deltas, done) are the
    items of the whole response, numbered in order, each event one of OpenAI's types."""
    parsed, request = parse_responses({"model": "m", "input": ASK, "tools": TOOLS}, {})
    final = _final(text, reason)
    whole = response_object("j1", parsed, request, 1, final)
    events_type: Any = TypeAdapter(ResponseStreamEvent)
    rng = random.Random(len(text))
    for _ in range(8):
        cuts = sorted(rng.sample(range(1, len(text)),
                                 max(0, min(len(text) - 1, rng.randint(0, 9)))))
        sequence = EventSequence("j1", parsed, request, 1)
        events = sequence.opening()
        for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
            events += sequence.delta(text[a:b])
        events += sequence.closing(final)
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        for event in events:
            events_type.validate_python(_with_cache_writes(event))
        done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
        assert done == whole["output"] == events[-1]["response"]["output"]
        added = [e["item"]["id"] for e in events if e["type"] == "response.output_item.added"]
        assert added == [item["id"] for item in done]
        for item in done:
            deltas = "".join(e.get("delta", "") for e in events if e.get("item_id") == item["id"]
                             and e["type"].endswith(".delta"))
            assert deltas == (item["arguments"] if item["type"] == "function_call"
                              else item["content"][0]["text"])
    assert events[-1]["type"] == ("response.completed" if reason is FinishReason.EOS
                                  else "response.incomplete")


def _with_cache_writes(event: dict[str, Any]) -> dict[str, Any]:
    """``event`` as the installed package's types read it: they ask for a usage key
    (``input_tokens_details.cache_write_tokens``) this gateway does not send."""
    usage = (event.get("response") or {}).get("usage")
    if not usage:
        return event
    details = {**usage["input_tokens_details"], "cache_write_tokens": 0}
    return {**event, "response": {**event["response"],
                                  "usage": {**usage, "input_tokens_details": details}}}


def test_a_call_whole_and_streamed_is_the_same_call(client: openai.OpenAI) -> None:
    """``tool_choice: required``: the response is one ``function_call`` item; streamed, it
    is the item added, argument deltas that concatenate to the arguments done, the item
    done, then the response completed, numbered in order, and the same call."""
    request: dict[str, Any] = dict(model=MODEL_NAME, input=ASK, tools=TOOLS,
                                   tool_choice="required", parallel_tool_calls=False,
                                   max_output_tokens=120, **SAME)
    whole = client.responses.create(**request)
    assert whole.status == "completed", whole
    [call] = whole.output
    _check_call(call, set(SCHEMAS))
    assert whole.tool_choice == "required" and whole.parallel_tool_calls is False
    assert [t.name for t in whole.tools] == ["get_weather", "get_time"]  # type: ignore[union-attr]

    events = list(client.responses.create(**request, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.function_call_arguments.delta")
    assert deltas >= 1 and kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        *["response.function_call_arguments.delta"] * deltas,
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"], kinds
    added, done, item_done, completed = events[2], events[-3], events[-2], events[-1]
    assert added.item.type == "function_call" and added.item.status == "in_progress"
    assert added.item.arguments == "" and added.item.name == call.name
    streamed = "".join(e.delta for e in events if e.type.endswith("arguments.delta"))
    assert streamed == done.arguments == item_done.item.arguments == call.arguments
    assert done.name == call.name and done.item_id == added.item.id == item_done.item.id
    assert item_done.item.status == "completed"
    assert completed.response.output[0].arguments == call.arguments


@pytest.mark.parametrize("choice", ["named", "none", "auto"])
def test_tool_choice(client: openai.OpenAI, byte_fleet: Deployment, choice: str) -> None:
    """A named function: one call of it; ``none``: the tools are in the prompt and the
    answer is a message; ``auto``: a message or calls, never both."""
    tool_choice: Any = {"type": "function", "name": "get_time"} if choice == "named" \
        else choice
    reply = client.responses.create(model=MODEL_NAME, input=ASK, tools=TOOLS,
                                    tool_choice=tool_choice, max_output_tokens=120, **SAME)
    kinds = {item.type for item in reply.output}
    if choice == "named":
        [call] = reply.output
        _check_call(call, {"get_time"})
        assert reply.tool_choice.name == "get_time"  # type: ignore[union-attr]
    elif choice == "none":
        assert kinds == {"message"} and reply.tool_choice == "none"
        request = queued(byte_fleet, reply.specfleet["job_id"])
        assert "constraint" not in request and [t["function"]["name"] for t in
                                                request["tools"]] == ["get_weather", "get_time"]
    else:
        assert kinds in ({"message"}, {"function_call"}), reply.output
        for item in reply.output[:-1] if reply.status == "incomplete" else reply.output:
            if item.type == "function_call":
                _check_call(item, set(SCHEMAS))


def test_parallel_calls(client: openai.OpenAI) -> None:
    """Sampled with a few seeds: ``parallel_tool_calls`` false makes every answer one call;
    left out, the model may chain calls (some seed does), each its own item with its own
    ids; streamed, a seed's items are its whole response's."""
    def reply(seed: int, **extra: Any) -> Any:
        return client.responses.create(
            model=MODEL_NAME, input=ASK, tools=TOOLS, tool_choice="required",
            max_output_tokens=240, temperature=1.0,
            extra_body={**SAME["extra_body"], "seed": seed}, **extra)

    seeds = range(1, 7)
    assert all(len(reply(seed, parallel_tool_calls=False).output) == 1 for seed in seeds)
    several = {seed: reply(seed) for seed in seeds}
    for answer in several.values():
        assert answer.parallel_tool_calls is True
        for item in answer.output if answer.status == "completed" else answer.output[:-1]:
            _check_call(item, set(SCHEMAS))
        assert len({item.call_id for item in answer.output}) == len(answer.output)
    seed = max(several, key=lambda s: len(several[s].output))
    assert len(several[seed].output) >= 2, [len(r.output) for r in several.values()]
    events = list(reply(seed, stream=True))
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [e.output_index for e in done] == list(range(len(several[seed].output)))
    assert [(e.item.name, e.item.arguments) for e in done] == [
        (i.name, i.arguments) for i in several[seed].output]
    assert [e.item.model_dump() for e in done] == [
        i.model_dump() for i in events[-1].response.output]


def test_a_call_output_is_the_next_turn(client: openai.OpenAI,
                                        byte_fleet: Deployment) -> None:
    """The first response's output items and a ``function_call_output`` sent back as input
    become the assistant's call and a tool turn; the output is in the prompt, token for
    token (one per byte)."""
    first = client.responses.create(model=MODEL_NAME, input=ASK, tools=TOOLS,
                                    tool_choice="required", parallel_tool_calls=False,
                                    max_output_tokens=120, **SAME)
    [call] = first.output
    history: list[Any] = [{"role": "user", "content": ASK},
                          *(item.model_dump(exclude_none=True) for item in first.output)]

    def answer(output: str) -> Any:
        return client.responses.create(
            model=MODEL_NAME, tools=TOOLS, max_output_tokens=8, **SAME,
            input=[*history, {"type": "function_call_output", "call_id": call.call_id,
                              "output": output}])

    short, long = answer("18 C"), answer("18 C, sunny all day")
    assert queued(byte_fleet, short.specfleet["job_id"])["messages"] == [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": call.call_id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "content": "18 C", "tool_call_id": call.call_id}]
    assert short.usage and long.usage
    assert long.usage.input_tokens - short.usage.input_tokens == len(", sunny all day")


def test_a_message_name_is_refused_by_name(client: openai.OpenAI) -> None:
    """This fleet's template (ChatML) has no place for a name: refused at submit, naming it
    and the template."""
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, max_tokens=4, messages=[
            {"role": "user", "content": "hi", "name": "ada"}])
    error = info.value.body
    assert isinstance(error, dict) and error["param"] == "messages.0.name"
    assert "no place for a message's name" in error["message"]
    reply = client.chat.completions.create(model=MODEL_NAME, max_tokens=4, messages=[
        {"role": "user", "content": "hi", "name": None}])  # type: ignore[misc, list-item]
    assert reply.choices[0].message.role == "assistant"


def _job_of(response: ModelResponse) -> str:
    """The gateway job behind one of the Agents SDK's model calls: the chat-completions
    model puts the completion's id in its output items' provider data (its ``response_id``
    is None, or a placeholder when streamed); the Responses model keeps the response's id."""
    data = getattr(response.output[0], "provider_data", None) or {}
    name = str(data.get("response_id") or response.response_id or "")
    return name.removeprefix("chatcmpl-").removeprefix("resp_")


@pytest.mark.parametrize("model_class", [OpenAIResponsesModel, OpenAIChatCompletionsModel])
def test_the_agents_sdk_runs_a_two_turn_tool_loop(
        byte_fleet: Deployment,
        model_class: type[OpenAIResponsesModel | OpenAIChatCompletionsModel]) -> None:
    """The Agents SDK's default (Responses) model and its chat-completions model, each run
    and streamed: the first turn must call the tool (``tool_choice: required``); the SDK
    runs it and sends the call and its output back; the second turn (tool choice reset to
    auto, the output typed) answers with the typed output. The second prompt holds no
    random ids (the generic format renders no call ids), so the greedy model makes the
    same choice every run."""
    ran: list[str] = []

    class Answer(BaseModel):
        weather: Literal["sunny", "rainy"]

    @function_tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """The weather in a city."""
        ran.append(city)
        return f"18 C in {city}"

    async def loop(streamed: bool) -> Any:
        client = openai.AsyncOpenAI(base_url=byte_fleet.gateway.url + "/v1", api_key="x",
                                    max_retries=0, timeout=60)
        agent = Agent(name="weather", instructions="Answer with the weather.",
                      tools=[get_weather], output_type=Answer,
                      model=model_class(model=MODEL_NAME, openai_client=client),
                      model_settings=ModelSettings(
                          tool_choice="required", temperature=0, max_tokens=120,
                          parallel_tool_calls=False, extra_body=SAME["extra_body"]))
        config = RunConfig(tracing_disabled=True)
        try:
            if not streamed:
                return await Runner.run(agent, ASK, max_turns=2, run_config=config)
            run = Runner.run_streamed(agent, ASK, max_turns=2, run_config=config)
            async for _ in run.stream_events():
                pass
            return run
        finally:
            await client.close()

    for streamed in (False, True):
        ran.clear()
        result = asyncio.run(loop(streamed))
        assert [item.type for item in result.new_items] == [
            "tool_call_item", "tool_call_output_item", "message_output_item"]
        assert len(ran) == 1 and result.new_items[1].output == f"18 C in {ran[0]}"
        assert isinstance(result.final_output, Answer)
        first, second = map(_job_of, result.raw_responses)
        assert queued(byte_fleet, first)["messages"][-1] == {"role": "user", "content": ASK}
        turns = queued(byte_fleet, second)["messages"]
        assert [t["role"] for t in turns] == ["system", "user", "assistant", "tool"]
        assert turns[3]["content"] == f"18 C in {ran[0]}"
        assert turns[2]["tool_calls"][0]["id"] == turns[3]["tool_call_id"]
