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
"""

from __future__ import annotations

import ctypes
import re
import secrets
from dataclasses import dataclass
from functools import lru_cache

import llama_cpp
from jinja2 import Template, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from shared.protocol import ChatMessage, GenerationRequest
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
        return render_chat(model, template.text, request.messages)
    return model.tokenize(request.prompt or "", parse_special=request.parse_special)


def render_chat(model: Model, template: str, messages: list[ChatMessage]) -> list[int]:
    """Render ``messages`` with ``template``; only the template's own text parses specials."""
    nonce = secrets.token_hex(8)
    placeholders = [{"role": m.role, "content": f"\x00{nonce}:{i}\x00"}
                    for i, m in enumerate(messages)]
    try:
        text = _compiled(template).render(
            messages=placeholders, add_generation_prompt=True,
            bos_token=_token_text(model, llama_cpp.llama_vocab_bos(model.vocab)),
            eos_token=_token_text(model, llama_cpp.llama_vocab_eos(model.vocab)))
    except TemplateError as exc:
        raise PromptError(f"the chat template failed: {exc}") from None
    tokens: list[int] = []
    # re.split with one group alternates: template text, message index, template text, ...
    for i, part in enumerate(re.split(f"\x00{nonce}:(\\d+)\x00", text)):
        if i % 2:
            tokens += model.tokenize(messages[int(part)].content, add_special=False)
        elif part:
            tokens += model.tokenize(part, add_special=False, parse_special=True)
    bos = llama_cpp.llama_vocab_bos(model.vocab)
    if (llama_cpp.llama_vocab_get_add_bos(model.vocab) and bos >= 0
            and (not tokens or tokens[0] != bos)):
        tokens.insert(0, bos)
    return tokens


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
