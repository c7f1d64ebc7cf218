"""``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``, stream resumption, health.

A request becomes a job through ``Coordinator.submit`` (the same validation and admission as
every other client, run in a thread because rq is synchronous); the answer is read from the
job's Redis Stream. A client that hangs up cancels its job; a gateway that dies does not, so
its clients can resume the stream from another gateway.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.serializers import JSONSerializer
from sse_starlette import EventSourceResponse

from coordinator.client import Coordinator
from coordinator.gateway import schemas
from coordinator.gateway.errors import APIError
from coordinator.gateway.streaming import final_or_disconnect, sse_chunks
from coordinator.metrics import METRICS_CONTENT_TYPE, render_fleet_metrics
from shared.logs import get_logger
from shared.protocol import JobStatus, WorkerInfo

log = get_logger("gateway")

router = APIRouter()
#: Routes open without an API key (load balancers' health checks).
public = APIRouter()

#: Seconds between SSE keep-alive comments on a quiet stream.
PING_SECONDS = 15


def _coordinator(request: Request) -> Coordinator:
    return request.app.state.coordinator


async def _json_body(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object")
    return body


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    """Served models (those with a live worker) and their workers' capacity."""
    workers = await asyncio.to_thread(_coordinator(request).registry.live_workers)
    served: dict[str, list[WorkerInfo]] = {}
    for w in workers:
        served.setdefault(w.model_name, []).append(w)
    return {"object": "list", "data": [
        {"id": name, "object": "model", "created": int(min(w.started_at for w in ws)),
         "owned_by": "specfleet",
         "specfleet": {"slots": sum(w.slots for w in ws),
                       "max_context": max(w.n_ctx for w in ws),
                       "chat_template": any(w.chat_template for w in ws),
                       "spec_methods": sorted({m for w in ws for m in w.spec_methods}),
                       "workers": [_capacity(w) for w in ws]}}
        for name, ws in sorted(served.items())]}


def _capacity(worker: WorkerInfo) -> dict[str, Any]:
    """What one worker can serve: its context, slots, device and speculative capacity."""
    return {"name": worker.name, "device": worker.device, "n_ctx": worker.n_ctx,
            "slots": worker.slots, "chat_template": worker.chat_template,
            "capacity": worker.capacity.model_dump(mode="json") if worker.capacity else None}


@router.post("/v1/completions")
async def completions(request: Request) -> Any:
    return await _generate(request, schemas.COMPLETIONS)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Any:
    return await _generate(request, schemas.CHAT)


async def _generate(request: Request, endpoint: str) -> Any:
    body = await _json_body(request)
    generation, stream = schemas.parse_body(endpoint, body)
    coordinator = _coordinator(request)
    handle = await asyncio.to_thread(coordinator.submit, generation)
    model = generation["model"]
    state = request.app.state
    if stream:
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return _sse(request, endpoint, handle.job_id, model, include_usage, shown=0)
    final = await final_or_disconnect(state.redis, coordinator.keys, handle.job_id,
                                      request.receive)
    if final is None:
        await _cancel(coordinator, handle.job_id, "disconnected")
        return JSONResponse(status_code=499, content={})
    if final.status is JobStatus.FAILED:
        raise APIError(500, final.error or "the job failed", "server_error", code="job_failed")
    return schemas.response_body(endpoint, model, final)


def _sse(request: Request, endpoint: str, job_id: str, model: str, include_usage: bool,
         shown: int) -> EventSourceResponse:
    coordinator = _coordinator(request)

    async def on_close(_: Any) -> None:
        await _cancel(coordinator, job_id, "disconnected")

    chunks = sse_chunks(request.app.state.redis, coordinator.keys, endpoint, job_id, model,
                        int(time.time()), include_usage, shown)
    return EventSourceResponse(chunks, sep="\n", ping=PING_SECONDS,
                               client_close_handler_callable=on_close)


async def _cancel(coordinator: Coordinator, job_id: str, reason: str) -> None:
    """Cancel a job whose client went away (nothing to do when it has already ended)."""
    try:
        await asyncio.to_thread(coordinator.cancel, job_id)
    except (LookupError, ValueError):
        return
    log.info("gateway.job_cancelled", job_id=job_id, reason=reason)


@router.get("/v1/specfleet/streams/{completion_id}")
async def resume_stream(request: Request, completion_id: str,
                        include_usage: bool = False) -> EventSourceResponse:
    """Resume a streamed completion (after a dropped connection or a gateway restart):
    ``Last-Event-ID`` is the ``id`` of the last SSE event received."""
    kind, _, job_id = completion_id.partition("-")
    if kind not in ("cmpl", "chatcmpl") or not job_id:
        raise APIError(404, f"no such completion: {completion_id}", "not_found_error")
    endpoint = schemas.CHAT if kind == "chatcmpl" else schemas.COMPLETIONS
    coordinator = _coordinator(request)
    try:
        job = await asyncio.to_thread(Job.fetch, job_id, connection=coordinator.connection,
                                      serializer=JSONSerializer)
    except NoSuchJobError:
        raise APIError(404, f"no such completion: {completion_id}", "not_found_error") from None
    last = request.headers.get("last-event-id", "0")
    if not last.isdigit():
        raise APIError(400, "Last-Event-ID must be the id of an event of this stream",
                       param="Last-Event-ID")
    return _sse(request, endpoint, job_id, (job.meta or {}).get("model", ""), include_usage,
                shown=int(last))


@public.get("/metrics")
async def metrics(request: Request) -> Response:
    """The fleet's and queues' Prometheus metrics (``coordinator.metrics``)."""
    body = await asyncio.to_thread(render_fleet_metrics, _coordinator(request))
    return Response(body, media_type=METRICS_CONTENT_TYPE)


@public.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 with live workers per model while Redis answers; 503 when it does not."""
    try:
        await request.app.state.redis.ping()
        workers = await asyncio.to_thread(_coordinator(request).registry.live_workers)
    except Exception as exc:  # any Redis failure means "not healthy", never a traceback
        return JSONResponse(status_code=503, content={
            "status": "unavailable", "redis": False, "error": type(exc).__name__})
    per_model: dict[str, int] = {}
    for w in workers:
        per_model[w.model_name] = per_model.get(w.model_name, 0) + 1
    return JSONResponse({"status": "ok", "redis": True, "models": per_model})
