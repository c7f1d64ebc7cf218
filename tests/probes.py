"""Constraints that once took a process down, as an attacker or a careless user sends them.

One definition for the tests that replay them (tests/gateway, tests/service) and for
``bench/fuzz.py``, which measures what each costs now. Sizes are the ones the security
review measured against llguidance 1.9.1 compiling in-process (issue 46): each is under the
64 KiB constraint cap, so only a compile that is isolated and bounded can refuse it.
"""

from __future__ import annotations

import json
from typing import Any


def ref_chain_schema(depth: int = 1200) -> dict[str, Any]:
    """A JSON Schema whose ``$ref``\\ s chain ``depth`` deep through one-armed ``anyOf``\\ s
    (~57 KB at 1,200): llguidance's compile recursed through it until the stack overflowed
    (SIGSEGV) at ~1,000."""
    defs: dict[str, Any] = {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}]}
                            for i in range(depth)}
    defs[f"d{depth}"] = {"type": "string"}
    return {"type": "object", "properties": {"a": {"$ref": "#/$defs/d0"}}, "required": ["a"],
            "$defs": defs}


def chained_lark(rules: int = 3000) -> str:
    """A Lark grammar of ``rules`` rules each naming the next (~37 KB at 3,000): the
    stack overflowed between 2,500 and 3,000."""
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(rules)) + (
        f'r{rules}: "a"\n')


def pattern_properties_schema(patterns: int = 450) -> dict[str, Any]:
    """An object schema with ``patterns`` ``patternProperties`` (~17 KB at 450): compile time
    grows as ~N^4.4 (350: 7.3 s, 450: 32 s on the review's host), outside llguidance's fuel."""
    return {"type": "object",
            "patternProperties": {f"^p{i}_[a-z]+$": {"type": "integer"}
                                  for i in range(patterns)}}


def empty_language_schema() -> dict[str, Any]:
    """A schema no finite document satisfies (an object that must hold itself): it compiles,
    but no first token is allowed, so a worker refuses it at admission."""
    return {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}


def chat_with_schema(model: str, schema: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """A chat completion body constrained by ``schema`` (``response_format``)."""
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "probe", "schema": schema}},
            **fields}


def chat_with_grammar(model: str, grammar: str, **fields: Any) -> dict[str, Any]:
    """A chat completion body constrained by a Lark ``grammar`` (``specfleet.grammar``)."""
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "specfleet": {"grammar": grammar}, **fields}


def size(value: Any) -> int:
    """Bytes of ``value`` as a JSON body carries it."""
    return len(value.encode() if isinstance(value, str) else json.dumps(value).encode())
