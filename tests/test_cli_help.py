"""What ``specfleet --version`` and every ``--help`` tell a user.

The help of every command is rendered in-process (Typer's runner: the same parser and
formatter the console script uses); ``--version`` runs the installed console script, since the
version it prints comes from the installed distribution's metadata.
"""

from __future__ import annotations

import os
import re
from importlib.metadata import version

import pytest
import typer
from helpers import specfleet
from typer.testing import CliRunner

from coordinator.cli import app
from coordinator.cli.options import NO_OPTION
from shared.protocol import SamplingParams
from shared.settings import REDIS_URL_VARIABLES

#: Internal references that mean nothing to a user (design notes, issue numbers).
INTERNAL = re.compile(r"\bseed\s*\d{3}\b|\bissue\s*#?\d+\b", re.IGNORECASE)


def _command_paths() -> list[list[str]]:
    """Every command and sub-command as the argv that reaches it (``[]``: the root)."""
    paths: list[list[str]] = [[]]
    # Groups by their ``commands``: newer typers vendor click under a private module.
    for name, command in typer.main.get_command(app).commands.items():
        paths.append([name])
        paths.extend([name, sub] for sub in getattr(command, "commands", {}))
    return paths


def _words(text: str) -> str:
    """Help text without the panels' box drawing, one space between words."""
    return " ".join(re.sub(r"[\u2500-\u257f]", " ", text).split())


def _help(path: list[str]) -> str:
    result = CliRunner().invoke(app, [*path, "--help"])
    assert result.exit_code == 0, result.output
    return _words(result.output)


def test_version_is_the_installed_distributions() -> None:
    proc = specfleet("--version", timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"specfleet {version('specfleet')}\n"


@pytest.mark.parametrize("path", _command_paths(), ids=lambda p: " ".join(p) or "root")
def test_help_has_no_internal_references(path: list[str]) -> None:
    text = _help(path)
    assert INTERNAL.search(text) is None, text


def test_the_redis_option_names_the_variables_that_also_set_it() -> None:
    """``worker --redis`` falls back to the variables the settings read the URL from; the
    help names them and never shows the URL's password."""
    env = {**os.environ, "REDIS_URL": "redis://ops:hunter2secret@redis.internal:6379/0",
           "TERMINAL_WIDTH": "200"}  # wide enough that rich does not cut the names short
    proc = specfleet("worker", "--help", env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    text = _words(proc.stdout)
    assert f"Redis URL [env var: {', '.join(REDIS_URL_VARIABLES)}]" in text
    assert "hunter2secret" not in proc.stdout + proc.stderr


def _options(path: list[str]) -> dict[str, str]:
    """A command's options by name, each with its help line (``typer``'s click command)."""
    command = typer.main.get_command(app)
    for name in path:
        command = command.commands[name]  # type: ignore[attr-defined]
    return {opt: param.help or "" for param in command.params
            for opt in getattr(param, "opts", []) if opt.startswith("--")}


def test_generate_and_submit_take_the_same_sampling_options() -> None:
    """Declared once (``coordinator/cli/options.py``, one option per ``SamplingParams``
    field but those with no one-flag form): the two commands that describe a generation show
    them identically."""
    sampling = {f"--{name.replace('_', '-')}" for name in SamplingParams.model_fields
                if name not in NO_OPTION}
    generate, submit = _options(["generate"]), _options(["submit"])
    for option in [*sorted(sampling), "--logprobs"]:
        assert option in generate and generate[option] == submit[option], option
    assert "greedy" in generate["--temperature"] and "--spec none" not in generate["--temperature"]


def test_the_model_options_read_the_same_in_fit_and_worker() -> None:
    fit, worker = _options(["fit"]), _options(["worker"])
    for option in ("--model", "--device", "--budget-mib", "--fit-target-mib", "--ctx-min",
                   "--ctx", "--spec", "--draft-max", "--rollback-depth", "--checkpoint",
                   "--threads", "--slots"):
        assert fit[option] == worker[option], option
