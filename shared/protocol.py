"""Wire protocol: every object that crosses Redis or a JSONL file is one of these models.

Keeping them in one module means the coordinator, the workers and the CLI cannot drift apart:
a field renamed here is renamed everywhere, and every bad field is rejected at the edge with a
message that names it (pydantic's ``loc``), before anything is queued.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import Annotated, Any, Literal, NamedTuple

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    Strict,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import CoreSchema

from shared.constraint import Constraint
from shared.tool_calls import render_calls

#: Import path of the job function every generation job names on its rq queue; workers run
#: nothing else. Part of the wire contract: coordinator and workers both read it from here.
JOB_FUNCTION = "worker.service.jobs.run_generation"
#: The jobs a worker runs beside generations, each on its own function so rq's records say
#: which it is (``worker/service/tasks.py``): an :class:`EmbeddingRequest` and a
#: :class:`TokenizerRequest`.
EMBEDDING_FUNCTION = "worker.service.tasks.run_embedding"
TOKENIZER_FUNCTION = "worker.service.tasks.run_tokenizer"
#: Hard cap on tokens one request may generate; larger budgets are a batch's job.
MAX_TOKENS_CAP = 8192
#: Hard cap on the prompt, in characters (text) and in token ids.
MAX_PROMPT_CHARS = 256 * 1024
MAX_PROMPT_TOKENS = 131072
#: Hard cap on the draft width a request may ask for (the suffix drafter's default on one slot
#: of an attention model is 127: a 128-row verify).
MAX_DRAFT = 128
MAX_STOP_SEQUENCES = 8
MAX_STOP_CHARS = 128
#: Hard cap on the turns of a chat request.
MAX_MESSAGES = 256
#: OpenAI's limits on one embeddings request: inputs, and tokens over all of them.
MAX_EMBEDDING_INPUTS = 2048
MAX_EMBEDDING_TOKENS = 300_000


class _Strict(BaseModel):
    """Base for wire models: unknown fields are errors, so a typo never silently does nothing,
    and no value is coerced (``true``, ``"10"`` or ``2.0`` is not an int): a client that
    sends the wrong type learns it at the edge instead of running a different request."""

    model_config = ConfigDict(extra="forbid", frozen=False, strict=True)


class _WireEnum(StrEnum):
    """An enum that strict wire models still read from its string value.

    Strict mode would take only enum instances from a dict (rq hands the worker the request
    as a dict decoded from JSON), so ``"ngram"`` would be refused; the value itself is the
    only lax input, and anything else (``1``, ``true``, ``"bogus"``) is still an error.
    """

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any,
                                     handler: GetCoreSchemaHandler) -> CoreSchema:
        return {**handler(source), "strict": False}


class SpecMethod(_WireEnum):
    """Which drafter proposes tokens. ``auto`` = suffix, with MTP beside it (``mtp+suffix``)
    when the GGUF has a NextN head."""

    NONE = "none"
    NGRAM = "ngram"
    #: Suffix lookup with counts and a cost-based draft length (docs/engine.md).
    SUFFIX = "suffix"
    MTP = "mtp"
    #: MTP and suffix lookup together: the longer confident draft per step.
    MTP_SUFFIX = "mtp+suffix"
    AUTO = "auto"


class CheckpointMode(_WireEnum):
    """Where compact-rollback checkpoints live."""

    DEVICE = "device"
    HOST = "host"


class Priority(_WireEnum):
    NORMAL = "normal"
    HIGH = "high"


class SpecSettings(_Strict):
    """Per-request speculative settings; defaults follow the measurements in docs/benchmarks."""

    method: SpecMethod = SpecMethod.AUTO
    draft_max: int = Field(default=8, ge=1, le=MAX_DRAFT, description="draft width ceiling N")
    draft_min: int = Field(default=0, ge=0, le=MAX_DRAFT, description="shorter drafts are dropped")
    p_min: float = Field(default=0.0, ge=0.0, le=1.0, description="drafter confidence floor")
    adaptive: bool = Field(default=False, description="narrow or widen the draft width "
                           "(within 1..draft_max) as recent drafts are accepted")
    rollback_depth: int | None = Field(
        default=None, ge=1, le=MAX_DRAFT, description="direct rollback snapshots D (None = N)"
    )
    ngram_min: int = Field(default=2, ge=1, le=8, description="shortest n-gram looked up")
    ngram_max: int = Field(default=4, ge=1, le=16, description="longest n-gram looked up")

    @model_validator(mode="after")
    def _consistent(self) -> SpecSettings:
        if self.draft_min > self.draft_max:
            raise ValueError(
                f"draft_min ({self.draft_min}) must not exceed draft_max ({self.draft_max})"
            )
        if self.rollback_depth is not None and self.rollback_depth > self.draft_max:
            raise ValueError(
                f"rollback_depth ({self.rollback_depth}) must satisfy "
                f"1 <= rollback_depth <= draft_max ({self.draft_max})"
            )
        if self.ngram_min > self.ngram_max:
            raise ValueError(
                f"ngram_min ({self.ngram_min}) must not exceed ngram_max ({self.ngram_max})"
            )
        return self

    @property
    def enabled(self) -> bool:
        return self.method is not SpecMethod.NONE


#: Most alternatives ``top_logprobs`` may ask for per token (OpenAI's limit).
MAX_TOP_LOGPROBS = 20
#: Largest seed a request may carry; a request without one is given a random one.
MAX_SEED = 2**63 - 1


class SamplingParams(_Strict):
    """The target distribution of one request: how a token is chosen from the model's logits.

    One definition serves plain sampling and speculative verification alike
    (``worker/engine/sampling.py``): the logits are penalised, divided by ``temperature``, cut
    to ``top_k``, then to the ``top_p`` nucleus, then to tokens of at least ``min_p`` times the
    top probability, and renormalised (vLLM's and Hugging Face's order). ``temperature`` 0 is
    greedy (the argmax of the penalised logits). The neutral value of each knob switches it off.
    """

    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    top_k: int = Field(default=0, ge=0, le=1_000_000, description="0: no top-k cut")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="1: no nucleus cut")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0, description="0: no min-p cut")
    repetition_penalty: float = Field(
        default=1.0, gt=0.0, le=10.0,
        description="CTRL's: a seen token's positive logit is divided by it, a negative one "
                    "multiplied (prompt and output; 1: off)")
    presence_penalty: float = Field(
        default=0.0, ge=-2.0, le=2.0, description="OpenAI's: subtracted once from the logit "
                                                  "of every token already generated")
    frequency_penalty: float = Field(
        default=0.0, ge=-2.0, le=2.0, description="OpenAI's: subtracted per occurrence of "
                                                  "the token in the output so far")
    seed: int | None = Field(
        default=None, ge=0, le=MAX_SEED,
        description="same seed, same tokens; None: a random one, reported back")
    logit_bias: dict[Annotated[int, Field(ge=0), Strict(False)],
                     Annotated[float, Field(ge=-100.0, le=100.0)]] = Field(
        default_factory=dict, max_length=1024,
        description="OpenAI's: added to a token's logit before everything else (-100 bans "
                    "it, 100 all but forces it); keys are token ids (JSON: their digits)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def adjusted(self) -> bool:
        """Whether the logits change before temperature (a penalty or a bias is on)."""
        return self.penalised or bool(self.logit_bias)


def draw_seed() -> int:
    """A random seed for a request that gave none: below 2**53, so JSON readers that hold
    numbers as doubles (JavaScript) report it back exactly."""
    return secrets.randbelow(2**53)


class TopLogprob(_Strict):
    """One candidate token with its log probability under the model's raw distribution
    (log-softmax of the logits, before penalties, temperature and cuts: OpenAI's and
    vLLM's default). ``bytes`` are the token's raw UTF-8 bytes (a piece may be part of a
    character); ``text`` is them decoded with replacement."""

    token: int
    text: str
    bytes: list[int]
    logprob: float


class TokenLogprob(TopLogprob):
    """A generated token's log probability and its ``top_logprobs`` most likely
    alternatives at that position (most likely first)."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class WorkerCapacity(_Strict):
    """What a worker was loaded with (see ``shared/capacity.py``): requests may narrow it."""

    method: SpecMethod = Field(description="the concrete drafting method the engine loaded")
    draft_max: int = Field(ge=0, le=MAX_DRAFT, description="draft width N the contexts hold")
    rollback_depth: int | None = Field(
        default=None, description="recurrent snapshots D per sequence; None: not recurrent")


#: Most tools one request may offer, and most calls one assistant turn may carry (OpenAI's).
MAX_TOOLS = 128
#: What a function's name may be (OpenAI's rule): it is written into grammars and prompts.
TOOL_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
#: What a model's name may be (it names Redis keys and queues): a request's, a worker's, a
#: declared model's and its aliases (``shared/catalog.py``).
MODEL_NAME_PATTERN = r"^[\w.\-]+$"


class FunctionDefinition(_Strict):
    """A function the model may call: its name, what it does, and the JSON Schema of its
    arguments (``parameters``; none: any JSON object)."""

    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS)
    parameters: dict[str, Any] | None = None
    #: OpenAI's strict mode; the arguments are always constrained to ``parameters`` here.
    strict: bool | None = None


class ToolDefinition(_Strict):
    """One tool of a request (OpenAI's shape: only functions exist)."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class ToolCallFunction(_Strict):
    name: str = Field(pattern=TOOL_NAME_PATTERN)
    #: The arguments as the model wrote them: JSON text of an object (OpenAI's shape), or
    #: whatever a call cut by its budget left. OpenAI takes any string here, and agent loops
    #: (the Node SDK, the Agents SDK) send a cut call back as history.
    arguments: str = Field(max_length=MAX_PROMPT_CHARS)


class ToolCall(_Strict):
    """A call an assistant turn made, sent back in a conversation's history."""

    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: ToolCallFunction


#: A message's ``name`` as OpenAI allows it: no markup can hide in it, so a template may
#: render it beside its own turn markers.
MESSAGE_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"


class ChatMessage(_Strict):
    """One chat turn; the worker renders the turns with its model's chat template.

    An assistant turn may carry the ``tool_calls`` it made (its ``content`` then may be
    None); a ``tool`` turn answers one of them (``tool_call_id``)."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS)
    tool_calls: list[ToolCall] | None = Field(default=None, min_length=1, max_length=MAX_TOOLS)
    tool_call_id: str | None = Field(default=None, min_length=1, max_length=256)
    name: str | None = Field(
        default=None, pattern=MESSAGE_NAME_PATTERN,
        description="who speaks this turn (OpenAI's name: letters, digits, _ and -, at most "
                    "64), rendered where the worker's chat template reads it "
                    "(WorkerInfo.chat_template_names); refused elsewhere")

    @model_validator(mode="after")
    def _tool_fields_match_role(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("'tool_calls' belong to an assistant turn")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a 'tool' turn, and only one, names the call it answers "
                             "('tool_call_id')")
        if self.content is None and self.tool_calls is None:
            raise ValueError("'content' may be null only on an assistant turn with "
                             "'tool_calls'")
        return self

    def text(self) -> str:
        """The turn as the model wrote it: its content, then its calls in
        :mod:`shared.tool_calls`' layout (what a model under the calls grammar writes)."""
        calls = render_calls([(c.function.name, c.function.arguments)
                              for c in self.tool_calls or []])
        return "\n".join(part for part in (self.content, calls) if part)


class GenerationRequest(_Strict):
    """One generation: a prompt (text, token ids or chat messages), a budget, sampling and
    speculation.

    Sampling and speculation combine freely: speculative verification samples from the same
    distribution as plain decoding (``SamplingParams``), and greedy (temperature 0) stays
    token-exact. ``logprobs`` are of the model's raw distribution (``TokenLogprob``)."""

    model: str = Field(default="default", min_length=1, max_length=128,
                       pattern=MODEL_NAME_PATTERN)
    prompt: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS)
    prompt_tokens: list[Annotated[int, Field(ge=0)]] | None = Field(
        default=None, max_length=MAX_PROMPT_TOKENS
    )
    messages: list[ChatMessage] | None = Field(default=None, max_length=MAX_MESSAGES)
    parse_special: bool = Field(
        default=False, description="text prompt: turn special-token text (<bos>) into tokens"
    )
    max_tokens: int = Field(default=128, ge=1, le=MAX_TOKENS_CAP)
    sampling: SamplingParams = Field(
        default_factory=SamplingParams,
        description="the target distribution; default greedy (temperature 0); a request "
                    "without a seed is given one at submit, reported in its final event")
    logprobs: bool = Field(
        default=False, description="return each generated token's log probability")
    top_logprobs: int = Field(
        default=0, ge=0, le=MAX_TOP_LOGPROBS,
        description="and this many most likely alternatives per token (needs logprobs)")
    stop: list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]] = Field(
        default_factory=list, max_length=MAX_STOP_SEQUENCES
    )
    speculative: SpecSettings = Field(default_factory=SpecSettings)
    priority: Priority = Priority.NORMAL
    custom_id: str | None = Field(default=None, max_length=256)
    tools: list[ToolDefinition] | None = Field(
        default=None, min_length=1, max_length=MAX_TOOLS,
        description="chat: functions the model may call, rendered into the prompt (the chat "
                    "template's own way, or docs/http.md's generic format); the call itself "
                    "is shaped by 'constraint'")
    constraint: Constraint | None = Field(
        default=None, description="what the output may say: JSON, a JSON Schema, a grammar "
                                  "(Lark, GBNF) or a regex (shared/constraint.py); the "
                                  "target distribution is masked to it")
    prefix_cache: bool = Field(
        default=True, description="reuse a cached prefix of this prompt and keep this "
                                  "request's tokens for later ones (false: prefill from the "
                                  "first token, and leave nothing behind)")

    @model_validator(mode="before")
    @classmethod
    def _sampling_fields_are_nested(cls, data: Any) -> Any:
        """A sampling knob at the top level (the old flat ``temperature``/``seed``) is named
        with where it belongs instead of a bare "extra inputs are not permitted"."""
        if isinstance(data, Mapping):
            flat = sorted(k for k in data if k in SamplingParams.model_fields)
            if flat:
                names = ", ".join(repr(k) for k in flat)
                where = ", ".join(f"sampling.{k}" for k in flat)
                raise ValueError(f"{names} {'belongs' if len(flat) == 1 else 'belong'} in "
                                 f"'sampling' (send {where})")
        return data

    @model_validator(mode="after")
    def _consistent(self) -> GenerationRequest:
        given = [self.prompt, self.prompt_tokens, self.messages]
        if sum(x is not None for x in given) != 1:
            raise ValueError(
                "exactly one of 'prompt', 'prompt_tokens' or 'messages' must be given")
        if self.messages is not None and not self.messages:
            raise ValueError("'messages' must not be empty")
        if self.parse_special and self.prompt is None:
            raise ValueError("'parse_special' applies to a text 'prompt' only")
        if self.prompt is not None and not self.prompt:
            raise ValueError("'prompt' must not be empty")
        if self.prompt_tokens is not None and not self.prompt_tokens:
            raise ValueError("'prompt_tokens' must not be empty")
        if self.tools is not None and self.messages is None:
            raise ValueError("'tools' need 'messages' (a chat)")
        if self.tools is not None:
            names = [t.function.name for t in self.tools]
            if len(set(names)) != len(names):
                raise ValueError("'tools' must name each function once")
        if self.top_logprobs and not self.logprobs:
            raise ValueError(
                f"'top_logprobs' ({self.top_logprobs}) needs 'logprobs': true")
        return self

    @property
    def logprobs_k(self) -> int | None:
        """What the engine is asked for: None (no logprobs) or the alternatives per token."""
        return self.top_logprobs if self.logprobs else None

    def with_seed(self) -> GenerationRequest:
        """This request with a seed: its own, or one drawn now (``draw_seed``). The
        coordinator calls it before queueing, so a re-run of the job (a crashed worker's,
        a shutdown requeue) samples the same tokens; the seed counts as set, so it travels
        on the queue like any other field the request set."""
        if self.sampling.seed is not None:
            return self
        sampling = SamplingParams.model_validate(
            {**self.sampling.model_dump(exclude_unset=True), "seed": draw_seed()})
        return self.model_copy(update={"sampling": sampling})  # marks it set


#: One input of an embedding: text (tokenized by the worker, its special tokens added as for a
#: prompt), or token ids.
EmbeddingInput = (Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS)]
                  | Annotated[list[Annotated[int, Field(ge=0)]],
                              Field(min_length=1, max_length=MAX_PROMPT_TOKENS)])


class EmbeddingRequest(_Strict):
    """Embeddings of one or more inputs: each input's vector, pooled by the worker's embedding
    context and scaled to unit length (docs/http.md, "Embeddings"). A worker batches the
    inputs of every embedding job it holds into its embedding decodes."""

    model: str = Field(min_length=1, max_length=128, pattern=MODEL_NAME_PATTERN)
    input: list[EmbeddingInput] = Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)


class TokenizerRequest(_Strict):
    """The worker's tokenizer: ``text`` or chat ``messages`` (with ``tools``) to token ids, the
    prompt a completion or chat would decode; or ``tokens`` back to text (control tokens
    written as their text, as llama-server and vLLM write them)."""

    model: str = Field(min_length=1, max_length=128, pattern=MODEL_NAME_PATTERN)
    text: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS)
    messages: list[ChatMessage] | None = Field(default=None, min_length=1,
                                               max_length=MAX_MESSAGES)
    tools: list[ToolDefinition] | None = Field(default=None, min_length=1, max_length=MAX_TOOLS)
    tokens: list[Annotated[int, Field(ge=0)]] | None = Field(default=None,
                                                             max_length=MAX_PROMPT_TOKENS)
    add_special: bool = Field(
        default=True, description="text: the special tokens the model adds to a prompt (BOS)")
    pieces: bool = Field(default=False, description="also each token's bytes")

    @model_validator(mode="after")
    def _one_direction(self) -> TokenizerRequest:
        if sum(x is not None for x in (self.text, self.messages, self.tokens)) != 1:
            raise ValueError("exactly one of 'text', 'messages' or 'tokens' must be given")
        if self.tools is not None and self.messages is None:
            raise ValueError("'tools' need 'messages' (a chat)")
        if self.tokens is not None and self.pieces:
            raise ValueError("'pieces' are of tokenized text: 'tokens' are the pieces")
        return self


class Summed(NamedTuple):
    """Marks a :class:`Telemetry` field that adds up over generations (a count, seconds, or a
    per-draft-position list summed position by position) and names its Prometheus series.

    The one declaration every reader of a sum follows: the engine's counters render it by
    name, the worker's metrics make one series per marked field, the log monitor sums it. A
    field without the marker is a rate derived from the sums or the latest state, never
    summed. ``label``: the series' extra label, a list's index (``position``) or, with
    ``label_field``, the value of that field (a host fallback's reason)."""

    series: str
    doc: str
    label: str | None = None
    label_field: str | None = None


class Telemetry(_Strict):
    """What speculation bought for one generation (or cumulatively for an engine).

    Field names are part of the public contract (CLI ``--json``, events, logs, dashboards).
    ``tokens_per_second`` counts decode time only; ``effective_tokens_per_second`` is wall time
    including drafting, which is the one to believe (docs/telemetry.md, "Reading the numbers").
    docs/telemetry.md says exactly what each field counts (``mean_accepted_length`` leaves the
    bonus token out; ``mean_acceptance_length`` is vLLM's, which counts it). A field that adds
    up over generations is marked :class:`Summed`.
    """

    spec_method: SpecMethod = SpecMethod.NONE
    draft_max: int = 0
    #: Decoded in deterministic mode (``specfleet worker --deterministic``): greedy output
    #: independent of batch width, slots, draft length and worker (docs/engine.md).
    deterministic: bool = False
    drafts: Annotated[int, Summed(
        "spec_decode_num_drafts", "Verify decodes that carried at least one drafted token")] = 0
    drafted: Annotated[int, Summed("spec_decode_num_draft_tokens", "Drafted tokens verified")] = 0
    accepted: Annotated[int, Summed(
        "spec_decode_num_accepted_tokens",
        "Drafted tokens the target accepted (bonus not counted)")] = 0
    acceptance: float = 0.0
    accepted_per_position: Annotated[list[int], Summed(
        "spec_decode_num_accepted_tokens_per_pos",
        "Accepted drafted tokens by draft position (0 = first)", label="position")] = Field(
        default_factory=list)
    drafted_per_position: Annotated[list[int], Summed(
        "spec_decode_num_draft_tokens_per_pos",
        "Drafted tokens by draft position (0 = first; position 0 counts every draft)",
        label="position")] = Field(default_factory=list)
    mean_accepted_length: float = 0.0
    mean_acceptance_length: float = 0.0
    target_decodes: Annotated[int, Summed(
        "spec_decode_num_verifies", "Target verify decodes, plain one-row steps included")] = 0
    tokens_per_verify: float = 0.0
    draft_seconds: Annotated[float, Summed("draft_seconds", "Seconds spent drafting")] = 0.0
    draft_seconds_per_token: float = 0.0
    decode_seconds: Annotated[float, Summed(
        "decode_seconds", "Seconds in target decodes and rollback (replays included)")] = 0.0
    prefill_seconds: Annotated[float, Summed(
        "prefill_seconds", "Seconds prefilling prompts")] = 0.0
    wall_seconds: Annotated[float, Summed(
        "generation_seconds", "Wall seconds of decode loops (drafting included)")] = 0.0
    #: The host's share of the engine steps that committed this generation's tokens: each
    #: step's wall time minus its verify decode (drafting, acceptance, commit, rollback and
    #: its rare replays, the stream), split over the step's decoding slots by the tokens each
    #: committed. On a GPU this is what the device waits for between decodes.
    host_seconds: Annotated[float, Summed(
        "host_seconds", "Host seconds of engine steps (step wall time minus its target "
        "decode), by the tokens each generation committed")] = 0.0
    host_seconds_per_token: float = 0.0
    tokens_per_second: float = 0.0
    effective_tokens_per_second: float = 0.0
    generated_tokens: Annotated[int, Summed("generated_tokens", "Tokens generated")] = 0
    prompt_tokens: Annotated[int, Summed("prompt_tokens", "Prompt tokens of the requests")] = 0
    #: Prompt tokens served from the worker's prefix cache (kept from an earlier request in
    #: the slot, or restored from a prefix checkpoint) instead of being prefilled again.
    cached_tokens: Annotated[int, Summed(
        "prefix_cached_tokens", "Prompt tokens served from the prefix cache")] = 0
    prefix_hits: Annotated[int, Summed(
        "prefix_cache_hits", "Requests that reused a cached prefix")] = 0
    prefix_misses: Annotated[int, Summed(
        "prefix_cache_misses", "Requests prefilled from their first token")] = 0
    prefix_restores: Annotated[int, Summed(
        "prefix_checkpoint_restores", "Prefix checkpoints restored to reuse a prefix")] = 0
    prefix_checkpoint_saves: Annotated[int, Summed(
        "prefix_checkpoint_saves", "Prefix checkpoints saved while prefilling")] = 0
    #: Structured output (a request's ``constraint``): docs/structured.md.
    constrained_tokens: Annotated[int, Summed(
        "constrained_tokens", "Tokens generated under a constraint (JSON, grammar, regex)")] = 0
    forced_tokens: Annotated[int, Summed(
        "forced_tokens", "Tokens the grammar forced, verified as drafts (jump-forward)")] = 0
    mask_cut_drafts: Annotated[int, Summed(
        "mask_cut_drafts", "Drafted tokens cut before verification: the grammar forbids them")] = 0
    mask_seconds: Annotated[float, Summed(
        "mask_seconds", "Seconds computing grammar masks and checking drafts")] = 0.0
    grammar_forced_closes: Annotated[int, Summed(
        "grammar_forced_closes", "Constrained generations that max_tokens steered to a close "
        "(a token the target picked replaced by the close's)")] = 0
    replay_events: Annotated[int, Summed(
        "replay_events", "Compact-rollback checkpoint restores followed by a replay")] = 0
    replay_tokens: Annotated[int, Summed("replay_tokens", "Tokens re-decoded by replays")] = 0
    checkpoint_mode: CheckpointMode | None = None
    checkpoint_saves: Annotated[int, Summed(
        "checkpoint_saves", "Rollback checkpoints saved")] = 0
    host_fallbacks: Annotated[int, Summed(
        "checkpoint_host_fallbacks", "Device checkpoint failures that moved storage to the host",
        label="reason", label_field="host_fallback_reason")] = 0
    host_fallback_reason: str | None = None
    #: The devices of the worker whose share of the slot's device checkpoint moved to the
    #: host with that fallback (over a group: those holding recurrent layers).
    host_fallback_devices: list[str] | None = None
    rollback_depth: int | None = None
    checkpoint_reservation_bytes: int | None = None
    #: Rows a GPU worker added to its verify decodes so every step with drafts has a row
    #: count the device replays the graph of (``--verify-buckets``; docs/engine.md,
    #: "Replayable shapes"): decoded, never kept.
    padded_rows: Annotated[int, Summed(
        "verify_padded_rows", "Rows added to verify decodes to reach a replayable row "
        "count (--verify-buckets), by the slot they padded")] = 0

    @classmethod
    def summed(cls) -> dict[str, Summed]:
        """The fields that add up over generations, by name, with their series."""
        return {name: rule for name, info in cls.model_fields.items()
                for rule in info.metadata if isinstance(rule, Summed)}


class FinishReason(_WireEnum):
    LENGTH = "length"
    STOP = "stop"
    EOS = "eos"
    CANCELLED = "cancelled"
    CONTEXT = "context"


class JobStatus(_WireEnum):
    QUEUED = "queued"
    STARTED = "started"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"


class _EventBase(_Strict):
    """Every streamed event names its job, attempt and position in the job's stream."""

    job_id: str
    attempt: int = Field(ge=1)
    seq: int = Field(ge=0)
    ts: float = Field(default_factory=time.time)


#: How a streamed token was produced (``TokenEvent.origin``): drafted and accepted by the
#: verify, forced by the request's grammar (verified as a draft: jump-forward), or the target's
#: own token, the one a verify adds after the drafts it accepted.
TOKEN_ORIGINS = {"d": "drafted", "f": "forced", "t": "target"}


class TokenEvent(_EventBase):
    type: Literal["token"] = "token"
    tokens: list[int]
    text: str
    index: int = Field(ge=0, description="position of tokens[0] in the generation")
    logprobs: list[TokenLogprob] | None = Field(
        default=None, description="one per token in tokens (the request asked for logprobs)")
    origin: str | None = Field(
        default=None, pattern=rf"^[{''.join(TOKEN_ORIGINS)}]*$",
        description="how each token of tokens was produced, one letter a token "
                    "(TOKEN_ORIGINS); None: not said (an older worker)")

    @model_validator(mode="after")
    def _one_origin_a_token(self) -> TokenEvent:
        if self.origin is not None and len(self.origin) != len(self.tokens):
            raise ValueError(f"origin has {len(self.origin)} letters for {len(self.tokens)} "
                             "tokens")
        return self


class TelemetryEvent(_EventBase):
    type: Literal["telemetry"] = "telemetry"
    telemetry: Telemetry


class ProgressEvent(_EventBase):
    type: Literal["progress"] = "progress"
    stage: str
    done: int = 0
    total: int = 0
    worker: str | None = None


class Rejection(StrEnum):
    """Why a worker refused a request at admission: the request itself is at fault, so a
    client hears a 400 (the gateway answers these as it answers refusals made before
    queueing), never a server error its SDK would retry. An ``ErrorEvent`` whose
    ``error_type`` is none of these is the worker's or the job's failure."""

    #: Anything else the engine refused (a constraint its vocabulary cannot spell, ...).
    REQUEST = "request"
    #: Prompt + max_tokens past the worker's context (``context_length_exceeded``).
    CONTEXT = "context"
    VALIDATION = "validation"
    PROMPT = "prompt"
    CAPACITY = "capacity"
    WRONG_MODEL = "wrong_model"

    @classmethod
    def of(cls, error_type: str | None) -> Rejection | None:
        """The rejection an ``ErrorEvent.error_type`` names (None: not the client's fault)."""
        try:
            return cls(error_type) if error_type is not None else None
        except ValueError:
            return None


class ErrorEvent(_EventBase):
    type: Literal["error"] = "error"
    message: str
    #: A :class:`Rejection`, or the worker's own failure (an exception's type name).
    error_type: str = "error"
    #: The request field a rejection is about (``input.3``), where it names one: the 400's
    #: ``param``.
    param: str | None = None


class FinalEvent(_EventBase):
    type: Literal["final"] = "final"
    status: JobStatus
    finish_reason: FinishReason | None = None
    tokens: list[int] = Field(default_factory=list)
    text: str = ""
    telemetry: Telemetry | None = None
    worker: str | None = None
    error: str | None = None
    seed: int | None = Field(default=None, description="the sampling seed the job ran with")
    logprobs: list[TokenLogprob] | None = Field(
        default=None, description="one per token in tokens (the request asked for logprobs)")
    embeddings: list[str] | None = Field(
        default=None, description="an embedding job's vectors, one per input: little-endian "
                                  "float32, base64 (exact, and a third of a JSON list's size)")
    pieces: list[list[int]] | None = Field(
        default=None, description="a tokenizer job's: each token's bytes (it asked for pieces)")


Event = Annotated[
    TokenEvent | TelemetryEvent | ProgressEvent | ErrorEvent | FinalEvent,
    Field(discriminator="type"),
]


AnyEvent = TokenEvent | TelemetryEvent | ProgressEvent | ErrorEvent | FinalEvent
_EVENT_ADAPTER: TypeAdapter[AnyEvent] = TypeAdapter(Event)


def parse_event(raw: str | bytes) -> AnyEvent:
    """Decode one event from its JSON wire form (the ``type`` field picks the model)."""
    return _EVENT_ADAPTER.validate_json(raw)


class DeviceFit(_Strict):
    """One device's share of a fit: every component measured from llama.cpp, in bytes."""

    device: str
    total_bytes: int
    free_bytes: int
    margin_bytes: int
    components: dict[str, int] = Field(
        default_factory=dict,
        description="weights, kv, recurrent, snapshots, compute, draft, checkpoint_reservation",
    )


class FitReport(_Strict):
    """What a worker measured and fitted at start-up; logged as ``fit.report`` and published."""

    model_path: str
    n_ctx: int
    n_ctx_train: int
    slots: int
    total_bytes: int
    budget_bytes: int
    devices: list[DeviceFit]
    spec_method: str
    draft_max: int
    rollback_depth: int | None = None
    components: dict[str, int] = Field(default_factory=dict)
    details: dict[str, Any] = Field(default_factory=dict)


class WorkerInfo(_Strict):
    """A live worker as registered in the fleet registry."""

    name: str
    model_name: str
    model_path: str
    device: str
    n_ctx: int
    slots: int = 1
    version: str
    pid: int
    host: str
    started_at: float
    heartbeat_at: float
    current_job: str | None = None
    current_jobs: list[str] = Field(default_factory=list, description="one per busy slot")
    prefix_cache: bool = Field(default=False, description="reuses cached prompt prefixes "
                                                         "(publishes what it holds)")
    spec_methods: list[str] = Field(default_factory=list)
    chat_template: bool = Field(default=False, description="can render chat messages")
    chat_template_names: bool = Field(
        default=False, description="its chat template renders a message's name")
    threads: int | None = Field(default=None, ge=1, description="llama.cpp CPU threads")
    thread_wait: str | None = Field(
        default=None, description="how those threads wait at a barrier: active (spin) or "
        "passive (sleep), worker/threads.py")
    chat_template_source: str | None = Field(
        default=None, description="which template renders chats: gguf, named:NAME "
        "(SPECFLEET_CHAT_TEMPLATE), architecture:NAME or default:NAME")
    n_vocab: int | None = Field(default=None, ge=1, description="the model's vocabulary size")
    embedding_tokens: int | None = Field(
        default=None, ge=1, description="the longest input its embedding context holds "
        "(None: it serves no embeddings)")
    capacity: WorkerCapacity | None = None
    fit: FitReport | None = None
    metrics_port: int | None = Field(default=None, description="Prometheus port (None: off)")
    deterministic: bool = Field(default=False, description="greedy output independent of "
                                "batch width, slots, draft length and worker (--deterministic)")
    telemetry: Telemetry | None = Field(
        default=None, description="the engine's lifetime telemetry, refreshed every heartbeat")


class BatchLine(_Strict):
    """One input line of a batch file (OpenAI's: ``custom_id``, ``method``, ``url`` and the
    request ``body``; ``url`` defaults to the batch's endpoint)."""

    custom_id: str = Field(min_length=1, max_length=256)
    method: Literal["POST"] = "POST"
    url: str | None = Field(default=None, max_length=64)
    body: dict[str, Any]

    @field_validator("body")
    @classmethod
    def _body_not_empty(cls, v: dict[str, Any]) -> dict[str, Any]:
        if not v:
            raise ValueError("'body' must hold a generation request")
        return v


def describe_validation_error(exc: ValidationError | Sequence[Mapping[str, Any]],
                              subject: str | None = "request") -> str:
    """One line naming every bad field and why (``speculative.draft_max: ...; prompt: ...``).

    Every place that shows a ValidationError to a person renders it here, so messages read
    the same everywhere; a caller that must adjust the errors first (the HTTP gateway drops
    FastAPI's ``body`` from each ``loc``) passes the list of errors instead. ``subject`` names
    what a rule about the whole value (no field) is about; ``None`` leaves it out, for a
    caller that already names it (a CLI option).
    """
    errors = exc.errors(include_url=False) if isinstance(exc, ValidationError) else exc
    parts = []
    for err in errors:
        where = ".".join(str(p) for p in err.get("loc", ())) or subject
        # Our own rules raise ValueError; show their sentence without pydantic's prefix.
        cause = err.get("ctx", {}).get("error") if err.get("type") == "value_error" else None
        message = cause or err.get("msg", "invalid")
        parts.append(f"{where}: {message}" if where else str(message))
    return "; ".join(parts)
