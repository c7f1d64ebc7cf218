"""The root Typer application and helpers shared by every sub-command."""

from __future__ import annotations

import sys
from typing import Annotated, NoReturn

import typer
from pydantic import ValidationError

from shared.protocol import describe_validation_error
from shared.redact import redact
from shared.settings import Settings, get_settings
from shared.version import package_version

app = typer.Typer(
    name="specfleet",
    help="Speculative LLM decoding on a fleet of GPU workers behind Redis.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def error_line(message: str) -> None:
    """Write one CLI error line on stderr (what operators and scripts expect), credentials
    masked: an exception's text may embed a Redis URL with its password."""
    sys.stderr.write(f"specfleet: error: {redact(' '.join(message.split()))}\n")


def fail(message: str, code: int = 2) -> NoReturn:
    """Exit non-zero with a one-line message on stderr."""
    error_line(message)
    raise typer.Exit(code)


def fail_redis(settings: Settings, exc: Exception) -> NoReturn:
    """Exit 3 naming the Redis that failed (user and host kept, password masked) and why."""
    fail(f"Redis at {redact(settings.redis_url)}: {exc}", code=3)


def environment_settings() -> Settings:
    """The process's settings (``SPECFLEET_*``, ``REDIS_URL``), or a one-line error naming
    every bad variable."""
    try:
        return get_settings()
    except ValidationError as exc:
        fail(f"invalid SPECFLEET_* environment: {describe_validation_error(exc)}")


def _print_version(requested: bool) -> None:
    """``--version``, eager: it answers before any sub-command is required or settings read."""
    if requested:
        typer.echo(f"specfleet {package_version()}")
        raise typer.Exit()


@app.callback()
def _root(
    show_version: Annotated[bool, typer.Option(
        "--version", callback=_print_version, is_eager=True,
        help="print the version and exit")] = False,
) -> None:
    """Speculative LLM decoding on a fleet of GPU workers behind Redis."""
