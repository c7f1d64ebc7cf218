"""OpenAI completions and chat completions requests, read into our ``GenerationRequest``\\ s.

Sampling follows OpenAI and vLLM: ``temperature`` (default 1: a request that wants greedy
says 0), ``top_p``, ``seed``, ``presence_penalty``, ``frequency_penalty``, ``logit_bias`` and
vLLM's ``top_k``, ``min_p``, ``repetition_penalty``, each checked against ``SamplingParams``'
own ranges. One OpenAI request may be several jobs: ``n`` samples of a prompt, and a list of
prompts on completions; choice ``i`` is job ``i`` (prompt-major, as OpenAI orders them), with
a seed derived from the request's (:func:`choice_seed`), so a seeded request is reproducible
choice by choice. Our own speculative settings travel under one extension field,
``specfleet``. Every field follows :mod:`coordinator.openai_api.fields`.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from coordinator.openai_api.fields import RequestError, read_body
from coordinator.openai_api.fields import Strict as _Strict
from coordinator.openai_api.structured import (
    GrammarSyntax,
    ResponseFormat,
    ToolChoice,
    Tools,
    grammar_constraint,
    request_constraint,
)
from shared.protocol import (
    MAX_SEED,
    MAX_TOKENS_CAP,
    MAX_TOOLS,
    MAX_TOP_LOGPROBS,
    MESSAGE_NAME_PATTERN,
    GenerationRequest,
    Priority,
    SamplingParams,
    SpecSettings,
    ToolCall,
    ToolDefinition,
    draw_seed,
)

#: OpenAI's and vLLM's default temperature: a request without one samples.
DEFAULT_TEMPERATURE = 1.0
#: Most alternatives the legacy completions ``logprobs`` may ask for (OpenAI's limit).
MAX_COMPLETION_LOGPROBS = 5
#: Most jobs one request may become (``n`` times the prompts).
MAX_CHOICES = 64
#: OpenAI's bounds on one ``logit_bias`` value, and on how many tokens it may bias.
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_TOKENS = 1024

#: Endpoints a request (or a batch line) can name.
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
#: Our own request shape in a batch line (the old ``specfleet batch`` files).
NATIVE = "/v1/specfleet/generate"
#: Embeddings (``coordinator.openai_api.embeddings``): a task, not a generation.
EMBEDDINGS = "/v1/embeddings"
ENDPOINTS = (COMPLETIONS, CHAT, NATIVE, EMBEDDINGS)


def _bounds(name: str) -> dict[str, Any]:
    """``SamplingParams.<name>``'s range (``ge``, ``le``, ...)."""
    return {attr: getattr(rule, attr) for rule in SamplingParams.model_fields[name].metadata
            for attr in ("gt", "ge", "lt", "le") if hasattr(rule, attr)}


def _knob(name: str) -> Any:
    """An optional request field with ``SamplingParams.<name>``'s own range: one definition
    of what each knob accepts, and a 400 that names OpenAI's field."""
    return Field(default=None, **_bounds(name))


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of a request seeded ``seed``: choice 0 samples with the
    request's own seed (so ``n`` 1 and the first of ``n`` agree), the others with seeds
    hashed from it, below 2**53 like every drawn seed."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") >> 11) % (MAX_SEED + 1)


class Extension(_Strict):
    """The ``specfleet`` request field: what OpenAI has no name for."""

    speculative: SpecSettings | None = None
    priority: Priority = Priority.NORMAL
    parse_special: bool = False
    #: False: prefill this request from its first token and leave nothing cached.
    prefix_cache: bool = True
    #: A grammar the output must follow (Lark unless ``grammar_syntax`` says otherwise).
    grammar: str | None = None
    grammar_syntax: GrammarSyntax | None = None


class StreamOptions(_Strict):
    include_usage: bool = False
    #: OpenAI's padding of every streamed chunk with random characters (so a chunk's size
    #: does not tell its token's length to whoever sees the traffic): honoured when asked.
    include_obfuscation: bool = False


class Sampled(_Strict):
    """What every generating endpoint reads: the model, the sampling knobs, streaming, and
    our extension."""

    model: str
    temperature: float | None = _knob("temperature")
    top_p: float | None = _knob("top_p")
    #: vLLM's: -1 (its "all tokens") and 0 both switch the cut off.
    top_k: int | None = Field(default=None, ge=-1, le=_bounds("top_k")["le"])
    min_p: float | None = _knob("min_p")
    repetition_penalty: float | None = _knob("repetition_penalty")
    presence_penalty: float | None = _knob("presence_penalty")
    frequency_penalty: float | None = _knob("frequency_penalty")
    seed: int | None = _knob("seed")
    stream: bool = False
    specfleet: Extension = Field(default_factory=Extension)

    def sampling(self) -> dict[str, Any]:
        """Our ``sampling`` fields: OpenAI's defaults where the request gave none
        (``temperature`` 1), the neutral value of every other knob."""
        given = {name: getattr(self, name) for name in SamplingParams.model_fields
                 if name not in ("temperature", "logit_bias")
                 and getattr(self, name, None) is not None}
        if given.get("top_k") == -1:
            given["top_k"] = 0
        temperature = DEFAULT_TEMPERATURE if self.temperature is None else self.temperature
        return {"temperature": float(temperature), **given}

    def base_request(self, model: str, max_tokens: int,
                     response_format: ResponseFormat | None = None,
                     tools: Tools | None = None,
                     format_param: str = "response_format") -> dict[str, Any]:
        """Our request fields that do not depend on the prompt's form, for ``model`` (the
        served name an alias stands for), with the constraint of ``response_format``,
        ``specfleet.grammar`` and ``tools`` (compiled: ``RequestError`` if it cannot)."""
        body: dict[str, Any] = {"model": model, "max_tokens": max_tokens,
                                "sampling": self.sampling(),
                                "priority": str(self.specfleet.priority),
                                "prefix_cache": self.specfleet.prefix_cache}
        grammar = grammar_constraint(self.specfleet.grammar, self.specfleet.grammar_syntax)
        constraint = request_constraint(response_format, grammar, tools, format_param)
        if constraint is not None:
            body["constraint"] = constraint.model_dump(mode="json", exclude_none=True)
        if tools is not None and tools.tools:
            body["tools"] = [t.model_dump(mode="json", exclude_none=True) for t in tools.tools]
        if self.specfleet.speculative is not None:
            # Only what the request set: an unset field means "the worker's capacity".
            body["speculative"] = self.specfleet.speculative.model_dump(mode="json",
                                                                        exclude_unset=True)
        return body


class _Common(Sampled):
    """Fields shared by completions and chat completions."""

    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_CAP)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is None:
            return v
        if len(v) > MAX_LOGIT_BIAS_TOKENS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS_TOKENS} tokens can be biased")
        for key, bias in v.items():
            if not key.isdigit():
                raise ValueError(f"keys are token ids, not {key!r}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"token {key}: a bias is between -100 and 100, not {bias}")
        return v

    def budget(self) -> int:
        return self.max_tokens or DEFAULT_MAX_TOKENS

    def top_logprobs_asked(self) -> int | None:
        """None: no logprobs; k: each token's logprob and its k most likely alternatives."""
        raise NotImplementedError

    def tool_fields(self) -> Tools | None:
        """What the request says about tools (chat's; none on completions)."""
        return None

    def common_request(self, model: str) -> dict[str, Any]:
        """Our request fields that do not depend on the prompt's form."""
        body = self.base_request(model, self.budget(), self.response_format, self.tool_fields())
        body["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if self.logit_bias:
            body["sampling"]["logit_bias"] = dict(self.logit_bias)
        k = self.top_logprobs_asked()
        if k is not None:
            body.update(logprobs=True, top_logprobs=k)
        return body


#: OpenAI's default ``max_tokens`` for completions.
DEFAULT_MAX_TOKENS = 16


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1, le=MAX_CHOICES)
    suffix: str | None = None
    #: The legacy shape: the number of alternatives per token (0: the chosen token's only).
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)

    def top_logprobs_asked(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:
            raise ValueError("must not be empty")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and v != info.data.get("n", 1):
            raise ValueError("best_of other than n (ranking extra samples) is not supported")
        return v

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix (insertion) is not supported")
        return v

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one, or a list of them."""
        if isinstance(self.prompt, list) and isinstance(self.prompt[0], str | list):
            return list(self.prompt)  # type: ignore[arg-type]
        return [self.prompt]  # type: ignore[list-item]

    def jobs(self, model: str) -> list[tuple[dict[str, Any], str]]:
        """One request (and its echoed text) per prompt."""
        if self.echo and self.logprobs is not None:
            raise RequestError("echo with logprobs needs the prompt's logprobs, which are "
                               "not computed", param="echo")
        out = []
        for prompt in self.prompts():
            body = self.common_request(model)
            if isinstance(prompt, str):
                body.update(prompt=prompt, parse_special=self.specfleet.parse_special)
            elif self.echo:
                raise RequestError("echo needs a text prompt (token ids cannot be shown as "
                                   "text here)", param="echo")
            else:
                body["prompt_tokens"] = prompt
            out.append((body, prompt if self.echo and isinstance(prompt, str) else ""))
        return out


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    """One turn of ``messages``: an assistant turn may carry the ``tool_calls`` it made
    (``content`` then null), a ``tool`` turn answers one (``tool_call_id``). ``refusal`` is
    accepted at null: the SDKs send a reply's message back with it. ``name`` goes to the
    worker, whose chat template renders it, or the request is refused naming it (admission:
    ``WorkerInfo.chat_template_names``)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: None = None
    name: str | None = Field(default=None, pattern=MESSAGE_NAME_PATTERN)

    def text(self) -> str | None:
        if self.content is None or isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def ours(self) -> dict[str, Any]:
        """This turn as our ``ChatMessage`` (checked there: which role carries what);
        "developer" is OpenAI's newer name for the system turn."""
        turn: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                                "content": self.text()}
        if self.tool_calls is not None:
            turn["tool_calls"] = [c.model_dump(mode="json") for c in self.tool_calls]
        if self.tool_call_id is not None:
            turn["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            turn["name"] = self.name
        return turn


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    tools: list[ToolDefinition] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_CAP)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def budget(self) -> int:
        return self.max_completion_tokens or self.max_tokens or DEFAULT_CHAT_MAX_TOKENS

    def tool_fields(self) -> Tools:
        return Tools(tools=self.tools, tool_choice=self.tool_choice,
                     parallel_tool_calls=self.parallel_tool_calls)

    def jobs(self, model: str) -> list[tuple[dict[str, Any], str]]:
        messages = [m.ours() for m in self.messages]
        return [({**self.common_request(model), "messages": messages}, "")]


#: A chat request without a budget: ours (OpenAI's is "until the context ends").
DEFAULT_CHAT_MAX_TOKENS = 256


@dataclass(frozen=True)
class Choice:
    """One job of an OpenAI request: our request, the prompt it answers (usage counts each
    prompt once) and the text shown before its completion (``echo``)."""

    request: dict[str, Any]
    prompt_index: int = 0
    echo: str = ""
    #: The output is read as tool calls or a message (``tool_calls.CallReader``).
    tool_calls: bool = False


@dataclass(frozen=True)
class Parsed:
    """An OpenAI request read: its jobs in choice order, and how to answer it. ``model`` is
    the name the client sent (an alias is answered as the alias)."""

    endpoint: str
    model: str
    choices: list[Choice]
    stream: bool = False
    include_usage: bool = False
    #: ``stream_options.include_obfuscation``: every chunk carries random padding.
    obfuscate: bool = False


def reads_tool_calls(request: Mapping[str, Any]) -> bool:
    """Whether a job's output is read as tool calls: it offers tools under the grammar of
    calls (``tool_choice`` none offers them unconstrained, and its output is a message).
    Asked of the job itself, so a resumed stream or a batch's output reads it the same."""
    constraint = request.get("constraint") or {}
    return bool(request.get("tools")) and constraint.get("kind") == "lark"


def resolve(model: object, aliases: Mapping[str, str]) -> str | None:
    """The served model an alias stands for (the name itself when it is no alias)."""
    return aliases.get(model, model) if isinstance(model, str) else None


#: What a served model's name may be (``GenerationRequest.model``: it names Redis keys).
_SERVED_NAME = re.compile(next(rule.pattern for rule in
                               GenerationRequest.model_fields["model"].metadata
                               if getattr(rule, "pattern", None)))


def served_model(sent: str, aliases: Mapping[str, str] | None) -> str:
    """The served model a request's ``model`` names (an alias resolved). A name no worker
    can serve (``org/model``, not an alias) is an unknown model (404), not a malformed
    request."""
    served = resolve(sent, aliases or {}) or sent
    if not _SERVED_NAME.match(served):
        raise RequestError(f"unknown model '{sent}'", param="model", code="model_not_found")
    return served


def parse_body(endpoint: str, body: dict[str, Any],
               aliases: Mapping[str, str] | None = None) -> Parsed:
    """Our requests for an OpenAI ``body`` sent to ``endpoint`` (``RequestError`` naming the
    bad field)."""
    if endpoint == NATIVE:
        return Parsed(endpoint, str(body.get("model", "")), [Choice(body)])
    parsed: CompletionRequest | ChatRequest = (read_body(CompletionRequest, body)
                                               if endpoint == COMPLETIONS
                                               else read_body(ChatRequest, body))
    served = served_model(parsed.model, aliases)
    prompts = parsed.jobs(served)
    if len(prompts) * parsed.n > MAX_CHOICES:
        raise RequestError(f"n ({parsed.n}) x prompts ({len(prompts)}) exceeds "
                           f"{MAX_CHOICES} choices", param="n")
    several = len(prompts) * parsed.n > 1
    base = parsed.seed if parsed.seed is not None else (draw_seed() if several else None)
    choices = []
    for p, (request, echo) in enumerate(prompts):
        for k in range(parsed.n):
            index = p * parsed.n + k
            job = json.loads(json.dumps(request))  # each job its own copy
            if base is not None:
                job["sampling"]["seed"] = choice_seed(base, index)
            choices.append(Choice(job, p, echo, reads_tool_calls(job)))
    if parsed.stream_options is not None and not parsed.stream:
        raise RequestError("stream_options needs stream: true", param="stream_options")
    options = parsed.stream_options or StreamOptions()
    return Parsed(endpoint, parsed.model, choices, parsed.stream, options.include_usage,
                  options.include_obfuscation)
