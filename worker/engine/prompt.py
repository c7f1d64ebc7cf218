"""A request's prompt as the token ids the engine decodes: text, token ids or chat messages.

The worker owns the tokenizer, so chat messages travel on the wire and are rendered here with
the model's chat template (the GGUF's ``tokenizer.chat_template``, or a named template given
at worker start). User text must never forge a turn: the template is rendered with a random
placeholder in place of every message's content, the template's own text between the
placeholders is tokenized *with* special-token parsing (its turn markers become their control
tokens) and each content is tokenized *without* it, so ``<start_of_turn>`` typed by a user is
plain text. A plain text ``prompt`` parses special tokens only when it asks to
(``parse_special``).
"""

from __future__ import annotations

import re
import secrets
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


class PromptError(ValueError):
    """The request's prompt cannot be built on this worker (no template, a template error)."""


def chat_template(model: Model, named: str | None = None) -> str | None:
    """The template this worker renders chats with: the named one, else the GGUF's own."""
    if named is not None:
        if named not in NAMED_TEMPLATES:
            known = ", ".join(sorted(NAMED_TEMPLATES))
            raise PromptError(f"unknown chat template {named!r} (known: {known})")
        return NAMED_TEMPLATES[named]
    raw = llama_cpp.llama_model_chat_template(model.ptr, None)
    return raw.decode("utf-8", errors="replace") if raw else None


def build_prompt(model: Model, request: GenerationRequest,
                 named_template: str | None = None) -> list[int]:
    """The prompt token ids of ``request`` on ``model`` (``PromptError`` when impossible)."""
    if request.prompt_tokens is not None:
        return list(request.prompt_tokens)
    if request.messages is not None:
        template = chat_template(model, named_template)
        if template is None:
            raise PromptError("this model has no chat template: send 'prompt' or "
                              "'prompt_tokens', or start the worker with a named template")
        return render_chat(model, template, request.messages)
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
