"""Credentials are masked wherever text reaches a person: URLs, log events, settings reprs."""

from __future__ import annotations

import io
import json

import pytest

from shared.logs import configure_logging, get_logger
from shared.redact import redact
from shared.settings import Settings

SECRET = "s3cr:et@pw"  # an unencoded ':' and '@' inside the password too


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://user:pw@host:6379/0", "redis://user:***@host:6379/0"),
    ("rediss://:pw@cache.internal:6380/2", "rediss://:***@cache.internal:6380/2"),
    ("redis+sentinel://ops:pw@s1:26379,s2:26379/mymaster/0",
     "redis+sentinel://ops:***@s1:26379,s2:26379/mymaster/0"),
    ("unix://user:pw@/run/redis.sock?db=1", "unix://user:***@/run/redis.sock?db=1"),
    (f"redis://user:{SECRET}@host/0", "redis://user:***@host/0"),
    ("redis://host:6379/0?password=pw&db=1", "redis://host:6379/0?password=***&db=1"),
    ("rediss://h/0?ssl_keyfile=k.pem&ssl_password=pw", "rediss://h/0?ssl_keyfile=k.pem&ssl_password=***"),
    ("redis://user@host:6379/0", "redis://user@host:6379/0"),
    ("redis://host:6379/0", "redis://host:6379/0"),
])
def test_a_url_keeps_user_and_host_and_loses_its_password(url: str, shown: str) -> None:
    assert redact(url) == shown


def test_urls_inside_free_text_are_masked() -> None:
    text = "Error connecting to 'redis://a:pw1@h1:1/0' (fallback rediss://b:pw2@h2:2/0)"
    assert redact(text) == ("Error connecting to 'redis://a:***@h1:1/0' "
                            "(fallback rediss://b:***@h2:2/0)")


class _Holder:
    """Any object whose repr shows a URL (a client, a config) logged as a field."""

    def __init__(self, url: str) -> None:
        self.url = url

    def __repr__(self) -> str:
        return f"_Holder({self.url!r})"


def test_no_log_event_carries_a_password() -> None:
    """Any string field, a nested one, an object's repr and a formatted traceback, in the JSON
    a shipper sees."""
    out = io.StringIO()
    configure_logging("debug", "json", stream=out)
    url = f"redis://ops:{SECRET}@redis.internal:6379/0"
    log = get_logger("test")
    log.info("redis.connecting", url=url, urls=[url], nested={"primary": url},
             client=_Holder(url), attempt=1)
    try:
        raise ConnectionError(f"cannot reach {url}")
    except ConnectionError:
        log.exception("redis.unreachable")
    text = out.getvalue()
    assert SECRET not in text and "pw@" not in text
    first, second = (json.loads(line) for line in text.splitlines())
    shown = "redis://ops:***@redis.internal:6379/0"
    assert first["url"] == shown and first["urls"] == [shown]
    assert first["nested"] == {"primary": shown}
    assert first["client"] == f"_Holder({shown!r})" and first["attempt"] == 1
    assert f"cannot reach {shown}" in second["exception"]


def test_settings_show_no_password_but_connect_with_it() -> None:
    url = f"redis://ops:{SECRET}@redis.internal:6379/0"
    settings = Settings(redis_url=url)
    assert SECRET not in repr(settings) and "redis://ops:***@redis.internal" in repr(settings)
    assert str(settings.redis_url) == url  # what clients connect with is the real one
