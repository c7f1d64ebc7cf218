"""The gateway's ASGI application: routes, errors, API keys, request size and time limits,
admission, cross-site refusals, CORS.

Stateless: everything it knows is in Redis (jobs, streams, batches, files), so any number of
gateways can serve one fleet, and a restarted one picks up where the last left off. Its Redis
connections are bounded whatever the load: one for the stream hub's read of every open stream
(``hub.py``), a small async pool, and one per thread of the synchronous pool (submits,
cancels, batches); requests past ``max_concurrent_requests`` are answered 503 with
``Retry-After`` before they cost anything.

A web page must not be able to drive a gateway it was not allowed to (``cross_site``): the
Host, the Origin and the Content-Type of every request are checked before anything runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI
from fastapi.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from coordinator.batch import BatchStore
from coordinator.client import Coordinator
from coordinator.files import MAX_FILE_BYTES
from coordinator.gateway import batches, console, errors, models, routes, tasks
from coordinator.gateway.auth import ApiKeys, GatewaySettings
from coordinator.gateway.cross_site import CrossSite, allowed_hosts
from coordinator.gateway.errors import RETRY_OVERLOADED, APIError
from coordinator.gateway.hub import StreamHub
from shared.constraint import sandbox as constraint_sandbox
from shared.logs import get_logger
from shared.redis_client import connect, connect_async
from shared.settings import Settings

#: Connections the gateway's async client may hold (the hub's reader has its own): health
#: checks and the hub's wake-ups; a command past the bound waits for one to be free.
ASYNC_CONNECTIONS = 32
#: Threads for synchronous Redis work (submits, cancels, batch operations).
SYNC_THREADS = 64
#: The routes that start jobs on workers (generations, and the tasks: embeddings, the
#: tokenizer): what ``max_concurrent_requests`` counts.
GENERATING = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses",
                        "/v1/embeddings", "/tokenize", "/detokenize"})
RESUME = "/v1/specfleet/streams/"

log = get_logger("gateway")


class Admission:
    """503 with ``Retry-After`` for a generation request (or stream resumption) past
    ``limit`` in flight, answered before it submits anything: a client that cannot be served
    hears so, instead of a 200 whose stream never comes."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit
        self.active = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not (path in GENERATING or path.startswith(RESUME)):
            await self.app(scope, receive, send)
            return
        if self.active >= self.limit:
            log.warning("gateway.overloaded", path=path, in_flight=self.active,
                        limit=self.limit)
            await APIError(503, f"the gateway has {self.active} requests in flight (its limit,"
                           " SPECFLEET_MAX_CONCURRENT_REQUESTS); try again shortly",
                           "service_unavailable", code="overloaded",
                           retry_after=RETRY_OVERLOADED).response()(scope, receive, send)
            return
        self.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1


class BodyLimit:
    """413 for a body over the limit (uploads to ``/v1/files`` have the file limit), checked
    on ``Content-Length`` first and on the bytes actually received for chunked bodies; 408
    for a body not received within ``seconds`` of its headers (a client trickling its body
    would hold a connection and a request for ever). Once the body is in, later reads (the
    wait for a disconnect) have no deadline."""

    def __init__(self, app: ASGIApp, limit: int, seconds: float) -> None:
        self.app = app
        self.limit = limit
        self.seconds = seconds

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
        received, complete = 0, False
        deadline = asyncio.get_running_loop().time() + self.seconds

        async def counting() -> Message:
            nonlocal received, complete
            if complete:
                return await receive()
            try:
                message = await asyncio.wait_for(
                    receive(), max(0.0, deadline - asyncio.get_running_loop().time()))
            except TimeoutError:
                log.warning("gateway.body_timeout", path=scope["path"], received=received,
                            seconds=self.seconds)
                raise APIError(408, f"the request body did not arrive within {self.seconds:g}"
                               " s", code="body_timeout") from None
            complete = message["type"] != "http.request" or not message.get("more_body")
            received += len(message.get("body", b""))
            if received > limit:
                raise APIError(413, f"request body exceeds {limit} bytes", code="too_large")
            return message

        await self.app(scope, counting, send)


def _too_large(limit: int) -> ASGIApp:
    return APIError(413, f"request body exceeds {limit} bytes", code="too_large").response()


def create_app(settings: Settings, gateway: GatewaySettings | None = None,
               bind: str = "127.0.0.1") -> FastAPI:
    """The gateway app for one deployment (one Redis, one key prefix), served at ``bind``
    (what the Host header may name unless ``gateway.allowed_hosts`` says)."""
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
        app.state.redis = connect_async(settings.redis_url, ASYNC_CONNECTIONS)
        app.state.hub = StreamHub(connect_async(settings.redis_url, max_connections=1),
                                  app.state.redis,
                                  settings.keys.gateway_wake(uuid.uuid4().hex[:12]),
                                  settings.redis_outage_seconds)
        app.state.hub.start()
        # Constraints compile in child processes (shared/constraint_sandbox.py): started
        # now, so a request's first schema does not wait for an interpreter.
        await asyncio.to_thread(constraint_sandbox().start)
        pump = asyncio.create_task(batches.pump(app.state.batches), name="batch-pump")
        app.state.aliases = gateway.aliases()
        app.state.keepalive_seconds = gateway.sse_keepalive_seconds
        try:
            yield
        finally:
            app.state.batches.stop()
            pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pump
            await app.state.hub.close()
            await app.state.redis.aclose()
            coordinator.connection.close()
            constraint_sandbox().close()

    # the schema is served behind the API key (routes.openapi), not by FastAPI to anyone
    app = FastAPI(title="specfleet", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    errors.install(app)
    auth = [Depends(ApiKeys.from_settings(gateway))]
    app.include_router(routes.public)
    app.include_router(routes.router, dependencies=auth)
    app.include_router(batches.router, dependencies=auth)
    app.include_router(models.router, dependencies=auth)  # /v1/models, declared models
    app.include_router(tasks.router, dependencies=auth)  # /v1/embeddings, /tokenize, ...
    console.install(app, auth, keys_required=bool(gateway.keys()))  # GET /console
    app.add_middleware(BodyLimit, limit=gateway.max_request_bytes,
                       seconds=gateway.body_timeout_seconds)
    app.add_middleware(Admission, limit=gateway.max_concurrent_requests)
    # inside CORS: a refusal sent to an allowed origin carries its CORS headers (readable)
    app.add_middleware(CrossSite, allowed=allowed_hosts(gateway.allowed_hosts, bind),
                       origins=gateway.origins())
    if gateway.origins():  # outermost: a preflight is answered before keys are asked for
        app.add_middleware(CORSMiddleware, allow_origins=gateway.origins(),
                           allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
                           allow_headers=["*"], max_age=600)
    return app
