"""Command-line options shared by the sub-commands that describe one generation.

``generate`` (in-process) and ``submit`` (through the fleet) take the same prompt and
speculation options; declaring them once keeps their names, defaults and help identical, and
:func:`build_request` turns them into one validated :class:`GenerationRequest`, so both
commands enforce exactly the wire protocol's rules (one prompt, greedy-only speculation, ...).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

import typer
from pydantic import ValidationError

from coordinator.cli.app import fail
from shared.protocol import (
    GenerationRequest,
    Priority,
    SpecMethod,
    SpecSettings,
    describe_validation_error,
)

#: The protocol's defaults, which the options show and fall back to.
DEFAULT_SPEC = SpecSettings()

MaxTokens = Annotated[int, typer.Option(min=1, help="tokens to generate at most")]
Prompt = Annotated[str | None, typer.Option(help="prompt text")]
PromptTokens = Annotated[str | None, typer.Option(help="prompt token ids: 1,2,3")]
Spec = Annotated[SpecMethod, typer.Option(help="drafting method")]
DraftMax = Annotated[int, typer.Option(help="draft width ceiling N")]
DraftMin = Annotated[int, typer.Option(help="shorter drafts are dropped")]
PMin = Annotated[float, typer.Option(help="stop drafting below this confidence")]
Adaptive = Annotated[bool, typer.Option(help=SpecSettings.model_fields["adaptive"].description)]
RollbackDepth = Annotated[int | None, typer.Option(help="direct rollback depth D")]
Slots = Annotated[str, typer.Option(
    help="sequences served at once, or 'auto': the most that fit --ctx (or --ctx-min) each")]
#: ``worker`` and ``fit`` check a fixed context the same way (worker/fitter/fit.py).
FixedCtx = Annotated[int | None, typer.Option(
    # llama.cpp's n_ctx is a uint32 that ctypes would silently wrap: bounded at the edge.
    "--ctx", min=2, max=2**31 - 1, help="fixed context size in tokens (checked against the "
    "model and the measured memory instead of fitted)")]
AllowCtxAboveTrain = Annotated[bool, typer.Option(
    help="allow a --ctx beyond the model's training context")]
#: ``submit`` runs on a worker whose N and D were fixed when it loaded: unset = the worker's.
WorkerDraftMax = Annotated[int | None, typer.Option(
    "--draft-max", help="draft width ceiling N, at most the worker's (default: the worker's)")]
WorkerRollbackDepth = Annotated[int | None, typer.Option(
    "--rollback-depth", help="require workers loaded with this rollback depth D")]
Temperature = Annotated[float, typer.Option(help="sampling temperature (needs --spec none)")]
Seed = Annotated[int, typer.Option(help="sampling seed")]


def parse_tokens(raw: str) -> list[int]:
    """``--prompt-tokens 1,2,3`` as a list, or a one-line error."""
    try:
        tokens = [int(t) for t in raw.split(",") if t.strip()]
    except ValueError:
        fail(f"--prompt-tokens must be comma-separated integers, got {raw!r}")
    if not tokens:
        fail("--prompt-tokens is empty")
    return tokens


def build_request(*, prompt: str | None, prompt_tokens: str | None, max_tokens: int,
                  spec: SpecMethod, draft_max: int | None, draft_min: int, p_min: float,
                  adaptive: bool, rollback_depth: int | None, temperature: float, seed: int,
                  model: str = "default", stop: Sequence[str] = (),
                  priority: Priority = Priority.NORMAL) -> GenerationRequest:
    """The options as a request, or a one-line error naming every bad field.

    ``draft_max`` and ``rollback_depth`` left None stay unset in the request, which means
    "the worker's" (``shared/capacity.py``)."""
    capacity = {k: v for k, v in (("draft_max", draft_max), ("rollback_depth", rollback_depth))
                if v is not None}
    try:
        return GenerationRequest(
            model=model, prompt=prompt,
            prompt_tokens=parse_tokens(prompt_tokens) if prompt_tokens is not None else None,
            max_tokens=max_tokens, temperature=temperature, seed=seed, stop=list(stop),
            priority=priority,
            speculative=SpecSettings(method=spec, draft_min=draft_min, p_min=p_min,
                                     adaptive=adaptive, **capacity))
    except ValidationError as exc:
        fail(describe_validation_error(exc))
