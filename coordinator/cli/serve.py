"""``specfleet serve``: the OpenAI-compatible HTTP gateway (see docs/http.md)."""

from __future__ import annotations

from typing import Annotated

import typer

from coordinator.cli.app import app, environment_settings, fail
from coordinator.gateway import server
from coordinator.gateway.app import create_app
from coordinator.gateway.auth import GatewaySettings
from coordinator.gateway.cross_site import allowed_hosts as allowed_hosts_for
from coordinator.redis_local import answers
from shared.logs import configure_logging, get_logger
from shared.redact import redact


@app.command()
def serve(
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="port to listen on")] = 8000,
    cors_origins: Annotated[list[str] | None, typer.Option(
        "--cors-origins", help="origin browsers may call from ('*': any; repeat or comma-"
                               "separate; default SPECFLEET_CORS_ORIGINS, else none)")] = None,
    model_alias: Annotated[list[str] | None, typer.Option(
        "--model-alias", help="ALIAS=MODEL: another name clients may use for a served model "
                              "(repeat for several; adds to SPECFLEET_MODEL_ALIASES)")] = None,
    allowed_hosts: Annotated[list[str] | None, typer.Option(
        "--allowed-hosts", help="host name the Host header may carry ('*': any; repeat or "
                                "comma-separate; default SPECFLEET_ALLOWED_HOSTS, else what "
                                "--host is reached by: the loopback names for a loopback "
                                "address, any for 0.0.0.0 or ::)")] = None,
) -> None:
    """Serve the OpenAI HTTP API (completions, chat, responses, batches) in front of the fleet."""
    settings = environment_settings()
    configure_logging(settings.log_level, settings.log_format)
    try:
        gateway = GatewaySettings()
    except ValueError as exc:
        fail(f"invalid SPECFLEET_* environment: {exc}")
    update = {}
    if cors_origins:
        update["cors_origins"] = ",".join(cors_origins)
    if model_alias:
        update["model_aliases"] = ",".join([gateway.model_aliases, *model_alias])
    if allowed_hosts:
        update["allowed_hosts"] = ",".join(allowed_hosts)
    gateway = gateway.model_copy(update=update)
    try:
        gateway.aliases()
    except ValueError as exc:
        fail(f"--model-alias: {exc}")
    if not answers(settings.redis_url):
        fail(f"Redis at {redact(settings.redis_url)} does not answer", code=3)
    hosts = allowed_hosts_for(gateway.allowed_hosts, host)
    get_logger("gateway").info("gateway.listening", host=host, port=port,
                               api_keys=len(gateway.keys()), prefix=settings.prefix,
                               cors_origins=gateway.origins(), aliases=gateway.aliases(),
                               allowed_hosts=["*"] if hosts is None else sorted(hosts))
    server.run(create_app(settings, gateway, bind=host), host, port,
               header_seconds=gateway.header_timeout_seconds,
               drain_seconds=gateway.drain_seconds)
