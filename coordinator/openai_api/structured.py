"""Structured outputs and tool calls: OpenAI's ``response_format``, ``tools`` and
``tool_choice`` (and our ``specfleet.grammar``) read into the one ``Constraint`` a job carries.

``response_format`` ``json_object`` is any JSON object, ``json_schema`` the schema given
(always enforced: ``strict`` false asks for no less); ``text`` is no constraint. A request
with tools (``tool_choice`` not ``none``) is constrained by a Lark grammar built here, in
llguidance's syntax, whose calls follow :mod:`shared.tool_calls`' layout with each
function's name as a literal and its arguments as ``%json`` of its ``parameters``: under
``required`` or a named function the output is calls only; under ``auto`` it is either calls
or a message (the ``response_format``'s JSON when one is given, else text that does not start
with the call marker), so the reader (``tool_calls``) never has to guess. Everything is
compiled here without a vocabulary before it is queued (``check_constraint``): what cannot
compile is a 400 naming the field.

An object schema that lists its ``properties`` and says nothing of ``additionalProperties``
is closed (:func:`closed`): its keys are the ones it lists, as llama-server's converter and
vLLM's xgrammar (strict mode) read it and as OpenAI's strict schemas must say. JSON Schema
itself would let a model add keys without end, which is what a base model then does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal, get_args

from pydantic import BeforeValidator, Field, ValidationError, model_validator

from coordinator.openai_api.fields import RequestError, Strict
from shared.constraint import Constraint, ConstraintError, ConstraintKind, check_constraint
from shared.protocol import TOOL_NAME_PATTERN, ToolDefinition, describe_validation_error
from shared.tool_calls import CALL_ARGUMENTS, CALL_CLOSE, CALL_OPEN, CALL_SEPARATOR, MARKER

#: JSON a model writes under a constraint: compact (no whitespace to choose), keys in the
#: schema's order, so every key and separator is forced (and free: jump-forward).
COMPACT = {"whitespace_flexible": False}


class JsonSchemaFormat(Strict):
    """``response_format.json_schema``: the schema and its name (OpenAI's)."""

    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


FormatType = Literal["text", "json_object", "json_schema"]


def _known_type(value: Any) -> Any:
    """A format type we do not know is named in the refusal (``'sound'`` is not one)."""
    if isinstance(value, str) and value not in get_args(FormatType):
        raise ValueError(f"{value!r} is not a format type (text, json_object, json_schema)")
    return value


KnownFormatType = Annotated[FormatType, BeforeValidator(_known_type)]


class ResponseFormat(Strict):
    """Chat's and completions' ``response_format``."""

    type: KnownFormatType
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("'json_schema' comes with type 'json_schema', and only with it")
        return self

    def constraint(self, param: str) -> Constraint | None:
        if self.type == "json_object":
            return Constraint(kind=ConstraintKind.JSON_OBJECT)
        if self.json_schema is not None:
            return constraint(param, kind=ConstraintKind.JSON_SCHEMA,
                              json_schema=closed(self.json_schema.schema_ or {}))
        return None


#: Keywords whose value is a schema, a list of schemas, or a map of names to schemas.
_ONE = ("additionalProperties", "items", "contains", "not", "if", "then", "else",
        "propertyNames", "unevaluatedItems", "additionalItems")
_LIST = ("anyOf", "oneOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
#: What already says which keys an object may have besides those it lists.
_OPENNESS = ("additionalProperties", "unevaluatedProperties", "patternProperties")


def closed(schema: Any, merged: bool = False) -> Any:
    """``schema`` with every object that lists ``properties`` and says nothing of other keys
    closed to them (``additionalProperties: false``). The branches of an ``allOf`` stay as
    they are (``merged``): each lists only part of the keys the whole allows."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = closed(out[key])
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [closed(s) for s in out[key]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(s) for name, s in out[key].items()}
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [closed(s, merged=True) for s in out["allOf"]]
    if (not merged and isinstance(out.get("properties"), dict) and "allOf" not in out
            and not any(key in out for key in _OPENNESS)):
        out["additionalProperties"] = False
    return out


class TextFormat(Strict):
    """The Responses API's ``text.format``: ``response_format`` flattened."""

    type: KnownFormatType
    name: str | None = Field(default=None, pattern=TOOL_NAME_PATTERN)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _named_schema(self) -> TextFormat:
        if self.type == "json_schema" and self.name is None:
            raise ValueError("type 'json_schema' needs a 'name'")
        if self.type != "json_schema" and (self.name or self.schema_ is not None):
            raise ValueError("'name' and 'schema' come with type 'json_schema'")
        return self

    def response_format(self) -> ResponseFormat:
        if self.type != "json_schema":
            return ResponseFormat(type=self.type)
        assert self.name is not None
        return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat.model_validate(
            {"name": self.name, "description": self.description, "schema": self.schema_,
             "strict": self.strict}))


class NamedFunction(Strict):
    name: str = Field(pattern=TOOL_NAME_PATTERN)


class NamedToolChoice(Strict):
    """``tool_choice`` naming the one function to call."""

    type: Literal["function"]
    function: NamedFunction


ToolMode = Literal["none", "auto", "required"]


def known_mode(value: Any) -> Any:
    """A mode we do not know is named in the refusal (a union would list its arms)."""
    if isinstance(value, str) and value not in get_args(ToolMode):
        raise ValueError(f"{value!r} is not none, auto, required or a named function")
    return value


ToolChoice = Annotated[ToolMode | NamedToolChoice, BeforeValidator(known_mode)]
#: ``specfleet.grammar_syntax`` values: the grammar kinds of a ``Constraint``.
GrammarSyntax = Literal["lark", "gbnf", "regex"]


@dataclass(frozen=True)
class Tools:
    """What a request says about tools (``tools``, ``tool_choice``,
    ``parallel_tool_calls``, each validated by the request), checked together."""

    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    #: Where tool ``i``'s ``parameters`` sit in the endpoint's body (named in a refusal).
    parameters_param: str = "tools.{}.function.parameters"

    def offered(self) -> list[ToolDefinition]:
        return list(self.tools or [])

    def calls(self) -> bool:
        """Whether the output is constrained to (and read as) calls or a message."""
        return bool(self.tools) and self.tool_choice != "none"

    def check(self) -> None:
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise RequestError("tool_choice: needs 'tools'", param="tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice):
            name = self.tool_choice.function.name
            if name not in {t.function.name for t in self.offered()}:
                raise RequestError(f"tool_choice: no tool named {name!r} in 'tools'",
                                   param="tool_choice")
        names = [t.function.name for t in self.offered()]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise RequestError(f"tools: function {repeated[0]!r} is named more than once",
                               param="tools")
        for i, tool in enumerate(self.offered()):  # each alone, to name the one at fault
            if tool.function.parameters is not None:
                where = self.parameters_param.format(i)
                compiled(where, constraint(where, kind=ConstraintKind.JSON_SCHEMA,
                                           json_schema=tool.function.parameters))

    def constraint(self, message: Constraint | None) -> Constraint:
        """The grammar of calls (and, under ``auto``, of the message: ``message``'s JSON,
        or text that does not start with the call marker)."""
        tools = self.offered()
        if isinstance(self.tool_choice, NamedToolChoice):
            tools = [t for t in tools if t.function.name == self.tool_choice.function.name]
        parallel = self.parallel_tool_calls is not False and not isinstance(
            self.tool_choice, NamedToolChoice)
        rules = [f"calls: call ({_literal(CALL_SEPARATOR)} call)*" if parallel
                 else "calls: call",
                 f"call: {_literal(CALL_OPEN)} ({' | '.join(f'fn_{i}' for i in range(len(tools)))})"
                 f" {_literal(CALL_CLOSE)}"]
        for i, tool in enumerate(tools):
            parameters = closed(tool.function.parameters or {"type": "object"})
            rules.append(f"fn_{i}: {_literal(tool.function.name + CALL_ARGUMENTS)} "
                         f"%json {json.dumps({**parameters, 'x-guidance': COMPACT})}")
        # The output's JSON, for the cap on numbers' digits: calls are JSON in a frame with no
        # digits outside strings, so all of it unless free text may stand in their place.
        json_from = ""
        if self.tool_choice in (None, "auto"):
            if message is None:
                start = "start: calls | TEXT"
                rules.append(f"TEXT: /(.|\\n)*/ & ~/{_regex_literal(MARKER)}(.|\\n)*/")
                json_from = MARKER
            else:
                start = "start: calls | message"
                rules.append(f"message: {_message_rule(message)}")
        else:
            start = "start: calls"
        return constraint("tools", kind=ConstraintKind.LARK, grammar="\n".join([start, *rules]),
                          json_from=json_from)


def _literal(text: str) -> str:
    """``text`` as a Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(text)


#: What a regex reads as an operator (Rust's regex syntax; ``/`` ends a Lark regex).
_REGEX_OPERATORS = frozenset("\\.+*?()|[]{}^$#&-~/")


def _regex_literal(text: str) -> str:
    """``text`` matched literally inside a Lark ``/regex/``."""
    return "".join(f"\\{c}" if c in _REGEX_OPERATORS else c for c in text)


def _message_rule(message: Constraint) -> str:
    """The message alternative of ``auto``: a JSON constraint as ``%json``."""
    if message.kind is ConstraintKind.JSON_OBJECT:
        schema: dict[str, Any] = {"type": "object"}
    elif message.kind is ConstraintKind.JSON_SCHEMA:
        schema = dict(message.json_schema or {})
    else:  # request_constraint refuses a grammar with tools
        raise AssertionError(f"no message rule for a {message.kind} constraint")
    return f"%json {json.dumps({**schema, 'x-guidance': COMPACT})}"


def grammar_constraint(grammar: str | None, syntax: GrammarSyntax | None) -> Constraint | None:
    """``specfleet.grammar`` (Lark unless ``grammar_syntax`` says GBNF or regex)."""
    if grammar is None:
        if syntax is not None:
            raise RequestError("specfleet.grammar_syntax: needs specfleet.grammar",
                               param="specfleet.grammar_syntax")
        return None
    return constraint("specfleet.grammar", kind=ConstraintKind(syntax or "lark"),
                      grammar=grammar)


def constraint(param: str, **fields: Any) -> Constraint:
    """A ``Constraint`` of ``fields``, or a ``RequestError`` naming ``param`` (a schema or
    grammar over its size cap)."""
    try:
        return Constraint(**fields)
    except ValidationError as exc:
        reason = describe_validation_error(exc, subject=None)
        raise RequestError(f"{param}: {reason}", param=param) from None


def compiled(param: str, c: Constraint) -> Constraint:
    """``c``, compiled without a vocabulary; a ``RequestError`` naming ``param`` if it
    does not compile."""
    try:
        check_constraint(c)
    except ConstraintError as exc:
        raise RequestError(f"{param}: {exc}", param=param) from None
    return c


def request_constraint(response_format: ResponseFormat | None, grammar: Constraint | None,
                       tools: Tools | None,
                       format_param: str = "response_format") -> Constraint | None:
    """The one constraint of a request, compiled (``RequestError`` naming the field whose
    constraint does not compile; ``format_param``: what the endpoint calls
    ``response_format``)."""
    message = (response_format.constraint(format_param) if response_format is not None
               else None)
    if message is not None and grammar is not None:
        raise RequestError("specfleet.grammar and response_format both constrain the "
                           "output: send one", param="specfleet.grammar")
    if grammar is not None and tools is not None and tools.tools:
        raise RequestError("specfleet.grammar cannot be combined with tools (the grammar of "
                           "calls is built from them)", param="specfleet.grammar")
    message = message or grammar
    param = "specfleet.grammar" if grammar is not None else format_param
    if tools is not None:
        tools.check()
        if tools.calls():
            message, param = tools.constraint(message), "tools"
    return compiled(param, message) if message is not None else None
