"""The package layers: ``shared`` is the bottom, ``worker`` and ``coordinator`` sit on it.

The wire contract (protocol, keys, event stream, cancel flag, registry) lives in ``shared`` so
that a coordinator can be deployed without the worker (no llama.cpp) and a worker never
depends on coordinator code. The only coordinator modules that may import ``worker`` are the
commands that run worker code in-process. Every import statement of every module counts,
including those inside functions and ``TYPE_CHECKING`` blocks: a lazy import is still a
dependency. The picture is in ``docs/architecture.md`` ("Package layers").
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("shared", "worker", "coordinator")

#: Which top-level packages each package must never import.
FORBIDDEN: dict[str, frozenset[str]] = {
    "shared": frozenset({"worker", "coordinator"}),
    "worker": frozenset({"coordinator"}),
    "coordinator": frozenset({"worker"}),
}

#: Coordinator modules that run worker code in-process and so may import ``worker``.
ALLOWED: dict[str, frozenset[str]] = {
    "worker": frozenset({
        "coordinator/cli/worker.py",  # specfleet worker: the worker process itself
        "coordinator/cli/fit.py",  # specfleet fit: loads the model to measure it
        "coordinator/cli/generate.py",  # specfleet generate: the engine without Redis
        "coordinator/demo.py",  # make demo: finds the demo model, starts a worker
    }),
}


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """``(line, absolute module name)`` of every import in the file, relative ones resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _module_name(path, root).split(".")
    if path.name != "__init__.py":
        package.pop()
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            if node.module:
                found.append((node.lineno, ".".join([*base, node.module])))
            else:  # ``from . import name``: each name is a module of ``base``
                found.extend((node.lineno, ".".join([*base, alias.name]))
                             for alias in node.names)
    return sorted(found)


def layer_violations(root: Path = ROOT) -> list[str]:
    """``file:line imports module`` for every import that points the wrong way."""
    violations = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            where = path.relative_to(root).as_posix()
            for line, module in imported_modules(path, root):
                top = module.split(".")[0]
                if top in FORBIDDEN[package] and where not in ALLOWED.get(top, frozenset()):
                    violations.append(f"{where}:{line} imports {module}")
    return violations


def test_every_package_imports_only_the_layers_below_it() -> None:
    assert layer_violations() == []


def test_the_walk_sees_every_kind_of_import(tmp_path: Path) -> None:
    """The checker itself, on a scratch tree: plain, from-, relative and function-local
    imports all count, and only the listed coordinator modules may import ``worker``."""
    for package in PACKAGES:
        (tmp_path / package / "cli").mkdir(parents=True)
    (tmp_path / "shared" / "probe.py").write_text(
        "import coordinator.client\n"
        "from worker.llm import model\n"
        "from . import keys\n"
        "def lazy():\n"
        "    from worker.engine import engine\n")
    (tmp_path / "worker" / "cli" / "probe.py").write_text(
        "from .. import llm\n"  # worker.llm: relative imports resolve inside the package
        "from coordinator.batch import BatchStore\n")
    (tmp_path / "coordinator" / "client.py").write_text("import worker.service.events\n")
    (tmp_path / "coordinator" / "cli" / "worker.py").write_text("import worker.service\n")
    assert layer_violations(tmp_path) == [
        "shared/probe.py:1 imports coordinator.client",
        "shared/probe.py:2 imports worker.llm",
        "shared/probe.py:5 imports worker.engine",
        "worker/cli/probe.py:2 imports coordinator.batch",
        "coordinator/client.py:1 imports worker.service.events",
    ]


def test_allowed_exceptions_still_exist() -> None:
    """An exception for a module that was renamed or removed would silently allow nothing."""
    missing = [p for paths in ALLOWED.values() for p in paths if not (ROOT / p).is_file()]
    assert missing == []
