"""Optional Bearer API keys (``SPECFLEET_API_KEYS``, comma-separated) and the gateway's own
settings (limits, timeouts, keep-alives, CORS origins, model aliases).

Keys are held as secrets (never in a repr, a log line or an error) and compared in constant
time. With no keys configured the gateway is open, as llama-server and vLLM are by default.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from fastapi import Request
from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from coordinator.gateway.errors import APIError


class GatewaySettings(BaseSettings):
    """What only the gateway reads from the environment (``SPECFLEET_*``)."""

    model_config = SettingsConfigDict(env_prefix="SPECFLEET_", extra="ignore")

    api_keys: SecretStr = SecretStr("")
    max_request_bytes: int = Field(default=1024 * 1024, gt=0,
                                   description="largest JSON body (file uploads excepted)")
    sse_keepalive_seconds: float = Field(
        default=15.0, gt=0, le=3600,
        description="a quiet stream gets a keep-alive comment this often (proxies' idle "
                    "timeouts)")
    max_concurrent_requests: int = Field(
        default=4096, gt=0,
        description="generation requests (streamed or not) in flight at once; one past it "
                    "is answered 503 with Retry-After")
    header_timeout_seconds: float = Field(
        default=10.0, gt=0, le=3600,
        description="a connection that has not sent a request's headers this long after it "
                    "opened (or after its previous response) is closed")
    body_timeout_seconds: float = Field(
        default=60.0, gt=0, le=3600,
        description="a request whose body has not arrived this long after its headers is "
                    "answered 408")
    drain_seconds: float = Field(
        default=30.0, ge=0, le=3600,
        description="on SIGTERM, how long open requests and streams may run on before the "
                    "gateway exits")
    cors_origins: str = Field(
        default="", description="comma-separated origins browsers may call from ('*': any); "
                                "empty: no CORS headers")
    model_aliases: str = Field(
        default="", description="comma-separated ALIAS=MODEL: names clients may use for a "
                                "served model")

    def keys(self) -> list[bytes]:
        return [k.strip().encode() for k in self.api_keys.get_secret_value().split(",")
                if k.strip()]

    def origins(self) -> list[str]:
        return [o.strip() for o in self.cors_origins.split(",") if o.strip()]

    def aliases(self) -> dict[str, str]:
        """``model_aliases`` as ``{alias: model}`` (``ValueError`` naming a bad entry)."""
        return parse_aliases(a for a in self.model_aliases.split(",") if a.strip())


def parse_aliases(entries: Iterable[str]) -> dict[str, str]:
    """``ALIAS=MODEL`` entries as ``{alias: model}``; ``ValueError`` naming a bad one."""
    aliases: dict[str, str] = {}
    for entry in entries:
        alias, _, model = (part.strip() for part in entry.partition("="))
        if not alias or not model or alias == model:
            raise ValueError(f"model alias {entry.strip()!r} is not ALIAS=MODEL")
        if aliases.get(alias, model) != model:
            raise ValueError(f"model alias {alias!r} names two models")
        aliases[alias] = model
    return aliases


class ApiKeys:
    """A FastAPI dependency: 401 unless the request carries one of the configured keys."""

    def __init__(self, keys: list[bytes]) -> None:
        self._keys = keys

    async def __call__(self, request: Request) -> None:
        if not self._keys:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip().encode()
        if scheme.lower() != "bearer" or not any(hmac.compare_digest(given, k)
                                                 for k in self._keys):
            raise APIError(401, "missing or invalid API key (send Authorization: Bearer KEY)",
                           "authentication_error", code="invalid_api_key")
