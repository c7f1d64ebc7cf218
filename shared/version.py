"""The one version string there is: the installed distribution's metadata.

``pyproject.toml`` sets it and nothing in the code repeats it; ``specfleet --version`` and a
worker's registration both read it here.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def package_version() -> str:
    """specfleet's version, or ``"unknown"`` when the code runs from a tree never installed."""
    try:
        return version("specfleet")
    except PackageNotFoundError:
        return "unknown"
