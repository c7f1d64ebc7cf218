"""How a model writes a tool call: one text layout, shared by the coordinator (the grammar
that makes a model write calls, and the reader that turns them back into OpenAI's
``tool_calls``) and the worker (calls already made, rendered into a chat's history in the
generic format for templates that know no tools).

The layout is Hermes' (Qwen 2.5 / 3 and Hermes templates speak it natively)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

several calls separated by one newline. The arguments are compact JSON (no newline inside),
so the first ``}\\n</tool_call>`` after them ends a call: a reader needs no JSON parser to
find where each call ends, which is what lets it stream argument fragments as they come.
"""

from __future__ import annotations

#: What every call starts with, up to its name.
CALL_OPEN = '<tool_call>\n{"name": "'
#: Between the name and the arguments.
CALL_ARGUMENTS = '", "arguments": '
#: What ends a call, right after its arguments.
CALL_CLOSE = "}\n</tool_call>"
#: Between two calls of one turn.
CALL_SEPARATOR = "\n"
#: The marker alone: text that starts with it is calls, any other text is a message.
MARKER = "<tool_call>"


def render_call(name: str, arguments: str) -> str:
    """One call as the model writes it (``arguments``: the JSON object's text)."""
    return f"{CALL_OPEN}{name}{CALL_ARGUMENTS}{arguments}{CALL_CLOSE}"


def render_calls(calls: list[tuple[str, str]]) -> str:
    """The calls of one turn, ``(name, arguments)`` each, as the model writes them."""
    return CALL_SEPARATOR.join(render_call(name, arguments) for name, arguments in calls)
