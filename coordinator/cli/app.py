"""The root Typer application and helpers shared by every sub-command.

Sub-commands load lazily: the root group knows each one's module (:data:`COMMANDS`) and
imports only the one a command line names, so ``specfleet submit`` never loads llama.cpp and
``specfleet worker`` never loads the HTTP gateway (docs/architecture.md, "Package layers");
only the root ``--help``, which lists them all, imports every module.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Annotated, Any, NoReturn

import typer
from pydantic import ValidationError
from typer.core import TyperGroup

from shared.protocol import describe_validation_error
from shared.redact import redact
from shared.settings import Settings, get_settings
from shared.version import package_version

#: Every sub-command, in the order the help lists them, and the module under coordinator/cli/
#: that registers it on :data:`app` when imported.
COMMANDS = {
    "generate": "generate", "worker": "worker", "submit": "submit", "fleet": "fleet",
    "cancel": "cancel", "batch": "batch", "fit": "fit", "monitor": "monitor", "top": "top",
    "serve": "serve", "models": "models",
}


class _Commands(MutableMapping[str, Any]):
    """The root group's commands by name: every name of :data:`COMMANDS` is listed, and a
    command's module is imported the first time the command itself is looked up."""

    def __init__(self, registered: Mapping[str, Any]) -> None:
        self._loaded = dict(registered)

    def __getitem__(self, name: str) -> Any:
        if name not in self._loaded:
            if name not in COMMANDS:
                raise KeyError(name)
            importlib.import_module(f"coordinator.cli.{COMMANDS[name]}")
            # the click command, built from what the module registered on ``app``
            self._loaded[name] = typer.main.get_command(app).commands[name]  # type: ignore[attr-defined]
        return self._loaded[name]

    def __setitem__(self, name: str, command: Any) -> None:
        self._loaded[name] = command

    def __delitem__(self, name: str) -> None:
        del self._loaded[name]

    def __iter__(self) -> Iterator[str]:
        return iter({**dict.fromkeys(COMMANDS), **self._loaded})

    def __len__(self) -> int:
        return len({**dict.fromkeys(COMMANDS), **self._loaded})


class _LazyGroup(TyperGroup):
    """The root group, its commands loaded on demand (:class:`_Commands`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.commands = _Commands(self.commands)


app = typer.Typer(
    cls=_LazyGroup,
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
