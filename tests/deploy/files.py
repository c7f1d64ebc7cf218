"""Reading the deployment files the way their tools do: compose.yaml with Compose's variable
interpolation, docker/Dockerfile as instructions grouped into stages, the env example."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose.yaml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
ENV_EXAMPLE = ROOT / "docker" / "env.example"

# Compose interpolation: $$ (a literal $), ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?err}
_VARIABLE = re.compile(r"\$\$|\$\{(?P<name>\w+)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}")


def compose_schema() -> dict[str, Any]:
    """The Compose Specification JSON schema, as check-jsonschema vendors it."""
    vendor = files("check_jsonschema.builtin_schemas.vendor")
    return json.loads(vendor.joinpath("compose-spec.json").read_text())


def raw_compose() -> dict[str, Any]:
    """compose.yaml as YAML (anchors and ``<<`` merges resolved), variables not yet replaced."""
    return yaml.safe_load(COMPOSE.read_text())


def compose_variables() -> set[str]:
    """Every variable compose.yaml interpolates."""
    return {m["name"] for m in _VARIABLE.finditer(COMPOSE.read_text()) if m["name"]}


class MissingVariable(ValueError):
    """A ``${VAR:?message}`` whose variable is unset or empty (compose refuses to start)."""


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """``value`` with Compose's interpolation applied to every string in it."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def replace(match: re.Match[str]) -> str:
        if match[0] == "$$":
            return "$"
        name, op, arg = match["name"], match["op"], match["arg"] or ""
        current = env.get(name)
        unset = current is None or (op is not None and op.startswith(":") and current == "")
        if op in (":?", "?") and unset:
            raise MissingVariable(f"{name}: {arg}")
        if op in (":-", "-") and unset:
            return arg
        return current or ""

    return _VARIABLE.sub(replace, value)


def env_example() -> dict[str, str]:
    """The variables docker/env.example sets (KEY=value lines)."""
    pairs = (line.split("=", 1) for line in ENV_EXAMPLE.read_text().splitlines()
             if line and not line.startswith("#") and "=" in line)
    return {k.strip(): v.strip() for k, v in pairs}


def command_argv(command: str | list[str]) -> list[str]:
    """A compose ``command`` as the argv the container runs (a string is split like sh)."""
    return shlex.split(command) if isinstance(command, str) else list(command)


@dataclass
class Instruction:
    keyword: str
    args: str
    line: int

    def exec_form(self) -> list[str] | None:
        """The JSON array of an exec-form CMD/ENTRYPOINT/HEALTHCHECK CMD, else None."""
        text = self.args
        if self.keyword == "HEALTHCHECK":
            text = re.sub(r"^(--\S+\s+)*CMD\s+", "", text)
        try:
            argv = json.loads(text)
        except json.JSONDecodeError:
            return None
        return argv if isinstance(argv, list) else None


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def last(self, keyword: str) -> Instruction | None:
        found = self.all(keyword)
        return found[-1] if found else None


GLOBAL = "(global)"


def dockerfile_stages(path: Path = DOCKERFILE) -> dict[str, Stage]:
    """The Dockerfile's stages by name, each with its instructions (continuations joined)."""
    stages: dict[str, Stage] = {GLOBAL: Stage(GLOBAL, "")}  # ARGs before the first FROM
    current = stages[GLOBAL]
    logical, start = "", 0
    for number, line in enumerate(path.read_text().splitlines(), 1):
        stripped = line.strip()
        if not logical and (not stripped or stripped.startswith("#")):
            continue
        if logical and stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        logical, start = (logical + " " + stripped, start) if logical else (stripped, number)
        if logical.endswith("\\"):
            logical = logical[:-1].rstrip()
            continue
        keyword, _, args = logical.partition(" ")
        logical = ""
        instruction = Instruction(keyword.upper(), args.strip(), start)
        if instruction.keyword == "FROM":
            parts = re.split(r"\s+as\s+", instruction.args, flags=re.I)
            base, name = parts[0], parts[1] if len(parts) > 1 else str(len(stages))
            current = stages[name] = Stage(name, base)
        else:
            current.instructions.append(instruction)
    return stages
