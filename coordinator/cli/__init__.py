"""The ``specfleet`` command line: one sub-command a module, registered on one Typer app."""

from __future__ import annotations

from coordinator.cli.app import app

# Each import registers its sub-commands on ``app``.
from coordinator.cli import generate  # noqa: E402,F401  isort: skip
from coordinator.cli import worker  # noqa: E402,F401  isort: skip
from coordinator.cli import submit  # noqa: E402,F401  isort: skip
from coordinator.cli import fleet  # noqa: E402,F401  isort: skip
from coordinator.cli import cancel  # noqa: E402,F401  isort: skip
from coordinator.cli import batch  # noqa: E402,F401  isort: skip
from coordinator.cli import fit  # noqa: E402,F401  isort: skip


def main() -> None:
    """Entry point of the ``specfleet`` console script."""
    app()
