"""What a generation is allowed to say: JSON (any object, or one JSON Schema), a grammar (Lark
or GBNF) or a regular expression, carried on the wire as the user gave it.

Both sides compile it with llguidance (docs/structured.md says why llguidance): the
coordinator without a vocabulary, to refuse what cannot compile with a message naming the
problem before anything is queued (:func:`check_constraint`); the worker against its model's
own vocabulary, to mask the target distribution (``worker/engine/constraint/``). One function,
:meth:`Constraint.llguidance_grammar`, turns every kind into llguidance's grammar text, so the
two sides can never compile different things. The check runs in a child process bounded in
time, stack and memory (:mod:`shared.constraint_sandbox`): a grammar that would crash or stall
the compiler is a refusal naming the limit, on the gateway, the client and the worker alike.
"""

from __future__ import annotations

import json
import threading
from enum import StrEnum
from functools import lru_cache
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shared.constraint_sandbox import CompileLimitError, CompileSandbox, SandboxSettings

#: Hard caps on what a constraint may carry (a schema is JSON text when measured).
MAX_GRAMMAR_CHARS = 64 * 1024
MAX_SCHEMA_CHARS = 64 * 1024


class ConstraintKind(StrEnum):
    """The kinds of constraint; ``json_object`` is OpenAI's JSON mode (any JSON object)."""

    JSON_OBJECT = "json_object"
    JSON_SCHEMA = "json_schema"
    LARK = "lark"
    GBNF = "gbnf"
    REGEX = "regex"


class ConstraintError(ValueError):
    """A constraint that does not compile; the message names the problem (a 400 at the edge)."""


class Constraint(BaseModel):
    """One constraint: ``kind`` and, by kind, ``json_schema`` (a JSON Schema object) or
    ``grammar`` (Lark, GBNF or regex text). ``json_object`` carries neither."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    kind: ConstraintKind
    json_schema: dict[str, Any] | None = Field(
        default=None, description="kind json_schema: the schema the output must validate")
    grammar: str | None = Field(
        default=None, min_length=1, max_length=MAX_GRAMMAR_CHARS,
        description="kind lark, gbnf or regex: the grammar text")
    json_from: str | None = Field(
        default=None, max_length=64,
        description="kind lark, gbnf or regex: where the output's JSON starts, for llama.cpp's "
                    "cap of 16 digits in a row of a number: '' at its first byte, a text: when "
                    "the output opens with it (tool calls' marker); unset: the output is not "
                    "JSON. The JSON kinds are JSON from their first byte")

    @model_validator(mode="before")
    @classmethod
    def _kind_from_wire(cls, data: Any) -> Any:
        """Strict models take an enum only as an instance; the wire carries its string."""
        if isinstance(data, dict) and isinstance(data.get("kind"), str):
            try:
                data = {**data, "kind": ConstraintKind(data["kind"])}
            except ValueError:
                kinds = ", ".join(k.value for k in ConstraintKind)
                raise ValueError(f"'kind' must be one of {kinds}, not {data['kind']!r}") from None
        return data

    @model_validator(mode="after")
    def _fields_match_kind(self) -> Constraint:
        if self.kind is ConstraintKind.JSON_SCHEMA:
            if self.json_schema is None or self.grammar is not None:
                raise ValueError("kind 'json_schema' takes 'json_schema' (and no 'grammar')")
            if len(json.dumps(self.json_schema)) > MAX_SCHEMA_CHARS:
                raise ValueError(f"'json_schema' is over {MAX_SCHEMA_CHARS} characters")
        elif self.kind is ConstraintKind.JSON_OBJECT:
            if self.json_schema is not None or self.grammar is not None:
                raise ValueError("kind 'json_object' takes neither 'json_schema' nor 'grammar'")
        elif self.grammar is None or self.json_schema is not None:
            raise ValueError(f"kind {self.kind.value!r} takes 'grammar' (and no 'json_schema')")
        if self.json_from is not None and self.grammar is None:
            raise ValueError(f"kind {self.kind.value!r} is JSON from its first byte: it takes "
                             "no 'json_from'")
        return self

    def json_opening(self) -> str | None:
        """Where the output's JSON starts (``json_from``; the JSON kinds: at once), None
        where it has none: the worker caps numbers' digits there (``numbers.py``)."""
        if self.kind in (ConstraintKind.JSON_OBJECT, ConstraintKind.JSON_SCHEMA):
            return ""
        return self.json_from

    def llguidance_grammar(self) -> str:
        """This constraint as llguidance grammar text, the one both sides compile.

        Raises :class:`ConstraintError` where the translation itself fails (a GBNF grammar
        llguidance's converter cannot read, a schema it does not support)."""
        from llguidance import LLMatcher
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            if self.kind is ConstraintKind.JSON_OBJECT:
                return LLMatcher.grammar_from_json_schema(
                    {"type": "object"}, defaults={"whitespace_flexible": False})
            if self.json_schema is not None:  # kind json_schema (the validator pairs them)
                return LLMatcher.grammar_from_json_schema(
                    self.json_schema, defaults={"whitespace_flexible": False})
            assert self.grammar is not None
            if self.kind is ConstraintKind.REGEX:
                return LLMatcher.grammar_from_regex(self.grammar)
            lark = gbnf_to_lark(self.grammar) if self.kind is ConstraintKind.GBNF else self.grammar
            return LLMatcher.grammar_from_lark(lark)
        except Exception as exc:  # llguidance raises ValueError/RuntimeError/its own kinds
            raise ConstraintError(f"{self.kind.value} constraint: {exc}") from exc


def check_constraint(constraint: Constraint) -> None:
    """Compile ``constraint`` without a vocabulary, in the sandbox; raise
    :class:`ConstraintError` naming the problem, or the limit (time, nesting) it hit. The
    coordinator calls this before queueing and the worker before it compiles against its
    vocabulary, so neither ever compiles in-process what could crash or stall it."""
    grammar = constraint.llguidance_grammar()
    try:
        error = _compile_error(grammar)
    except CompileLimitError as exc:
        raise ConstraintError(f"{constraint.kind.value} constraint: {exc}") from None
    if error:
        raise ConstraintError(f"{constraint.kind.value} constraint: {error}")


@lru_cache(maxsize=256)
def _compile_error(grammar: str) -> str:
    """The sandbox's verdict on ``grammar`` ('' when it compiles), remembered: a request is
    checked at parse and again at submit, and batch lines and agents repeat the same tools.
    A limit hit (:class:`CompileLimitError`) is not remembered: a refusal for time is never
    kept past a load spike."""
    return sandbox().verdict(grammar)


_SANDBOX: CompileSandbox | None = None
_SANDBOX_LOCK = threading.Lock()


def sandbox() -> CompileSandbox:
    """This process's compile sandbox, configured from its environment
    (``SPECFLEET_CONSTRAINT_COMPILE_SECONDS``, ``SPECFLEET_CONSTRAINT_COMPILERS``,
    ``SPECFLEET_CONSTRAINT_MEMORY_MIB``); its children start on first use."""
    global _SANDBOX
    with _SANDBOX_LOCK:
        if _SANDBOX is None:
            _SANDBOX = SandboxSettings().sandbox()
        return _SANDBOX
