"""Credentials never reach a human: the one place a Redis URL (or any text) is made printable.

A Redis URL carries its password (``redis://user:PASSWORD@host:6379/0``), and it travels into
CLI error lines, log fields and exception texts. Everything meant for a person or a log
shipper goes through :func:`redact`, which keeps what helps an operator (scheme, user, hosts,
database) and replaces only the secret. It scrubs free text as well as bare URLs, so an
exception whose message embeds a URL is safe to print too.

:class:`RedisURL` is the settings' URL type: a plain ``str`` for every client that connects
with it, whose ``repr`` (what a settings object, a traceback or a test failure shows) is
redacted.
"""

from __future__ import annotations

import re

#: What a redacted secret is shown as.
MASK = "***"

# ``scheme://[user]:password@`` in any URL scheme (redis, rediss, redis+sentinel, unix, ...).
# The password runs to the *last* ``@`` before whitespace or a quote: an unencoded ``@`` or
# ``/`` inside a password is still hidden (at worst more than the password is masked).
_USERINFO = re.compile(
    r"(?P<head>\b[a-z][a-z0-9+.\-]*://[^:@/?#\s'\"]*):(?P<secret>[^\s'\"]*)@", re.IGNORECASE)
# ``?password=...``, ``&ssl_password=...``: redis-py also takes passwords as query arguments.
_QUERY = re.compile(r"(?P<head>[?&][\w.\-]*password=)(?P<secret>[^&#\s'\"]*)", re.IGNORECASE)


def redact(text: str) -> str:
    """``text`` with the password of every URL in it replaced by ``***``.

    ``redis://user:pw@host:6379/0`` renders as ``redis://user:***@host:6379/0``; a URL with
    no password, and text with no URL, come back unchanged.
    """
    text = _USERINFO.sub(rf"\g<head>:{MASK}@", text)
    return _QUERY.sub(rf"\g<head>{MASK}", text)


class RedisURL(str):
    """A Redis URL: the real string for connecting, a redacted one in ``repr``."""

    __slots__ = ()

    def __repr__(self) -> str:
        return repr(redact(self))
