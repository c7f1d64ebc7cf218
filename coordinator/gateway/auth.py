"""Optional Bearer API keys (``SPECFLEET_API_KEYS``, comma-separated) and the gateway's own
settings (limits, timeouts, keep-alives, CORS origins, model aliases, per-key quotas).

Keys are held as secrets (never in a repr, a log line or an error) and compared in constant
time. With no keys configured the gateway is open, as llama-server and vLLM are by default.
Each key is a tenant (``coordinator.batch.Tenant``), decided here once per request and put
on ``request.state.tenant``: files and batches are stored under its key id (a digest, never
the key), admin keys (``SPECFLEET_ADMIN_API_KEYS``) see everyone's, an open gateway's callers
are one anonymous tenant. Admin keys alone may declare and remove models
(``request.state.operator``), anyone on an open gateway.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Sequence

from fastapi import Request
from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from coordinator.gateway.errors import APIError
from coordinator.tenancy import ANONYMOUS, Quota, Tenant


class GatewaySettings(BaseSettings):
    """What only the gateway reads from the environment (``SPECFLEET_*``)."""

    model_config = SettingsConfigDict(env_prefix="SPECFLEET_", extra="ignore")

    api_keys: SecretStr = SecretStr("")
    admin_api_keys: SecretStr = Field(
        default=SecretStr(""), description="comma-separated keys that also see and act on "
                                           "every key's files and batches")
    max_stored_bytes_per_key: int = Field(
        default=256 * 1024 * 1024, gt=0,
        description="bytes of live uploads one API key may hold (the anonymous tenant of an "
                    "open gateway too); one more upload past it is a 429")
    max_open_batches_per_key: int = Field(
        default=100, gt=0,
        description="batches of one API key not yet ended; one more create is a 429")
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
    allowed_hosts: str = Field(
        default="", description="comma-separated host names the Host header may carry ('*': "
                                "any); empty: what the gateway binds (specfleet serve --host)")

    def keys(self) -> list[bytes]:
        """Every key that may call the API, admin keys included."""
        return _split_keys(self.api_keys) + self.admin_keys()

    def admin_keys(self) -> list[bytes]:
        return _split_keys(self.admin_api_keys)

    def quota(self) -> Quota:
        return Quota(self.max_stored_bytes_per_key, self.max_open_batches_per_key)

    def origins(self) -> list[str]:
        return [o.strip() for o in self.cors_origins.split(",") if o.strip()]

    def aliases(self) -> dict[str, str]:
        """``model_aliases`` as ``{alias: model}`` (``ValueError`` naming a bad entry)."""
        return parse_aliases(a for a in self.model_aliases.split(",") if a.strip())


def _split_keys(keys: SecretStr) -> list[bytes]:
    return [k.strip().encode() for k in keys.get_secret_value().split(",") if k.strip()]


def key_id(key: bytes) -> str:
    """The id a key's objects are stored under: the first 16 hex digits of its SHA-256, so
    Redis, logs and listings never hold the key (and the id does not give it back)."""
    return hashlib.sha256(key).hexdigest()[:16]


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
    """A FastAPI dependency: 401 unless the request carries one of the configured keys; the
    caller's :class:`Tenant` on ``request.state.tenant`` (the one place it is decided)."""

    def __init__(self, keys: Sequence[bytes], admin_keys: Sequence[bytes] = (),
                 quota: Quota | None = None) -> None:
        admins = set(admin_keys)
        self._tenants = [(key, Tenant(key_id(key), admin=key in admins, quota=quota))
                         for key in dict.fromkeys([*keys, *admin_keys])]
        self._open = Tenant(ANONYMOUS, quota=quota)

    @classmethod
    def from_settings(cls, gateway: GatewaySettings) -> ApiKeys:
        """The keys, admin keys and per-key quota of the gateway's settings."""
        return cls(gateway.keys(), gateway.admin_keys(), gateway.quota())

    async def __call__(self, request: Request) -> None:
        request.state.tenant = self._open if not self._tenants else self._tenant(request)
        # who may change what the whole deployment serves (declared models): an admin key,
        # or anyone on a gateway without keys
        request.state.operator = not self._tenants or request.state.tenant.admin

    def _tenant(self, request: Request) -> Tenant:
        """The tenant of the request's key: every key is compared (no early exit), so how
        long it takes does not say which key matched or how far."""
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip().encode()
        found = None
        for key, tenant in self._tenants:
            if hmac.compare_digest(given, key):
                found = tenant
        if scheme.lower() != "bearer" or found is None:
            raise APIError(401, "missing or invalid API key (send Authorization: Bearer KEY)",
                           "authentication_error", code="invalid_api_key")
        return found
