"""The package layers: ``shared`` is the bottom, ``worker`` and ``coordinator`` sit on it.

The wire contract (protocol, keys, event stream, cancel flag, registry) lives in ``shared`` so
that a coordinator can be deployed without the worker (no llama.cpp) and a worker never
depends on coordinator code. The only coordinator modules that may import ``worker`` are the
commands that run worker code in-process. Every import statement of every module counts,
including those inside functions and ``TYPE_CHECKING`` blocks: a lazy import is still a
dependency. The picture is in ``docs/architecture.md`` ("Package layers"). Within the layers,
no two modules import each other, directly or around a circle: a circle means neither can be
read, tested or moved alone (a value both need belongs in a leaf module below them). The same
holds for folders: no folder's modules import a folder that imports them back, its own
parent included (a subpackage that reaches up into the package around it is one knot with
it: ``worker/engine/core`` holds the leaf types every engine folder shares instead).
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


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the project modules it imports. An import names the most specific module of
    the tree it reaches (``from a.b import c`` is ``a.b.c`` when that is a module, else
    ``a.b``); a package's ``__init__`` counts only when it is the module named."""
    paths = {_module_name(p, root): p for package in PACKAGES
             for p in (root / package).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        edges = set()
        for _, name in imported_modules(path, root):
            while name and name not in paths:
                name = name.rpartition(".")[0]
            if name and name != module:
                edges.add(name)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                edges.update(f"{node.module}.{a.name}" for a in node.names
                             if f"{node.module}.{a.name}" in paths)
        graph[module] = edges - {module}
    return graph


def folder_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Folder -> the other project folders its modules import (a package's own modules and
    its subpackages are different folders: ``worker/engine`` and ``worker/engine/core``)."""
    graph: dict[str, set[str]] = {}
    for module, imports in import_graph(root).items():
        here = _folder(module, root)
        graph.setdefault(here, set()).update(
            folder for folder in (_folder(m, root) for m in imports) if folder != here)
    return graph


def _folder(module: str, root: Path) -> str:
    path = root.joinpath(*module.split("."))
    return (path.relative_to(root) if path.is_dir() else path.parent.relative_to(root)).as_posix()


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The modules that reach each other, one sorted group a circle (strongly connected
    components of more than one module, Tarjan's algorithm without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        found.append(sorted(group))
    return found


def test_no_modules_import_each_other_around_a_circle() -> None:
    assert circles(import_graph()) == []


def test_no_folders_import_each_other_around_a_circle() -> None:
    assert circles(folder_graph()) == []


def test_the_folder_check_finds_a_subpackage_that_reaches_up(tmp_path: Path) -> None:
    for package in PACKAGES:
        (tmp_path / package).mkdir()
    (tmp_path / "worker" / "engine" / "proposers").mkdir(parents=True)
    (tmp_path / "worker" / "engine" / "core").mkdir()
    (tmp_path / "worker" / "engine" / "engine.py").write_text(
        "from worker.engine.proposers import suffix\n")
    (tmp_path / "worker" / "engine" / "costs.py").write_text("import numpy\n")
    (tmp_path / "worker" / "engine" / "proposers" / "suffix.py").write_text(
        "from worker.engine.costs import x\nfrom worker.engine.core.draft import Draft\n")
    (tmp_path / "worker" / "engine" / "core" / "draft.py").write_text("import numpy\n")
    assert circles(folder_graph(tmp_path)) == [["worker/engine", "worker/engine/proposers"]]
    (tmp_path / "worker" / "engine" / "proposers" / "suffix.py").write_text(
        "from worker.engine.core.draft import Draft\n")
    assert circles(folder_graph(tmp_path)) == []


def test_the_circle_check_finds_direct_and_longer_circles(tmp_path: Path) -> None:
    for package in PACKAGES:
        (tmp_path / package).mkdir()
    (tmp_path / "worker" / "a.py").write_text("from worker.b import B\n")
    (tmp_path / "worker" / "b.py").write_text("def f():\n    from worker import a\n")
    (tmp_path / "worker" / "c.py").write_text("import worker.d\n")
    (tmp_path / "worker" / "d.py").write_text("import worker.e\n")
    (tmp_path / "worker" / "e.py").write_text("from worker.c import x\nimport worker.a\n")
    (tmp_path / "worker" / "leaf.py").write_text("import numpy\n")
    (tmp_path / "shared" / "top.py").write_text("from worker import leaf\n")
    assert circles(import_graph(tmp_path)) == [
        ["worker.a", "worker.b"], ["worker.c", "worker.d", "worker.e"]]


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
