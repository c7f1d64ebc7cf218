"""Command-line options, declared once for every sub-command that takes them.

``generate`` (in-process) and ``submit`` (through the fleet) take the same prompt, sampling
and speculation options; ``fit`` and ``worker`` (and ``generate``, which loads a model too)
the same model, device and memory options. Declaring each here keeps names, help and
defaults identical, and :func:`build_request` turns a generation's options into one validated
:class:`GenerationRequest`, so both commands enforce exactly the wire protocol's rules.

The sampling options are added by :func:`sampling_options` from ``SamplingParams``' own
fields (a field without an option here is an error at import), so the CLI cannot drift from
the protocol. Only options an environment variable really sets name one (``envvar=``, shown
by ``--help``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import typer
from pydantic import ValidationError

from coordinator.cli.app import fail
from shared.protocol import (
    MAX_TOP_LOGPROBS,
    CheckpointMode,
    GenerationRequest,
    Priority,
    SamplingParams,
    SpecMethod,
    SpecSettings,
    describe_validation_error,
)
from shared.settings import REDIS_URL_VARIABLES

#: The protocol's defaults, which the options show and fall back to.
DEFAULT_SPEC = SpecSettings()
DEFAULT_SAMPLING = SamplingParams()
#: CPU threads a command that loads a model uses unless told otherwise.
DEFAULT_THREADS = 2

# -- a generation's prompt and speculation ---------------------------------------------------
MaxTokens = Annotated[int, typer.Option(min=1, help="tokens to generate at most")]
Prompt = Annotated[str | None, typer.Option(help="prompt text")]
PromptTokens = Annotated[str | None, typer.Option(help="prompt token ids: 1,2,3")]
Spec = Annotated[SpecMethod, typer.Option(
    help="drafting method (auto: suffix drafting, with the MTP head beside it where the "
    "model has one)")]
DraftMax = Annotated[int | None, typer.Option(
    help="draft width ceiling N (default for suffix drafting: 127 on one slot, 63 on a "
    "recurrent model, 32 on two slots, fewer on more; 8 for the other drafters: "
    "docs/engine.md, 'Choosing a drafter')")]
DraftMin = Annotated[int, typer.Option(help="shorter drafts are dropped")]
PMin = Annotated[float, typer.Option(help="stop drafting below this confidence")]
Adaptive = Annotated[bool, typer.Option(help=SpecSettings.model_fields["adaptive"].description)]
RollbackDepth = Annotated[int | None, typer.Option(
    help="direct rollback depth D (default: N)")]
#: ``submit`` runs on a worker whose N and D were fixed when it loaded: unset = the worker's.
WorkerDraftMax = Annotated[int | None, typer.Option(
    "--draft-max", help="draft width ceiling N, at most the worker's (default: the worker's)")]
WorkerRollbackDepth = Annotated[int | None, typer.Option(
    "--rollback-depth", help="require workers loaded with this rollback depth D")]
Logprobs = Annotated[int | None, typer.Option(
    "--logprobs", metavar="N", min=0, max=MAX_TOP_LOGPROBS,
    help="return each generated token's log probability and its N most likely alternatives "
         "(0: the token's own only; default: off)")]

# -- a model on a device: generate, fit, worker --------------------------------------------
ModelFile = Annotated[Path, typer.Option("--model", help="GGUF model file")]
Device = Annotated[str, typer.Option(
    help="cpu, cuda:N, or CUDA devices in the model's order: cuda:0,cuda:1 (pinned before "
         "llama.cpp loads)")]
# A worker over several devices (docs/fitter.md, "Device groups").
Rpc = Annotated[str | None, typer.Option(
    "--rpc", help="RPC devices HOST:PORT,... (python -m worker.service.rpc_device, or "
                  "llama.cpp's rpc-server): they follow --device in the model's order")]
SplitModeOption = Annotated[str, typer.Option(
    "--split-mode", help="how a group splits the model: layer (whole layers by --tensor-split), "
                         "row (CUDA only) or none (all on the first device)")]
TensorSplit = Annotated[str | None, typer.Option(
    "--tensor-split", help="share of layers per device that takes them, e.g. 3,1 "
                           "(default: by each device's free memory)")]
BudgetMib = Annotated[str | None, typer.Option(
    help="memory to fit into, MiB: one figure, or one per device of a group "
         "(default: what each device reports free)")]
FitTargetMib = Annotated[str, typer.Option(
    help="margin the fitter leaves free, MiB: one figure, or one per device of a group")]
CtxMin = Annotated[int, typer.Option(min=1, help="refuse to fit less context than this")]
Checkpoint = Annotated[CheckpointMode, typer.Option(help="compact-rollback checkpoint storage")]
Threads = Annotated[int, typer.Option(min=1, help="CPU threads")]
PrefixCache = Annotated[str, typer.Option(
    help="'on': a finished slot keeps its tokens for the next request sharing their prefix "
         "(docs/engine.md, Prefix reuse); 'off': every request is prefilled from its first "
         "token")]
PrefixCheckpoints = Annotated[int, typer.Option(
    min=0, max=64, help="prefix checkpoints kept per slot for sliding-window and recurrent "
                        "models (host memory, in the fit report)")]
Slots = Annotated[str, typer.Option(
    help="sequences served at once, or 'auto': the most that fit --ctx (or --ctx-min) each")]
#: ``worker`` and ``fit`` check a fixed context the same way (worker/fitter/fit.py).
FixedCtx = Annotated[int | None, typer.Option(
    # llama.cpp's n_ctx is a uint32 that ctypes would silently wrap: bounded at the edge.
    "--ctx", min=2, max=2**31 - 1, help="fixed context size in tokens (checked against the "
    "model and the measured memory instead of fitted)")]
AllowCtxAboveTrain = Annotated[bool, typer.Option(
    help="allow a --ctx beyond the model's training context")]
RedisUrl = Annotated[str | None, typer.Option(
    "--redis", help="Redis URL", envvar=list(REDIS_URL_VARIABLES))]
AsJson = Annotated[bool, typer.Option("--json", help="print one JSON object")]

# -- sampling: one option per SamplingParams field -------------------------------------------
#: Help of each sampling option; the stages apply in this order (SamplingParams' docstring).
_SAMPLING_HELP: dict[str, str] = {
    "temperature": "sampling temperature, 0-2 (0: greedy; sampling works with every --spec "
                   "and speculation keeps the distribution)",
    "top_k": "keep only the K most likely tokens (0: off)",
    "top_p": "keep the smallest set of most likely tokens whose probability reaches P, "
             "0 < P <= 1 (1: off)",
    "min_p": "drop tokens below P times the most likely token's probability, 0-1 (0: off)",
    "repetition_penalty": "divide a seen token's positive logit by R, multiply a negative one, "
                          "prompt and output, 0 < R <= 10 (1: off)",
    "presence_penalty": "subtract this from the logit of every token already generated, "
                        "-2..2 (0: off)",
    "frequency_penalty": "subtract this per occurrence of a token in the output so far, "
                         "-2..2 (0: off)",
    "seed": "sampling seed: the same request and seed give the same tokens "
            "(default: a random one, reported back)",
}
#: SamplingParams fields with no one-flag form (a mapping): request bodies carry them.
NO_OPTION = frozenset({"logit_bias"})
if set(_SAMPLING_HELP) | NO_OPTION != set(SamplingParams.model_fields):  # pragma: no cover
    raise RuntimeError("coordinator/cli/options.py: every SamplingParams field needs an "
                       f"option; missing {set(SamplingParams.model_fields) - set(_SAMPLING_HELP)}")


def _sampling_parameters() -> list[inspect.Parameter]:
    params = []
    for name, info in SamplingParams.model_fields.items():
        if name in NO_OPTION:
            continue
        params.append(inspect.Parameter(
            name, inspect.Parameter.KEYWORD_ONLY, default=info.default,
            annotation=Annotated[info.annotation, typer.Option(help=_SAMPLING_HELP[name],
                                                    rich_help_panel="Sampling")]))
    return params


_SAMPLING_PARAMETERS = _sampling_parameters()

F = TypeVar("F", bound=Callable[..., Any])


def sampling_options(command: F) -> F:
    """Give ``command`` the sampling options (``--temperature`` ... ``--seed``), passed to it
    as one ``sampling`` dict of the values given on the command line (unvalidated: hand it to
    :func:`build_request`, which names a bad one by its option)."""
    signature = inspect.signature(command, eval_str=True)
    own = [p for p in signature.parameters.values() if p.name != "sampling"]

    @functools.wraps(command)
    def with_sampling(*args: Any, **kwargs: Any) -> Any:
        values = {p.name: kwargs.pop(p.name) for p in _SAMPLING_PARAMETERS}
        given = {k: v for k, v in values.items() if v != SamplingParams.model_fields[k].default}
        return command(*args, sampling=given, **kwargs)

    with_sampling.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[*own, *_SAMPLING_PARAMETERS])
    with_sampling.__annotations__ = {
        **{k: v for k, v in command.__annotations__.items() if k != "sampling"},
        **{p.name: p.annotation for p in _SAMPLING_PARAMETERS}}
    return with_sampling  # type: ignore[return-value]


# -- drafting: the speculative options, defined once --------------------------------------------
@dataclass(frozen=True)
class Drafting:
    """The drafting options of one command line: what an engine is loaded for (``worker``,
    ``fit``, ``generate``: :meth:`capacity`) and what a request asks (``generate``,
    ``submit``: :meth:`speculative`). ``draft_max`` and ``rollback_depth`` None: the
    default (loading), or "the worker's" (a request: ``shared/capacity.py``)."""

    method: SpecMethod
    draft_max: int | None
    rollback_depth: int | None
    draft_min: int = DEFAULT_SPEC.draft_min
    p_min: float = DEFAULT_SPEC.p_min
    adaptive: bool = DEFAULT_SPEC.adaptive

    def capacity(self) -> dict[str, Any]:
        """``EngineCapacity``'s arguments (``worker/launch.py``): what an engine loads for."""
        return {"method": self.method, "draft_max": self.draft_max,
                "rollback_depth": self.rollback_depth}

    def speculative(self) -> dict[str, Any]:
        """The request's ``speculative`` object (unset N and D left out)."""
        return {"method": self.method, "draft_min": self.draft_min, "p_min": self.p_min,
                "adaptive": self.adaptive,
                **{k: v for k, v in (("draft_max", self.draft_max),
                                     ("rollback_depth", self.rollback_depth))
                   if v is not None}}


def _drafting_parameters(kind: Literal["load", "request", "fleet"]) -> list[inspect.Parameter]:
    """The options of :func:`drafting_options`: a loading command's three, a request's six;
    a fleet request's N and D default to the worker's."""
    draft_max, depth = ((WorkerDraftMax, WorkerRollbackDepth) if kind == "fleet"
                        else (DraftMax, RollbackDepth))
    options: list[tuple[str, Any, Any]] = [
        ("spec", Spec, DEFAULT_SPEC.method), ("draft_max", draft_max, None),
        ("rollback_depth", depth, None if kind == "fleet" else DEFAULT_SPEC.rollback_depth)]
    if kind != "load":
        options += [("draft_min", DraftMin, DEFAULT_SPEC.draft_min),
                    ("p_min", PMin, DEFAULT_SPEC.p_min),
                    ("adaptive", Adaptive, DEFAULT_SPEC.adaptive)]
    return [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                              annotation=annotation) for name, annotation, default in options]


def drafting_options(kind: Literal["load", "request", "fleet"]) -> Callable[[F], F]:
    """Give ``command`` the drafting options (``--spec``, ``--draft-max``, ... as ``kind``
    has them), passed to it as one ``drafting`` :class:`Drafting`."""
    parameters = _drafting_parameters(kind)

    def decorate(command: F) -> F:
        signature = inspect.signature(command, eval_str=True)
        own = [p for p in signature.parameters.values() if p.name != "drafting"]

        @functools.wraps(command)
        def with_drafting(*args: Any, **kwargs: Any) -> Any:
            values = {p.name: kwargs.pop(p.name) for p in parameters}
            values["method"] = values.pop("spec")
            return command(*args, drafting=Drafting(**values), **kwargs)

        keyword = [p for p in own if p.kind is inspect.Parameter.KEYWORD_ONLY]
        positional = [p for p in own if p.kind is not inspect.Parameter.KEYWORD_ONLY]
        with_drafting.__signature__ = signature.replace(  # type: ignore[attr-defined]
            parameters=[*positional, *parameters, *keyword])
        with_drafting.__annotations__ = {
            **{k: v for k, v in command.__annotations__.items() if k != "drafting"},
            **{p.name: p.annotation for p in parameters}}
        return with_drafting  # type: ignore[return-value]
    return decorate


def sampling_line(sampling: SamplingParams, seed: int | None) -> str:
    """What a generation sampled with, for a person: the knobs set and the seed that
    reproduces it (``--seed``)."""
    knobs = [f"{name.replace('_', '-')} {value:g}"
             for name, value in sampling.model_dump(exclude={"seed", *NO_OPTION}).items()
             if value != getattr(DEFAULT_SAMPLING, name)]
    what = ", ".join(["greedy", *knobs] if sampling.greedy else knobs)
    return f"sampling: {what}; seed {seed} (--seed {seed} repeats it)"


def parse_tokens(raw: str) -> list[int]:
    """``--prompt-tokens 1,2,3`` as a list, or a one-line error."""
    try:
        tokens = [int(t) for t in raw.split(",") if t.strip()]
    except ValueError:
        fail(f"--prompt-tokens must be comma-separated integers, got {raw!r}")
    if not tokens:
        fail("--prompt-tokens is empty")
    return tokens


#: Request fields whose error is reported as the option that sets them.
_OPTION_OF: dict[tuple[str, ...], str] = {
    **{("sampling", name): f"--{name.replace('_', '-')}" for name in _SAMPLING_HELP},
    **{("speculative", name): f"--{name.replace('_', '-')}"
       for name in ("draft_max", "draft_min", "p_min", "rollback_depth")},
    ("max_tokens",): "--max-tokens",
    ("top_logprobs",): "--logprobs",
}


def _by_option(errors: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Pydantic's errors with each field that one option sets renamed to that option."""
    renamed = []
    for err in errors:
        loc = tuple(str(p) for p in err.get("loc", ()))
        renamed.append({**err, "loc": (_OPTION_OF[loc],) if loc in _OPTION_OF else loc})
    return renamed


def build_request(*, prompt: str | None, prompt_tokens: str | None, max_tokens: int,
                  drafting: Drafting, sampling: Mapping[str, Any] | None = None,
                  logprobs: int | None = None, model: str = "default",
                  stop: Sequence[str] = (),
                  priority: Priority = Priority.NORMAL) -> GenerationRequest:
    """The options as a request, or a one-line error naming every bad option.

    ``drafting`` holds the drafting options (:func:`drafting_options`), ``sampling`` the
    sampling options given (:func:`sampling_options`); ``logprobs`` None is off, N returns N
    alternatives a token."""
    try:
        return GenerationRequest.model_validate({
            "model": model, "prompt": prompt,
            "prompt_tokens": parse_tokens(prompt_tokens) if prompt_tokens is not None else None,
            "max_tokens": max_tokens, "stop": list(stop), "priority": priority,
            "sampling": dict(sampling or {}),
            "logprobs": logprobs is not None, "top_logprobs": logprobs or 0,
            "speculative": drafting.speculative()})
    except ValidationError as exc:
        fail(describe_validation_error(_by_option(exc.errors(include_url=False))))
