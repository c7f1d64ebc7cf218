"""Structured outputs and tool calls without a fleet: what ``response_format``, ``tools`` and
``specfleet.grammar`` become (the constraint, checked with llguidance over a byte vocabulary:
what it lets a model write and what it does not), refusals that name their field, history
with tool turns, and the text of calls read back into ``tool_calls``, streamed chunks
reassembled by the ``openai`` package's own stream state to the non-streamed answer."""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path
from typing import Any

import pytest
from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from coordinator.openai_api.fields import RequestError
from coordinator.openai_api.replies import ChoiceStream, completion_id, response_body
from coordinator.openai_api.requests import CHAT, COMPLETIONS, Parsed, parse_body
from coordinator.openai_api.responses import parse_responses, response_object
from coordinator.openai_api.structured import closed
from coordinator.openai_api.tool_calls import CallReader
from coordinator.validation import SubmitError, parse_request
from shared.constraint import Constraint
from shared.protocol import FinalEvent, FinishReason, GenerationRequest, JobStatus
from shared.tool_calls import CALL_CLOSE, render_call, render_calls

from helpers import SPECFLEET  # isort: skip

CHAT_BODY: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"],
    "additionalProperties": False}}}
PARIS = '{"city":"Paris","unit":"c"}'
#: Says nothing of other keys: closed to the ones it lists.
WEATHER_OPEN = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


class _Bytes:
    """A vocabulary of the 256 bytes and an end token: llguidance's mask over it is exactly
    the set of next bytes the grammar allows."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


BYTES = LLTokenizer(TokenizerWrapper(_Bytes()))


def writes(constraint: dict[str, Any], text: str) -> bool:
    """Whether a model under ``constraint`` can write exactly ``text`` and stop there."""
    matcher = LLMatcher(BYTES, Constraint.model_validate(constraint).llguidance_grammar(),
                        log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()


def chat(**extra: Any) -> dict[str, Any]:
    [choice] = parse_body(CHAT, {**CHAT_BODY, **extra}).choices
    GenerationRequest.model_validate(choice.request)  # every job is one of ours
    return choice.request


def refused(endpoint: str, body: dict[str, Any]) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse_body(endpoint, body)
    return info.value


# -- response_format and specfleet.grammar ----------------------------------------------------
def test_response_formats_become_constraints() -> None:
    assert "constraint" not in chat(response_format={"type": "text"})
    assert chat(response_format={"type": "json_object"})["constraint"] == {
        "kind": "json_object"}
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    for strict in (True, False, None):  # always enforced: strict false asks for no less
        request = chat(response_format={"type": "json_schema", "json_schema": {
            "name": "n", "schema": schema, "strict": strict}})
        closed = {**schema, "additionalProperties": False}  # as llama-server reads it
        assert request["constraint"] == {"kind": "json_schema", "json_schema": closed}
        assert not writes(request["constraint"], '{"n":42,"m":1}')
        assert writes(request["constraint"], '{"n":42}')
        assert not writes(request["constraint"], '{"n":"x"}')
    [completion] = parse_body(COMPLETIONS, {"model": "m", "prompt": "p", "response_format": {
        "type": "json_object"}}).choices
    assert completion.request["constraint"] == {"kind": "json_object"}


def test_objects_that_list_their_properties_are_closed_to_them() -> None:
    """As llama-server and xgrammar read them; JSON Schema would let a model add keys."""
    item = {"properties": {"sku": {"type": "string"}}}
    schema = {"type": "object", "properties": {
        "properties": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "items": {"type": "array", "items": item},
        "open": {"type": "object", "properties": {}, "additionalProperties": True},
        "tags": {"type": "object"}},
        "$defs": {"d": item}, "allOf": [item]}
    got = closed(schema)
    assert "additionalProperties" not in got  # its allOf may add keys
    assert closed({"properties": {}})["additionalProperties"] is False
    props = got["properties"]
    assert props["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in props  # a property named "properties" stays one
    assert props["items"]["items"]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True  # said: kept
    assert "additionalProperties" not in props["tags"]  # lists nothing: any object
    assert got["$defs"]["d"]["additionalProperties"] is False
    assert got["allOf"] == [item]  # each branch lists only part of the keys
    assert schema["properties"]["items"]["items"] is item and "additionalProperties" not in item
    for tools in ([WEATHER_OPEN], [{**WEATHER_OPEN, "function": {
            **WEATHER_OPEN["function"], "parameters": {**WEATHER_OPEN["function"][
                "parameters"], "additionalProperties": True}}}]):
        c = chat(tools=tools, tool_choice="required")["constraint"]
        extra = call("get_weather", '{"city":"Paris","extra":1}')
        assert writes(c, extra) == (tools[0] is not WEATHER_OPEN)


@pytest.mark.parametrize(("extra", "param", "why"), [
    ({"response_format": {"type": "sound"}}, "response_format.type", "'sound' is not"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "'json_schema'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}},
     "response_format.json_schema.name", "pattern"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, "response_format", "nonsense"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}}},
     "response_format", "nope"),
    ({"specfleet": {"grammar": "start: ("}}, "specfleet.grammar", "lark constraint"),
    ({"specfleet": {"grammar": "root ::= foo", "grammar_syntax": "gbnf"}},
     "specfleet.grammar", "Rule 'foo' not found"),
    ({"specfleet": {"grammar_syntax": "gbnf"}}, "specfleet.grammar_syntax", "needs"),
    ({"specfleet": {"grammar": 'start: "a"'}, "response_format": {"type": "json_object"}},
     "specfleet.grammar", "send one"),
    ({"specfleet": {"grammar": 'start: "a"'}, "tools": [WEATHER]}, "specfleet.grammar",
     "tools"),
])
def test_a_format_or_grammar_that_cannot_be_served_is_a_400_naming_it(
        extra: dict[str, Any], param: str, why: str) -> None:
    error = refused(CHAT, {**CHAT_BODY, **extra})
    assert error.param == param and why in str(error), (error.param, str(error))


def test_grammars_in_the_extension_in_each_syntax() -> None:
    for grammar, syntax, yes, no in (('start: "yes" | "no"', None, "no", "maybe"),
                                     ('root ::= "a" [0-9]+', "gbnf", "a12", "a"),
                                     ("[a-c]{2}", "regex", "ab", "abc")):
        request = chat(specfleet={"grammar": grammar, "grammar_syntax": syntax})
        assert request["constraint"] == {"kind": syntax or "lark", "grammar": grammar}
        assert writes(request["constraint"], yes) and not writes(request["constraint"], no)


def test_the_responses_api_takes_text_format() -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    body = {"model": "m", "input": "hi", "text": {"format": {
        "type": "json_schema", "name": "answer", "schema": schema, "strict": True}}}
    parsed, request = parse_responses(body, {})
    assert parsed.choices[0].request["constraint"] == {"kind": "json_schema",
                                                       "json_schema": closed(schema)}
    echoed = response_object("j", parsed, request, 0, None)["text"]
    assert echoed == {"format": {"type": "json_schema", "name": "answer", "schema": schema,
                                 "strict": True}}
    with pytest.raises(RequestError) as info:
        parse_responses({**body, "text": {"format": {"type": "json_schema", "name": "x",
                                                     "schema": {"type": "bogus"}}}}, {})
    assert info.value.param == "text.format" and "bogus" in str(info.value)
    with pytest.raises(RequestError) as info:
        parse_responses({**body, "response_format": {"type": "json_object"}}, {})
    assert info.value.param == "response_format" and "text.format" in str(info.value)


def test_a_constraint_that_does_not_compile_is_refused_at_submit() -> None:
    """Our own request shape (CLI, native batch lines) is checked where every path queues."""
    for constraint, why in (({"kind": "json_schema", "json_schema": {"type": "bogus"}}, "bogus"),
                            ({"kind": "lark", "grammar": "start: ("}, "lark")):
        with pytest.raises(SubmitError) as info:
            parse_request({"prompt": "x", "constraint": constraint})
        assert info.value.param == "constraint" and why in str(info.value)
    assert parse_request({"prompt": "x", "constraint": {"kind": "regex", "grammar": "a+"}})


def test_submit_reads_a_schema_or_grammar_file_and_names_the_option_at_fault(
        tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "bogus"}')
    broken = tmp_path / "broken.lark"
    broken.write_text("root ::= foo")
    runs = [subprocess.Popen([SPECFLEET, "submit", "--model", "m", "--prompt", "x",
                              "--max-tokens", "4", *args], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
            for args in (["--json-schema", str(bad)], ["--grammar", str(broken)],
                         ["--grammar", str(broken), "--grammar-syntax", "gbnf"],
                         ["--json-schema", str(tmp_path / "missing.json")])]
    outputs = [(run.wait(60), run.communicate()[1]) for run in runs]
    for (code, err), why in zip(outputs, ("--json-schema", "--grammar", "--grammar",
                                          "--json-schema"), strict=True):
        assert code == 2 and why in err, err
    assert "bogus" in outputs[0][1] and "lark" in outputs[1][1]
    assert "Rule 'foo' not found" in outputs[2][1] and "missing.json" in outputs[3][1]


# -- tools --------------------------------------------------------------------------------
def call(name: str, arguments: str) -> str:
    return render_call(name, arguments)


def test_required_tools_write_only_valid_calls() -> None:
    c = chat(tools=[WEATHER, TIME], tool_choice="required")["constraint"]
    assert writes(c, call("get_weather", PARIS))
    assert writes(c, render_calls([("get_weather", PARIS), ("get_time", '{"zone":"UTC"}')]))
    assert not writes(c, "It is sunny.")
    assert not writes(c, call("get_weather", '{"city":"Paris","unit":"k"}'))  # enum
    assert not writes(c, call("get_weather", '{"city":"Paris"}'))  # required
    assert not writes(c, call("get_time", PARIS))  # the other function's arguments
    assert not writes(c, call("get_weathe", PARIS))
    single = chat(tools=[WEATHER, TIME], tool_choice="required",
                  parallel_tool_calls=False)["constraint"]
    assert writes(single, call("get_time", '{"zone":"UTC"}'))
    assert not writes(single, render_calls([("get_time", '{"zone":"UTC"}')] * 2))


def test_a_named_tool_choice_writes_one_call_of_that_function() -> None:
    c = chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {
        "name": "get_time"}})["constraint"]
    assert writes(c, call("get_time", '{"zone":"UTC"}'))
    assert not writes(c, call("get_weather", PARIS))
    assert not writes(c, render_calls([("get_time", '{"zone":"UTC"}')] * 2))


def test_auto_writes_a_message_or_calls_never_both() -> None:
    c = chat(tools=[WEATHER])["constraint"]
    for text in ("Sunny.", "", "<b>bold</b>", "x <tool_call> y", call("get_weather", PARIS)):
        assert writes(c, text), text
    assert not writes(c, "<tool_call>\nSunny.")
    assert not writes(c, call("get_weather", '{"city":1,"unit":"c"}'))
    # with a response_format, the message is its JSON
    formatted = chat(tools=[WEATHER], response_format={"type": "json_schema", "json_schema": {
        "name": "a", "schema": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                                "required": ["ok"]}}})["constraint"]
    assert writes(formatted, '{"ok":true}') and writes(formatted, call("get_weather", PARIS))
    assert not writes(formatted, "Sunny.")


def test_tool_choice_none_offers_the_tools_unconstrained() -> None:
    request = chat(tools=[WEATHER], tool_choice="none")
    assert "constraint" not in request and request["tools"] == [WEATHER]
    assert not parse_body(CHAT, {**CHAT_BODY, "tools": [WEATHER],
                                 "tool_choice": "none"}).choices[0].tool_calls
    assert parse_body(CHAT, {**CHAT_BODY, "tools": [WEATHER]}).choices[0].tool_calls


@pytest.mark.parametrize(("extra", "param", "why"), [
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice", "no tool named 'x'"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "'sometimes' is not"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "more than once"),
    ({"tools": [TIME, {"type": "function", "function": {"name": "f", "parameters": {
        "type": "bogus"}}}]}, "tools.1.function.parameters", "bogus"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]},
     "tools.0.function.name", "pattern"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools.0.type", "function"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
])
def test_tools_that_cannot_be_served_are_a_400_naming_the_field(
        extra: dict[str, Any], param: str, why: str) -> None:
    error = refused(CHAT, {**CHAT_BODY, **extra})
    assert error.param == param and why in str(error), (error.param, str(error))


def test_a_history_of_calls_and_results_reaches_our_request() -> None:
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": PARIS}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text",
                                                                "text": "18 C"}]}]
    request = GenerationRequest.model_validate(chat(messages=history, tools=[WEATHER]))
    assert request.messages is not None
    assistant, tool = request.messages[1], request.messages[2]
    assert assistant.content is None and assistant.tool_calls is not None
    assert assistant.text() == call("get_weather", PARIS)  # what the model wrote
    assert tool.role == "tool" and tool.tool_call_id == "call_1" and tool.content == "18 C"
    for turn, param in (({"role": "tool", "content": "x"}, "messages"),
                        ({"role": "user", "content": None}, "messages"),
                        ({"role": "assistant", "content": "x", "refusal": "no"},
                         "messages.0.refusal")):
        with pytest.raises((RequestError, SubmitError)) as info:
            parse_request(parse_body(CHAT, {**CHAT_BODY, "messages": [turn]})
                          .choices[0].request)
        assert param in (getattr(info.value, "param", None) or str(info.value))


def test_a_call_cut_by_its_budget_comes_back_as_history() -> None:
    """Agent loops (the Node SDK, the Agents SDK) send a call the budget cut back in the next
    turn's history; OpenAI takes any string as its arguments, and so do we: the turn is the
    text the model wrote."""
    cut = '{"city":"Par'
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": cut}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "no such city"}]
    request = parse_request(parse_body(CHAT, {**CHAT_BODY, "messages": history,
                                              "tools": [WEATHER]}).choices[0].request)
    assert request.messages is not None
    assert request.messages[1].text() == call("get_weather", cut)


# -- the text of calls read back ---------------------------------------------------------------
def _final(text: str, reason: FinishReason = FinishReason.EOS) -> FinalEvent:
    return FinalEvent(job_id="j1", attempt=1, seq=9, ts=1.0, status=JobStatus.FINISHED,
                      finish_reason=reason, text=text, tokens=[1] * 5)


def _streamed(parsed: Parsed, text: str, final: FinalEvent, cuts: list[int]) -> ChatCompletion:
    """``text`` streamed in pieces cut at ``cuts``, reassembled by the openai package."""
    stream = ChoiceStream(parsed, 0, completion_id(CHAT, "j1"), 1, "j1")
    bodies = [stream.opening()]
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    shown = 0
    for piece in pieces:
        shown += len(piece)
        bodies.append(stream.text(piece, None, 0, shown))
    bodies.append(stream.closing(final))
    state = ChatCompletionStreamState()
    for body in bodies:
        if body is not None:
            state.handle_chunk(ChatCompletionChunk.model_validate(body))
    # the package's own reassembly (get_final_completion refuses a length finish)
    return ChatCompletion.model_validate(state.current_completion_snapshot.model_dump())


def _calls(calls: Any) -> list[tuple[str, str, str, str]]:
    return [(c.id, c.type, c.function.name, c.function.arguments) for c in calls or []]


@pytest.mark.parametrize("text", [
    call("get_weather", PARIS),
    render_calls([("get_weather", PARIS), ("get_time", '{"zone":"Europe/Paris"}'),
                  ("get_weather", '{"city":"}}\\n</tool_call>","unit":"f"}')]),
    "Sunny in Paris.",
    "<tool",  # a message that is a prefix of the marker
    "",
])
def test_calls_streamed_in_any_pieces_reassemble_to_the_whole_answer(text: str) -> None:
    parsed = parse_body(CHAT, {**CHAT_BODY, "tools": [WEATHER, TIME]})
    final = _final(text)
    whole = ChatCompletion.model_validate(response_body(parsed, [final]))
    message = whole.choices[0].message
    rng = random.Random(len(text))
    for _ in range(12):
        pieces = max(0, min(len(text) - 1, rng.randint(0, 9)))
        cuts = sorted(rng.sample(range(1, len(text)), pieces))
        streamed = _streamed(parsed, text, final, cuts)
        got = streamed.choices[0].message
        assert _calls(got.tool_calls) == _calls(message.tool_calls)
        assert (got.content or None) == (message.content or None)
        assert streamed.choices[0].finish_reason == whole.choices[0].finish_reason
    if text.startswith("<tool_call>\n"):
        assert whole.choices[0].finish_reason == "tool_calls" and message.content is None
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
        assert render_calls(calls) == text  # every character is one call's
        assert [c.id for c in message.tool_calls or []] == [
            f"call_j1_{i}" for i in range(len(calls))]
        assert all(json.loads(arguments) for _, arguments in calls)
    else:
        assert whole.choices[0].finish_reason == "stop" and message.content == text
        assert message.tool_calls is None


def test_a_call_cut_short_by_the_budget_is_a_length_finish() -> None:
    parsed = parse_body(CHAT, {**CHAT_BODY, "tools": [WEATHER]})
    cut = call("get_weather", PARIS)[:-20]
    whole = response_body(parsed, [_final(cut, FinishReason.LENGTH)])["choices"][0]
    assert whole["finish_reason"] == "length"
    assert whole["message"]["tool_calls"][0]["function"]["arguments"] == cut.split(
        '"arguments": ')[1]


@pytest.mark.parametrize("arguments", [PARIS, '{"city":""}', "{}"])
def test_a_call_cut_inside_its_closing_keeps_exactly_its_arguments(arguments: str) -> None:
    """The budget can end the text anywhere in a call's closing ``}\\n</tool_call>`` (or in
    the next call's opening): the arguments are what the model wrote, never with the
    closing's first characters appended, whole and streamed alike."""
    parsed = parse_body(CHAT, {**CHAT_BODY, "tools": [WEATHER, TIME]})
    text = render_calls([("get_weather", arguments), ("get_time", '{"zone":"UTC"}')])
    end = len(call("get_weather", arguments)) - len(CALL_CLOSE)
    for cut in range(end, end + len(CALL_CLOSE) + 15):
        final = _final(text[:cut], FinishReason.LENGTH)
        whole = ChatCompletion.model_validate(response_body(parsed, [final]))
        first = (whole.choices[0].message.tool_calls or [])[0]
        assert first.function.arguments == arguments, (cut, text[end:cut])
        streamed = _streamed(parsed, text[:cut], final, list(range(1, cut)))
        assert _calls(streamed.choices[0].message.tool_calls) == _calls(
            whole.choices[0].message.tool_calls)


def test_text_that_leaves_the_layout_is_kept_as_message_text() -> None:
    """What the constraint rules out is still never dropped."""
    reader = CallReader("j")
    text = call("f", "{}") + "\nnot a call"
    reader.feed(text)
    reader.finish()
    assert [c.name for c in reader.calls] == ["f"] and reader.content == "\nnot a call"


def test_a_resumed_tool_call_stream_sends_exactly_the_rest() -> None:
    """Resuming after the event with id ``shown`` reads the job from its first character (the
    reader needs the calls already sent) and sends only the chunks after that event."""
    parsed = parse_body(CHAT, {**CHAT_BODY, "tools": [WEATHER, TIME]})
    text = render_calls([("get_weather", PARIS), ("get_time", '{"zone":"UTC"}')])
    pieces = [text[i:i + 7] for i in range(0, len(text), 7)]

    def events(shown: int) -> list[tuple[int, Any]]:
        """(SSE id, chunk) of a stream resumed after ``shown`` (0: the whole stream)."""
        stream = ChoiceStream(parsed, 0, completion_id(CHAT, "j1"), 1, "j1", shown)
        assert stream.read_from == 0
        out = [(0, stream.opening())]
        end = 0
        for piece in pieces:
            end += len(piece)
            out.append((end, stream.text(piece, None, 0, end)))
        out.append((end, stream.closing(_final(text))))
        return [(i, body["choices"]) for i, body in out if body is not None]

    whole = events(0)
    for cut in {i for i, _ in whole[1:-1]}:  # the closing chunk is sent whatever was seen
        assert events(cut) == [(i, body) for i, body in whole[:-1] if i > cut] + whole[-1:]


def _chunks(parsed: Parsed, text: str) -> list[dict[str, Any]]:
    """Every chunk of choice 0 streaming ``text`` in two pieces."""
    stream = ChoiceStream(parsed, 0, completion_id(CHAT, "j1"), 1, "j1")
    half = len(text) // 2
    bodies = [stream.opening(), stream.text(text[:half], None, 0, half),
              stream.text(text[half:], None, half, len(text)), stream.closing(_final(text))]
    return [b for b in bodies if b is not None]


def test_stream_chunks_carry_null_usage_and_open_a_call_without_content() -> None:
    """OpenAI's chunk shape: with ``include_usage`` every chunk but the usage one has
    ``usage: null``; a choice read as calls opens with no ``content`` (``""`` made the AI
    SDK open an empty text part before the calls); a message opens with ``""``."""
    stream = {"stream": True, "stream_options": {"include_usage": True}}
    calls = parse_body(CHAT, {**CHAT_BODY, **stream, "tools": [WEATHER]})
    chunks = _chunks(calls, call("get_weather", PARIS))
    assert all("usage" in c and c["usage"] is None for c in chunks)
    opening = chunks[0]["choices"][0]["delta"]
    assert opening == {"role": "assistant"}
    message = _chunks(parse_body(CHAT, {**CHAT_BODY, "stream": True}), "Sunny.")
    assert message[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("usage" not in c for c in message)  # usage not asked for: absent, as OpenAI


def test_include_obfuscation_pads_every_chunk_with_random_characters() -> None:
    obfuscated = parse_body(CHAT, {**CHAT_BODY, "stream": True,
                                   "stream_options": {"include_obfuscation": True}})
    padding = [c["obfuscation"] for c in _chunks(obfuscated, "Sunny in Paris.")]
    assert all(isinstance(p, str) and p for p in padding) and len(set(padding)) > 1
    plain = parse_body(CHAT, {**CHAT_BODY, "stream": True,
                              "stream_options": {"include_obfuscation": False}})
    assert all("obfuscation" not in c for c in _chunks(plain, "Sunny in Paris."))
    parsed, _ = parse_responses({"model": "m", "input": "hi", "stream": True,
                                 "stream_options": {"include_obfuscation": True}}, {})
    assert parsed.obfuscate
