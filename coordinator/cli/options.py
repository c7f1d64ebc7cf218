"""Command-line options shared by the sub-commands that describe one generation.

``generate`` (in-process) and ``submit`` (through the fleet) take the same prompt and
speculation options; declaring them once keeps their names, defaults and help identical.
"""

from __future__ import annotations

from typing import Annotated

import typer

from coordinator.cli.app import fail
from shared.protocol import SpecMethod

MaxTokens = Annotated[int, typer.Option(min=1, help="tokens to generate at most")]
Prompt = Annotated[str | None, typer.Option(help="prompt text")]
PromptTokens = Annotated[str | None, typer.Option(help="prompt token ids: 1,2,3")]
Spec = Annotated[SpecMethod, typer.Option(help="drafting method")]
DraftMax = Annotated[int, typer.Option(help="draft width ceiling N")]
DraftMin = Annotated[int, typer.Option(help="shorter drafts are dropped")]
PMin = Annotated[float, typer.Option(help="stop drafting below this confidence")]
Adaptive = Annotated[bool, typer.Option(help="adapt the draft width (seed 003 rule)")]
RollbackDepth = Annotated[int | None, typer.Option(help="direct rollback depth D")]
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
