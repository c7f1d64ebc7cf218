"""Optional Bearer API keys (``SPECFLEET_API_KEYS``, comma-separated) and the gateway's limits.

Keys are held as secrets (never in a repr, a log line or an error) and compared in constant
time. With no keys configured the gateway is open, as llama-server and vLLM are by default.
"""

from __future__ import annotations

import hmac

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

    def keys(self) -> list[bytes]:
        return [k.strip().encode() for k in self.api_keys.get_secret_value().split(",")
                if k.strip()]


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
