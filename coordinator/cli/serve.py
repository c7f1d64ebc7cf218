"""``specfleet serve``: the OpenAI-compatible HTTP gateway (see docs/http.md)."""

from __future__ import annotations

from typing import Annotated

import typer
import uvicorn

from coordinator.cli.app import app, environment_settings, fail
from coordinator.gateway.app import create_app
from coordinator.gateway.auth import GatewaySettings
from coordinator.redis_local import answers
from shared.logs import configure_logging, get_logger
from shared.redact import redact


@app.command()
def serve(
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="port to listen on")] = 8000,
) -> None:
    """Serve the OpenAI HTTP API (completions, chat, batches) in front of the fleet."""
    settings = environment_settings()
    configure_logging(settings.log_level, settings.log_format)
    try:
        gateway = GatewaySettings()
    except ValueError as exc:
        fail(f"invalid SPECFLEET_* environment: {exc}")
    if not answers(settings.redis_url):
        fail(f"Redis at {redact(settings.redis_url)} does not answer", code=3)
    get_logger("gateway").info("gateway.listening", host=host, port=port,
                               api_keys=len(gateway.keys()), prefix=settings.prefix)
    uvicorn.run(create_app(settings, gateway), host=host, port=port, log_level="warning",
                access_log=False, timeout_graceful_shutdown=5)
