"""Redis replies as text: the one place that decodes what redis-py hands back.

The connections return ``bytes`` (``decode_responses`` stays off: stream payloads and uploads
are bytes), and redis-py's types say a reply may be ``bytes`` or ``str``; decoding here keeps
every caller to plain ``str`` and keeps the type checker honest about it.
"""

from __future__ import annotations


def text(raw: object) -> str:
    """A reply (a member, a field, a value) as ``str``; ``""`` for a missing one (``None``)."""
    if raw is None:
        return ""
    return raw.decode() if isinstance(raw, bytes) else str(raw)
