"""The ``specfleet`` command line: one sub-command a module, registered on one Typer app and
imported only when its command runs (``app.COMMANDS``)."""

from __future__ import annotations

import sys

import typer
from pydantic import ValidationError

from coordinator.cli.app import app, error_line
from shared.protocol import describe_validation_error

#: click's ``UsageError`` (a bad option value, a missing or unknown option), reached through
#: typer's public ``BadParameter`` because newer typers vendor click under a private module.
_UsageError = next(c for c in typer.BadParameter.__mro__
                   if issubclass(c, Exception) and c.__name__ == "UsageError")


def main() -> None:
    """Entry point of the ``specfleet`` console script.

    Usage errors end like every other CLI error: one line on stderr, exit status 2 (typer
    would print a usage block and a boxed message); a bare ``specfleet`` prints the help.
    """
    try:
        code = app(standalone_mode=False)
    except _UsageError as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":
            exc.show()  # type: ignore[attr-defined]
        else:
            if isinstance(exc.__cause__, ValidationError):  # typer coerces through pydantic
                exc.message = describe_validation_error(exc.__cause__, subject=None)  # type: ignore[attr-defined]
            ctx = getattr(exc, "ctx", None)
            where = f" (see {ctx.command_path} --help)" if ctx is not None else ""
            error_line(exc.format_message() + where)  # type: ignore[attr-defined]
        code = exc.exit_code  # type: ignore[attr-defined]
    except typer.Abort:
        error_line("aborted")
        code = 1
    sys.exit(code if isinstance(code, int) else 0)
