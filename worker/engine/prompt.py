"""A request's prompt as the token ids the engine decodes: text, token ids or chat messages.

The worker owns the tokenizer, so chat messages travel on the wire and are rendered here with
a chat template every model has (:func:`choose_template`): a named template given at worker
start, else the GGUF's ``tokenizer.chat_template``, else the named template of the model's
family, recognised by its architecture or by its vocabulary's turn markers (what llama.cpp's
``llm_chat_detect_template`` recognises in a template's text), else ChatML. User text must
never forge a turn: the template is rendered with a random placeholder in place of every
message's content, the template's own text between the placeholders is tokenized *with*
special-token parsing (its turn markers become their control tokens) and each content is
tokenized *without* it, so ``<start_of_turn>`` typed by a user is plain text. A plain text
``prompt`` parses special tokens only when it asks to (``parse_special``).

Tools (``request.tools``), the calls an assistant turn made and ``tool`` turns are rendered
the template's own way when it speaks tools (:func:`speaks_tools`: it writes a probe tool
and a probe call), else in the generic format (:func:`generic_tool_turns`): the tools and how
to call them in a system turn, calls in :mod:`shared.tool_calls`' layout, results in a user
turn between ``<tool_response>`` tags, all of it as message content (no specials parsed). What
a template writes itself from the tools and calls is text of the template, so a request whose
tools or calls hold special-token text is refused rather than let it forge a turn.
"""

from __future__ import annotations

import ctypes
import json
import re
import secrets
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import llama_cpp
from jinja2 import Template, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from shared.protocol import ChatMessage, GenerationRequest, ToolDefinition
from shared.tool_calls import render_call
from worker.llm.model import Model

#: Templates a worker can be started with by name (``SPECFLEET_CHAT_TEMPLATE``) when its GGUF
#: carries none or the wrong one.
NAMED_TEMPLATES: dict[str, str] = {
    "chatml": (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    "gemma": (
        "{{ bos_token }}{% for m in messages %}<start_of_turn>"
        "{{ 'model' if m['role'] == 'assistant' else 'user' }}\n"
        "{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
        "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
    ),
    "llama3": (
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
        "<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
        "{% endif %}"
    ),
}


#: The turn markers of each named template: a vocabulary with them as single tokens speaks it.
MARKERS: dict[str, tuple[str, ...]] = {
    "gemma": ("<start_of_turn>", "<end_of_turn>"),
    "llama3": ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    "chatml": ("<|im_start|>", "<|im_end|>"),
}
#: GGUF architectures (``general.architecture``) and the named template of their family.
ARCHITECTURES: dict[str, str] = {
    "gemma": "gemma", "gemma2": "gemma", "gemma3": "gemma", "gemma3n": "gemma",
    "llama": "llama3", "qwen2": "chatml", "qwen2moe": "chatml", "qwen3": "chatml",
    "qwen3moe": "chatml", "qwen3next": "chatml",
}
#: The template of a model nothing else chooses one for (llama-server's default too).
DEFAULT_TEMPLATE = "chatml"


class PromptError(ValueError):
    """The request's prompt cannot be built on this worker (a template error)."""


@dataclass(frozen=True)
class ChatTemplate:
    """The template a worker renders chats with, and where it came from (``gguf``,
    ``named:NAME``, ``architecture:NAME``, ``markers:NAME`` or ``default:NAME``), published in
    its registration so ``/v1/models`` and ``specfleet fleet`` show the choice."""

    text: str
    source: str


def choose_template(model: Model, named: str | None = None) -> ChatTemplate:
    """The named template (``SPECFLEET_CHAT_TEMPLATE``), else the GGUF's own, else the one of
    the model's family: by architecture when its markers are tokens of the vocabulary, else
    by the markers the vocabulary has, else :data:`DEFAULT_TEMPLATE`."""
    if named is not None:
        if named not in NAMED_TEMPLATES:
            known = ", ".join(sorted(NAMED_TEMPLATES))
            raise PromptError(f"unknown chat template {named!r} (known: {known})")
        return ChatTemplate(NAMED_TEMPLATES[named], f"named:{named}")
    raw = llama_cpp.llama_model_chat_template(model.ptr, None)
    if raw:
        return ChatTemplate(raw.decode("utf-8", errors="replace"), "gguf")
    family = ARCHITECTURES.get(_architecture(model))
    if family is not None and _speaks(model, family):
        return ChatTemplate(NAMED_TEMPLATES[family], f"architecture:{family}")
    for name in MARKERS:
        if _speaks(model, name):
            return ChatTemplate(NAMED_TEMPLATES[name], f"markers:{name}")
    return ChatTemplate(NAMED_TEMPLATES[DEFAULT_TEMPLATE], f"default:{DEFAULT_TEMPLATE}")


def _architecture(model: Model) -> str:
    buf = ctypes.create_string_buffer(128)
    n = llama_cpp.llama_model_meta_val_str(model.ptr, b"general.architecture", buf, len(buf))
    return buf.value.decode("utf-8", errors="replace") if n > 0 else ""


def _speaks(model: Model, name: str) -> bool:
    """Whether every turn marker of template ``name`` is one token of ``model``'s vocabulary."""
    return all(len(model.tokenize(m, add_special=False, parse_special=True)) == 1
               for m in MARKERS[name])


def build_prompt(model: Model, request: GenerationRequest,
                 named_template: str | None = None) -> list[int]:
    """The prompt token ids of ``request`` on ``model`` (``PromptError`` when impossible)."""
    if request.prompt_tokens is not None:
        return list(request.prompt_tokens)
    if request.messages is not None:
        template = choose_template(model, named_template)
        return render_chat(model, template.text, request.messages, request.tools)
    return model.tokenize(request.prompt or "", parse_special=request.parse_special)


def render_chat(model: Model, template: str, messages: list[ChatMessage],
                tools: list[ToolDefinition] | None = None) -> list[int]:
    """Render ``messages`` (and ``tools``) with ``template``; only the template's own text
    parses specials."""
    named = next((i for i, m in enumerate(messages) if m.name is not None), None)
    if named is not None and not reads_names(template):
        raise PromptError(f"messages.{named}.name: this worker's chat template has no place "
                          "for a message's name (put it in the content)")
    native = speaks_tools(template)
    if not native and (tools or _uses_tools(messages)):
        messages, tools = generic_tool_turns(messages, tools), None
    nonce = secrets.token_hex(8)
    placeholders = [_placeholder(m, f"\x00{nonce}:{i}\x00" if m.content is not None else "")
                    for i, m in enumerate(messages)]
    if native:
        _check_plain(model, tools, messages)
    extra = {"tools": [t.model_dump(mode="json", exclude_none=True) for t in tools]} if (
        native and tools) else {}
    try:
        text = _compiled(template).render(
            messages=placeholders, add_generation_prompt=True, **extra,
            bos_token=_token_text(model, llama_cpp.llama_vocab_bos(model.vocab)),
            eos_token=_token_text(model, llama_cpp.llama_vocab_eos(model.vocab)))
    except TemplateError as exc:
        raise PromptError(f"the chat template failed: {exc}") from None
    tokens: list[int] = []
    # re.split with one group alternates: template text, message index, template text, ...
    for i, part in enumerate(re.split(f"\x00{nonce}:(\\d+)\x00", text)):
        if i % 2:
            tokens += model.tokenize(messages[int(part)].content or "", add_special=False)
        elif part:
            tokens += model.tokenize(part, add_special=False, parse_special=True)
    bos = llama_cpp.llama_vocab_bos(model.vocab)
    if (llama_cpp.llama_vocab_get_add_bos(model.vocab) and bos >= 0
            and (not tokens or tokens[0] != bos)):
        tokens.insert(0, bos)
    return tokens


def _placeholder(message: ChatMessage, content: str) -> dict[str, Any]:
    """What the template reads of one turn: its content as a placeholder, and its calls
    (arguments as the object they encode: templates write them with ``tojson``) or the call
    it answers."""
    turn: dict[str, Any] = {"role": message.role, "content": content}
    if message.tool_calls is not None:
        turn["tool_calls"] = [
            {"id": c.id, "type": c.type, "function": {
                "name": c.function.name, "arguments": _decoded(c.function.arguments)}}
            for c in message.tool_calls]
    if message.tool_call_id is not None:
        turn["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        turn["name"] = message.name
    return turn


def _decoded(arguments: str) -> Any:
    """A call's arguments as a template writes them: the value their JSON encodes, or, for
    text that is not JSON (a call its budget cut), the text itself, as llama-server keeps it."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _uses_tools(messages: list[ChatMessage]) -> bool:
    return any(m.role == "tool" or m.tool_calls for m in messages)


#: The probe :func:`speaks_tools` renders: a name no template writes unless given it.
_PROBE = "sf_probe_fn_7c1e"
_PROBE_RESULT = "sf_probe_result_7c1e"


@lru_cache(maxsize=8)
def speaks_tools(template: str) -> bool:
    """Whether ``template`` renders tools, an assistant's calls and a tool's result itself
    (llama.cpp's template capabilities are probed the same way: render, then look)."""
    tool = {"type": "function", "function": {"name": _PROBE, "description": "probe",
                                             "parameters": {"type": "object"}}}
    call = {"id": "call_1", "type": "function", "function": {"name": _PROBE + "_call",
                                                             "arguments": {}}}
    messages = [{"role": "user", "content": "x"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": _PROBE_RESULT, "tool_call_id": "call_1"}]
    try:
        text = _compiled(template).render(messages=messages, tools=[tool],
                                          add_generation_prompt=True, bos_token="",
                                          eos_token="")
    except (TemplateError, PromptError, TypeError, ValueError):
        return False
    return all(probe in text for probe in (_PROBE + "\"", _PROBE + "_call", _PROBE_RESULT))


#: The name :func:`reads_names` renders: no template writes it unless it reads names.
_NAME_PROBE = "sf_probe_name_7c1e"


@lru_cache(maxsize=8)
def reads_names(template: str) -> bool:
    """Whether ``template`` renders a message's ``name`` (probed as :func:`speaks_tools`
    probes tools): a name sent to one that does not would be dropped, so it is refused."""
    messages = [{"role": "user", "content": "x", "name": _NAME_PROBE}]
    try:
        text = _compiled(template).render(messages=messages, add_generation_prompt=True,
                                          bos_token="", eos_token="")
    except (TemplateError, PromptError, TypeError, ValueError):
        return False
    return _NAME_PROBE in text


#: How the generic format tells a model about its tools (a system turn's text).
GENERIC_TOOLS_INTRO = (
    "You can call functions. Each is given below as JSON: its name, what it does and the JSON "
    "Schema of its arguments.")
GENERIC_TOOLS_HOWTO = (
    "To call functions, answer with nothing but one block per call:\n"
    + render_call("FUNCTION_NAME", "{ARGUMENTS}") + "\n"
    "Each result comes back in a user turn between <tool_response> and </tool_response>.")


def generic_tool_turns(messages: list[ChatMessage],
                       tools: list[ToolDefinition] | None) -> list[ChatMessage]:
    """``messages`` with tools, calls and results written as plain turns (docs/http.md,
    "Tool calls"): the tools and how to call them appended to the system turn (one is put
    first if there is none), an assistant's calls in :mod:`shared.tool_calls`' layout after
    its content, and each run of ``tool`` turns one user turn of ``<tool_response>``
    blocks."""
    turns: list[ChatMessage] = []
    for previous, m in zip([None, *messages], messages, strict=False):
        if m.role == "tool":
            block = f"<tool_response>\n{m.content or ''}\n</tool_response>"
            if previous is not None and previous.role == "tool":
                turns[-1] = ChatMessage(role="user", content=f"{turns[-1].content}\n{block}")
            else:
                turns.append(ChatMessage(role="user", content=block))
        elif m.tool_calls:
            turns.append(ChatMessage(role="assistant", content=m.text()))
        else:
            turns.append(m)
    if tools:
        listing = "\n".join(json.dumps(t.function.model_dump(mode="json", exclude_none=True,
                                                              exclude={"strict"}))
                            for t in tools)
        text = f"{GENERIC_TOOLS_INTRO}\n{listing}\n{GENERIC_TOOLS_HOWTO}"
        if turns and turns[0].role == "system":
            turns[0] = ChatMessage(role="system", content=f"{turns[0].content}\n\n{text}")
        else:
            turns.insert(0, ChatMessage(role="system", content=text))
    return turns


def _check_plain(model: Model, tools: list[ToolDefinition] | None,
                 messages: list[ChatMessage]) -> None:
    """A ``PromptError`` if the tools or calls a template writes itself hold text the
    vocabulary reads as special tokens (it would be parsed with the template's text)."""
    written = json.dumps([[t.model_dump(mode="json") for t in tools or []],
                          [[c.model_dump(mode="json") for c in m.tool_calls or []]
                           + [m.tool_call_id] for m in messages]], ensure_ascii=False)
    if (model.tokenize(written, add_special=False, parse_special=True)
            != model.tokenize(written, add_special=False)):
        raise PromptError("tools, tool calls or tool_call_id hold special-token text, which "
                          "this model's chat template would write as its own")


def _raise(message: str) -> None:
    raise TemplateError(message)


@lru_cache(maxsize=8)
def _compiled(template: str) -> Template:
    """Templates are compiled once per worker (they come from the model or the name table)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    try:
        return env.from_string(template)
    except TemplateError as exc:
        raise PromptError(f"the chat template does not compile: {exc}") from None


def _token_text(model: Model, token: int) -> str:
    if token < 0:
        return ""
    raw = llama_cpp.llama_vocab_get_text(model.vocab, token)
    return raw.decode("utf-8", errors="replace") if raw else ""
