"""Parse a ``specfleet ...`` argv with the CLI's own parser, without running the command."""

from __future__ import annotations

from typing import Any

import pytest
import typer

from coordinator.cli import app


def parse_specfleet(argv: list[str]) -> dict[str, Any]:
    """The sub-command's parsed parameters; raises click's ``UsageError`` (unknown command or
    option, a value its type or range refuses, a missing required option) like the CLI would.

    The Typer app is resolved to its click group, the sub-command is looked up by name and
    ``make_context`` runs every option's conversion and validation but never the callback.
    A bare ``specfleet --help`` is accepted too (it prints the help and exits 0).
    """
    if not argv or argv[0] != "specfleet":
        raise ValueError(f"not a specfleet command: {argv!r}")
    group = typer.main.get_command(app)
    if argv[1:] == ["--help"]:
        with pytest.raises(typer.Exit) as done:  # help printed, exit 0: an accepted command
            group.make_context("specfleet", argv[1:])
        assert done.value.exit_code == 0
        return {"command": None}
    with group.make_context("specfleet", argv[1:]) as parent:
        name, command, rest = group.resolve_command(parent, argv[1:])
        assert command is not None and name is not None
        with command.make_context(name, rest, parent=parent) as ctx:
            return {"command": name, **ctx.params}
