"""The web console (``GET /console``): the fleet, a worker, the fleet's events, batches and a
playground in a browser, served by the gateway itself.

The page and its assets (``console_assets/``, package data: fleets run on closed networks, so
nothing comes from a CDN; the chart library is vendored there, see its README) are plain
files. What the page shows comes from the read-only views here, over the data functions the
other views of the fleet use: :func:`coordinator.metrics.fleet_snapshot` (``specfleet top``,
``GET /metrics``) and the fleet's event stream (``shared.fleet_events``, which ``specfleet
monitor --fleet-events`` reads), pushed to the page over SSE as they change (one stream a
page, not a poll per widget): the fleet event stream through the gateway's
:class:`~coordinator.gateway.hub.StreamHub`, the snapshot every :data:`REFRESH_SECONDS`.

The console changes nothing itself. A batch cancel or a playground chat is the page calling the
gateway's own API (``POST /v1/batches/{id}/cancel``, ``POST /v1/chat/completions``) with the
key its user typed, so without one the gateway's own 401 answers. Fleet-wide views (workers,
queues, events) are open to read, as ``/metrics`` is; what belongs to a tenant (its batches, a
job's stream) is behind the API key, as the ``/v1`` routes that show it are.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from itertools import islice
from pathlib import Path
from typing import Any, cast

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.responses import FileResponse
from rq.job import JOB_ID_PATTERN, Job
from sse_starlette import EventSourceResponse

from coordinator.batch import BatchStore
from coordinator.client import Coordinator
from coordinator.events import StreamCursor
from coordinator.gateway.batches import batches_call
from coordinator.gateway.errors import APIError
from coordinator.gateway.hub import Entry, StreamHub
from coordinator.gateway.streaming import interrupted, job_events, with_keepalive
from coordinator.metrics import fleet_snapshot
from coordinator.tenancy import Tenant
from shared.fleet_events import decode
from shared.logs import get_logger
from shared.protocol import WorkerInfo

#: The page, its script and styles, and the vendored chart library.
ASSETS = Path(__file__).with_name("console_assets")
#: What each asset is served as (anything else in the folder is not served).
_MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                ".css": "text/css; charset=utf-8"}
#: Seconds between two fleet snapshots (and batch listings) a page is sent.
REFRESH_SECONDS = 1.0
#: Fleet events a page opens with (the newest), and batches it lists.
EVENTS_SHOWN = 500
BATCHES_SHOWN = 100
#: Failed lines of a batch shown when one is opened.
ERRORS_SHOWN = 100
#: The timeline's kind of each fleet event (a ``worker.lost`` with requeued jobs also puts a
#: ``requeue`` on it for each of them).
KINDS = {"worker.lost": "lost", "worker.host_fallback": "fallback", "worker.replays": "replay",
         "worker.requeued": "requeue", "worker.refusal": "refusal",
         "worker.redis_fault": "redis"}

public = APIRouter(include_in_schema=False)
#: Routes behind the API key (``install`` adds the gateway's key dependency).
keyed = APIRouter(include_in_schema=False)
log = get_logger("gateway")


def install(app: FastAPI, auth: Sequence[Any], keys_required: bool) -> None:
    """Serve the console on ``app``: its page and open views, and the views behind ``auth``
    (the gateway's API-key dependency); ``keys_required`` tells the page whether to ask for a
    key before it calls those."""
    app.state.console_keys_required = keys_required
    app.include_router(public)
    app.include_router(keyed, dependencies=list(auth))


# -- the page ----------------------------------------------------------------------------------
def _assets() -> dict[str, Path]:
    return {p.name: p for p in ASSETS.iterdir() if p.suffix in _MEDIA_TYPES}


@public.get("/console")
async def page() -> FileResponse:
    return FileResponse(ASSETS / "index.html", media_type=_MEDIA_TYPES[".html"],
                        headers={"Cache-Control": "no-cache"})


@public.get("/console/assets/{name}")
async def asset(name: str) -> FileResponse:
    """One of the console's own files, by name (no paths: nothing else can be reached)."""
    path = _assets().get(name)
    if path is None:
        raise APIError(404, f"no console asset {name!r}", "not_found_error", param="name")
    return FileResponse(path, media_type=_MEDIA_TYPES[path.suffix],
                        headers={"Cache-Control": "no-cache"})


# -- the fleet ---------------------------------------------------------------------------------
def _details(info: WorkerInfo) -> dict[str, Any]:
    """What the worker page shows beyond the snapshot's row: its fit report (the model's
    file name, not its path), capacity and how it was started."""
    fit = info.fit.model_dump(mode="json") if info.fit else None
    if fit is not None:
        fit["model_path"] = Path(fit["model_path"]).name
    return {"fit": fit, "capacity": info.capacity.model_dump(mode="json") if info.capacity
            else None, "spec_methods": info.spec_methods, "version": info.version,
            "started_at": info.started_at, "prefix_cache": info.prefix_cache,
            "deterministic": info.deterministic, "chat_template": info.chat_template_source}


def fleet_view(coordinator: Coordinator, worker_ttl_seconds: float) -> dict[str, Any]:
    """The fleet as ``specfleet top --once --json`` shows it (the same snapshot), plus each
    live worker's fit report and the workers whose registration lapsed (dead, not yet swept
    by recovery: lost already, though no ``worker.lost`` record says so yet)."""
    named = set(coordinator.registry.registered_names())
    snapshot = fleet_snapshot(coordinator)
    infos = coordinator.registry.live_workers()
    live = {w.name for w in snapshot.workers}
    return {**snapshot.to_json(), "lapsed": sorted(named - live),
            "worker_ttl_seconds": worker_ttl_seconds,
            "details": {info.name: _details(info) for info in infos if info.name in live}}


@public.get("/console/api/fleet")
async def fleet(request: Request) -> dict[str, Any]:
    return await asyncio.to_thread(fleet_view, _coordinator(request),
                                   _coordinator(request).settings.worker_ttl_seconds)


# -- the fleet's events ------------------------------------------------------------------------
def timeline(entry_id: str, record: dict[str, Any]) -> list[dict[str, Any]]:
    """The timeline entries of one fleet event (none for an event of no kind shown)."""
    kind = KINDS.get(record["event"])
    if kind is None:
        return []
    entry = {**record, "id": entry_id, "kind": kind}
    requeues = [{**record, "id": f"{entry_id}/{job}", "kind": "requeue", "job_id": job,
                 "reason": "lost"} for job in record.get("requeued") or []]
    return [entry, *requeues]


def _entries(raw: Sequence[Entry]) -> tuple[list[dict[str, Any]], str | None]:
    """Timeline entries of raw stream entries (oldest first) and the last entry's id."""
    out: list[dict[str, Any]] = []
    last = None
    for entry_id, fields in raw:
        last = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
        record = decode(fields)
        if record is not None:
            out += timeline(last, record)
    return out, last


def recent_events(coordinator: Coordinator, count: int) -> tuple[list[dict[str, Any]], str]:
    """The newest ``count`` fleet events as timeline entries (oldest first), and the id to
    follow the stream from."""
    newest = cast(list[Entry], coordinator.connection.xrevrange(
        coordinator.keys.fleet_events(), count=count) or [])
    entries, last = _entries(newest[::-1])
    return entries, last or "0-0"


def _sse(name: str, body: object) -> dict[str, str]:
    return {"event": name, "data": json.dumps(body, separators=(",", ":"))}


async def _updates(request: Request) -> AsyncIterator[dict[str, str]]:
    """The page's stream: the newest events, then each new one as the hub reads it, and a
    fleet snapshot every :data:`REFRESH_SECONDS`; an error event when Redis cannot be read
    (the page's EventSource reconnects)."""
    coordinator = _coordinator(request)
    hub: StreamHub = request.app.state.hub
    ttl = coordinator.settings.worker_ttl_seconds
    loop = asyncio.get_running_loop()
    pending: asyncio.Future[list[Entry]] | None = None
    try:
        backlog, last = await asyncio.to_thread(recent_events, coordinator, EVENTS_SHOWN)
        yield _sse("events", backlog)
        yield _sse("fleet", await asyncio.to_thread(fleet_view, coordinator, ttl))
        due = loop.time() + REFRESH_SECONDS
        async with hub.follow(coordinator.keys.fleet_events(), last) as subscription:
            while True:
                if pending is None:
                    pending = asyncio.ensure_future(subscription.next())
                done, _ = await asyncio.wait({pending}, timeout=max(0.0, due - loop.time()))
                if done:
                    new, _ = _entries(pending.result())
                    pending = None
                    if new:
                        yield _sse("events", new)
                    continue
                yield _sse("fleet", await asyncio.to_thread(fleet_view, coordinator, ttl))
                due = loop.time() + REFRESH_SECONDS
    except Exception as exc:  # noqa: BLE001  the page hears why, and reconnects
        yield _sse("failure", interrupted(exc, [])["error"])
    finally:
        if pending is not None:
            pending.cancel()


@public.get("/console/api/stream")
async def updates(request: Request) -> EventSourceResponse:
    return _stream(request, _updates(request))


@public.get("/console/api/settings")
async def settings(request: Request) -> dict[str, Any]:
    """What the page needs to know before it calls anything: whether a key is asked for."""
    return {"keys_required": request.app.state.console_keys_required}


# -- a tenant's batches and jobs (behind the key) ----------------------------------------------
async def _batches(request: Request) -> AsyncIterator[dict[str, str]]:
    """The caller's batches (an admin key: everyone's), sent when they change; an error
    event when Redis cannot be read."""
    store: BatchStore = request.app.state.batches
    tenant: Tenant = request.state.tenant
    sent = None
    try:
        while True:
            listing = await asyncio.to_thread(store.list, BATCHES_SHOWN, None, tenant=tenant)
            if listing != sent:
                yield _sse("batches", {"taken_at": time.time(), "data": listing})
                sent = listing
            await asyncio.sleep(REFRESH_SECONDS)
    except Exception as exc:  # noqa: BLE001  the page hears why
        yield _sse("failure", interrupted(exc, [])["error"])


@keyed.get("/console/api/batches/stream")
async def batches_stream(request: Request) -> EventSourceResponse:
    return _stream(request, _batches(request))


@keyed.get("/console/api/batches/{batch_id}/errors")
async def batch_errors(request: Request, batch_id: str,
                       limit: int = Query(default=ERRORS_SHOWN, ge=1, le=1000),
                       ) -> dict[str, Any]:
    """The batch's failed lines so far, with their errors (its error file is written only
    when it ends), in input order."""
    return {"object": "list", "data": await batches_call(request, _failed_lines, batch_id, limit)}


def _failed_lines(store: BatchStore, batch_id: str, limit: int, *,
                  tenant: Tenant) -> list[dict[str, Any]]:
    return list(islice(store.result_lines(batch_id, "errors", tenant=tenant), limit))


async def _job(request: Request, job_id: str) -> AsyncIterator[dict[str, str]]:
    """Every event of one job (token events with how each token was produced, telemetry,
    the final event), replayed from its start and followed to its end."""
    hub: StreamHub = request.app.state.hub
    try:
        async with aclosing(job_events(hub, _coordinator(request).keys,
                                       StreamCursor(job_id))) as events:
            async for event in events:
                yield {"event": event.type, "data": event.model_dump_json()}
    except Exception as exc:  # noqa: BLE001  the page hears why the stream ends
        yield _sse("failure", interrupted(exc, [job_id])["error"])


@keyed.get("/console/api/jobs/{job_id}/events")
async def job_stream(request: Request, job_id: str) -> EventSourceResponse:
    coordinator = _coordinator(request)
    if not JOB_ID_PATTERN.fullmatch(job_id) or not await asyncio.to_thread(
            Job.exists, job_id, coordinator.connection):
        raise APIError(404, f"no such job: {job_id}", "not_found_error", param="job_id")
    return _stream(request, _job(request, job_id))


# -- helpers -----------------------------------------------------------------------------------
def _coordinator(request: Request) -> Coordinator:
    return request.app.state.coordinator


def _stream(request: Request, events: AsyncIterator[dict[str, str]]) -> EventSourceResponse:
    """``events`` as SSE with the gateway's keep-alives."""
    return EventSourceResponse(with_keepalive(events, request.app.state.keepalive_seconds,
                                              request.app.state.hub), sep="\n", ping=0)


__all__ = ["ASSETS", "fleet_view", "install", "recent_events", "timeline"]
