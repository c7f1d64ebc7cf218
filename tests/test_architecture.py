"""docs/architecture.md's repository layout is the tree's: every module of ``shared/``,
``worker/``, ``coordinator/`` and ``bench/`` is named under its folder, and every module it
names exists. A new module fails here with the line to add.

The layout is the first code block after "## Repository layout". A line that starts in the
first column names a folder (its first word); a ``sub/`` word on a line opens that subfolder
for the rest of the line and for the lines indented past the column it starts at. Text in
parentheses is prose. Every ``name.py`` or ``name.sh`` word outside it names a module.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
#: The folders whose every module the layout must name.
COVERED = ("shared", "worker", "coordinator", "bench")
_MODULE = re.compile(r"[\w-]+\.(?:py|sh)")
_FOLDER = re.compile(r"[\w.-]+/")


def layout_block(text: str) -> list[str]:
    after = text[text.index("## Repository layout"):]
    start = after.index("```\n") + 4
    return after[start:after.index("```", start)].splitlines()


def _without_prose(lines: list[str]) -> list[str]:
    """Each line with parenthesised text blanked (columns kept; parentheses span lines)."""
    depth, out = 0, []
    for line in lines:
        chars = []
        for ch in line:
            if ch == "(":
                depth += 1
            chars.append(" " if depth else ch)
            if ch == ")" and depth:
                depth -= 1
        out.append("".join(chars))
    return out


def named_modules(lines: list[str]) -> set[str]:
    """Repository paths of the modules the layout names."""
    named: set[str] = set()
    scopes: list[tuple[int, str]] = []
    for line in _without_prose(lines)[1:]:  # the first line: top-level files
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if indent == 0:
            folder = line.split()[0]
            scopes = [(-1, folder)]
            line = " " * len(folder) + line[len(folder):]
        else:
            while len(scopes) > 1 and scopes[-1][0] >= indent:
                scopes.pop()
        for word in re.finditer(r"\S+", line):
            token = word.group().strip(",;:+")
            if _FOLDER.fullmatch(token):
                while len(scopes) > 1 and scopes[-1][0] >= word.start():
                    scopes.pop()
                scopes.append((word.start(), scopes[-1][1] + token))
            elif _MODULE.fullmatch(token):
                named.add(scopes[-1][1] + token)
    return named


def tree_modules(root: Path = ROOT) -> set[str]:
    return {p.relative_to(root).as_posix() for folder in COVERED
            for p in (root / folder).rglob("*") if _MODULE.fullmatch(p.name)
            and p.name not in ("__init__.py", "__main__.py") and "__pycache__" not in p.parts}


def test_every_module_is_in_the_layout_and_every_named_one_exists() -> None:
    named = named_modules(layout_block(DOC.read_text()))
    missing = sorted(tree_modules() - named)
    assert not missing, ("docs/architecture.md's layout does not name these modules; add each "
                         f"under its folder with what it is for: {missing}")
    gone = sorted(p for p in named if not (ROOT / p).is_file())
    assert not gone, f"docs/architecture.md's layout names modules that do not exist: {gone}"


def test_the_parser_reads_folders_subfolders_and_prose() -> None:
    lines = [
        "top.toml",
        "pkg/          a.py (b.py is prose,",
        "              and so is c.py) d.sh",
        "              sub/  e.py",
        "                    f.py",
        "              g.py  inner/ (h.py) i.py",
        "other/x/      j.py",
    ]
    assert named_modules(lines) == {"pkg/a.py", "pkg/d.sh", "pkg/sub/e.py", "pkg/sub/f.py",
                                    "pkg/g.py", "pkg/inner/i.py", "other/x/j.py"}
