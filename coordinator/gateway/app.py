"""The gateway's ASGI application: routes, errors, API keys, request size limits, CORS.

Stateless: everything it knows is in Redis (jobs, streams, batches, files), so any number of
gateways can serve one fleet, and a restarted one picks up where the last left off.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI
from fastapi.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from coordinator.batch import MAX_FILE_BYTES, BatchStore
from coordinator.client import Coordinator
from coordinator.gateway import batches, errors, routes
from coordinator.gateway.auth import ApiKeys, GatewaySettings
from coordinator.gateway.errors import APIError
from coordinator.gateway.streaming import connect_async
from shared.redis_client import connect
from shared.settings import Settings

#: Threads for synchronous Redis work (submits, cancels, batch operations).
SYNC_THREADS = 64


class BodyLimit:
    """413 for a body over the limit (uploads to ``/v1/files`` have the file limit), checked
    on ``Content-Length`` first and on the bytes actually received for chunked bodies."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # multipart framing around the file takes a little room of its own
        limit = MAX_FILE_BYTES + 64 * 1024 if scope["path"] == "/v1/files" else self.limit
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _too_large(limit)(scope, receive, send)
            return
        received = 0

        async def counting() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > limit:
                raise APIError(413, f"request body exceeds {limit} bytes", code="too_large")
            return message

        await self.app(scope, counting, send)


def _too_large(limit: int) -> ASGIApp:
    return APIError(413, f"request body exceeds {limit} bytes", code="too_large").response()


def create_app(settings: Settings, gateway: GatewaySettings | None = None) -> FastAPI:
    """The gateway app for one deployment (one Redis, one key prefix)."""
    gateway = gateway or GatewaySettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # rq and the batch store are synchronous: they run in threads, and a batch being
        # created (seconds for a large one) must not starve the submits of other requests.
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(max_workers=SYNC_THREADS, thread_name_prefix="gateway-sync"))
        coordinator = Coordinator(settings, connect(settings.redis_url))
        app.state.coordinator = coordinator
        app.state.batches = BatchStore(coordinator, gateway.aliases())
        app.state.redis = connect_async(settings.redis_url)
        app.state.aliases = gateway.aliases()
        app.state.keepalive_seconds = gateway.sse_keepalive_seconds
        try:
            yield
        finally:
            await app.state.redis.aclose()
            coordinator.connection.close()

    app = FastAPI(title="specfleet", lifespan=lifespan, docs_url=None, redoc_url=None)
    errors.install(app)
    auth = [Depends(ApiKeys(gateway.keys()))]
    app.include_router(routes.public)
    app.include_router(routes.router, dependencies=auth)
    app.include_router(batches.router, dependencies=auth)
    app.add_middleware(BodyLimit, limit=gateway.max_request_bytes)
    if gateway.origins():  # outermost: a preflight is answered before keys are asked for
        app.add_middleware(CORSMiddleware, allow_origins=gateway.origins(),
                           allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
                           allow_headers=["*"], max_age=600)
    return app
