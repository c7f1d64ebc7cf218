"""``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses``, stream resumption,
health (``/v1/models`` is ``models.py``).

A request becomes one job per choice through ``Coordinator.submit`` (the same validation and
admission as every other client, run in a thread because rq is synchronous); the answer is
read from the jobs' Redis Streams. A request for a model that is coming (declared, or a
worker of it loading) waits for a worker first (``waiting.py``). A client that hangs up
cancels its jobs; a gateway that dies does not, so its clients can resume a stream from
another gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import re
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any, TypeAlias

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from rq.exceptions import NoSuchJobError
from rq.job import JOB_ID_PATTERN, Job
from rq.serializers import JSONSerializer
from sse_starlette import EventSourceResponse

from coordinator.client import Coordinator
from coordinator.gateway.errors import APIError, from_job
from coordinator.gateway.streaming import (
    Ending,
    completion_sse,
    endings_or_disconnect,
    refusal,
    responses_sse,
    with_keepalive,
)
from coordinator.gateway.waiting import await_worker, or_disconnect, stream_after_worker
from coordinator.metrics import METRICS_CONTENT_TYPE, render_fleet_metrics
from coordinator.openai_api import replies, requests
from coordinator.openai_api.requests import CHAT, COMPLETIONS, Choice, Parsed
from coordinator.openai_api.responses import EventSequence, parse_responses, response_object
from coordinator.validation import SubmitError
from shared.logs import get_logger
from shared.protocol import JobStatus

log = get_logger("gateway")

router = APIRouter()
#: Routes open without an API key (load balancers' health checks).
public = APIRouter()

#: Deepest nesting of arrays and objects a JSON body may have (OpenAI's bodies need < 10).
MAX_JSON_DEPTH = 64
#: How a lone surrogate reaches a body: a ``\uD800``-``\uDFFF`` escape (raw bytes must be
#: UTF-8, and json pairs a high escape and a low one into one character). A body without one
#: is not walked for them.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
#: Longest a stream's headers wait for its job to be taken and not refused.
REFUSAL_WAIT_SECONDS = 1.0


def _coordinator(request: Request) -> Coordinator:
    return request.app.state.coordinator


def _aliases(request: Request) -> dict[str, str]:
    return request.app.state.aliases


#: Where a value sits in a JSON body: ``(parent's path, key or index)``, None for the body.
_Path: TypeAlias = tuple["_Path", str | int] | None


def _nodes(value: object) -> Iterator[tuple[object, int, _Path]]:
    """Every value in ``value`` with its depth (the body's own: 1) and path, without
    recursion (nothing to exhaust), entering nothing deeper than ``MAX_JSON_DEPTH + 1``."""
    stack: list[tuple[object, int, _Path]] = [(value, 1, None)]
    while stack:
        item, depth, path = stack.pop()
        yield item, depth, path
        if depth > MAX_JSON_DEPTH:
            continue
        if isinstance(item, dict):
            stack.extend((v, depth + 1, (path, k)) for k, v in item.items())
        elif isinstance(item, list):
            stack.extend((v, depth + 1, (path, i)) for i, v in enumerate(item))


def json_depth(value: object) -> int:
    """How deeply arrays and objects nest in ``value`` (iterative: no recursion to exhaust)."""
    return max((depth for item, depth, _ in _nodes(value) if isinstance(item, dict | list)),
               default=0)


def _dotted(path: _Path) -> str:
    """A path as a 400's ``param`` names a field (``messages.0.content``)."""
    parts: list[str] = []
    while path is not None:
        path, key = path
        parts.append(str(key))
    return ".".join(reversed(parts))


def lone_surrogate(body: object) -> str | None:
    """The path of a key or string in ``body`` holding a lone surrogate, or None. JSON can
    carry one (an unpaired ``\\ud800`` escape) but it is not text: UTF-8 cannot encode it,
    so wherever it is echoed or written (an error message, Redis) it raised a 500."""
    for item, _, path in _nodes(body):
        if isinstance(item, str) and _LONE_SURROGATE.search(item):
            return _dotted(path)
        if isinstance(item, dict):
            for key in item:
                if _LONE_SURROGATE.search(key):
                    return _dotted((path, key))
    return None


def decode_json(raw: bytes) -> dict[str, Any]:
    """``raw`` as a JSON object, or a 400 saying why not: not JSON, nested deeper than
    ``MAX_JSON_DEPTH`` (a 100k-deep body is refused, not a RecursionError), not an object,
    or a string holding a lone surrogate (``param``: its path)."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the body is not valid JSON: {exc}") from None
    except RecursionError:
        body = None
    if body is None or json_depth(body) > MAX_JSON_DEPTH:
        raise APIError(400, f"the body nests arrays and objects deeper than {MAX_JSON_DEPTH}",
                       code="too_deep")
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object")
    where = lone_surrogate(body) if _SURROGATE_ESCAPE.search(raw) else None
    if where is not None:
        raise APIError(400, f"{where}: holds a lone UTF-16 surrogate (an unpaired "
                       "\\ud800-\\udfff escape), which is not text", param=where,
                       code="invalid_unicode")
    return body


async def json_body(request: Request) -> dict[str, Any]:
    """The body as a JSON object (:func:`decode_json`), decoded in a thread: a 1 MiB body
    parsed and walked in the event loop would hold up every open stream meanwhile."""
    return await asyncio.to_thread(decode_json, await request.body())


@router.post("/v1/completions")
async def completions(request: Request) -> Any:
    parsed = await asyncio.to_thread(requests.parse_body, COMPLETIONS, await json_body(request),
                                     _aliases(request))
    return await _generate(request, parsed)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Any:
    parsed = await asyncio.to_thread(requests.parse_body, CHAT, await json_body(request),
                                     _aliases(request))
    return await _generate(request, parsed)


def _submit_all(coordinator: Coordinator, choices: Sequence[Choice]) -> list[str]:
    """Queue every choice's job; when one is refused, the ones queued are cancelled."""
    job_ids: list[str] = []
    try:
        for choice in choices:
            job_ids.append(coordinator.submit(choice.request).job_id)
    except SubmitError:
        for job_id in job_ids:
            with contextlib.suppress(LookupError, ValueError):  # already ended
                coordinator.cancel(job_id)
        raise
    return job_ids


def _check(endings: Sequence[Ending]) -> None:
    """The ``APIError`` of the first failed job (``errors.from_job``), if one failed."""
    for ending in endings:
        if ending.final.status is JobStatus.FAILED:
            raise from_job(ending.final.error, ending.error_type, ending.param)


async def finish_jobs(request: Request, job_ids: Sequence[str]) -> list[Ending] | JSONResponse:
    """Every job's ending, or a 499 (with the jobs cancelled) when the client hung up."""
    coordinator = _coordinator(request)
    endings = await endings_or_disconnect(request.app.state.hub, coordinator.keys, job_ids,
                                          request.receive)
    if endings is None:
        for job_id in job_ids:
            await _cancel(coordinator, job_id, "disconnected")
        return JSONResponse(status_code=499, content={})
    _check(endings)
    return endings


async def _refused_early(request: Request, job_ids: Sequence[str]) -> None:
    """Before a stream's headers: the ``APIError`` of a job a worker refused at once (an
    idle worker refuses within milliseconds; a queued job's stream starts after
    :data:`REFUSAL_WAIT_SECONDS` at most, so clients with short header timeouts still get
    their headers)."""
    ending = await refusal(request.app.state.hub, _coordinator(request).keys, job_ids[0],
                           min(REFUSAL_WAIT_SECONDS, request.app.state.keepalive_seconds))
    if ending is not None:
        _check([ending])


async def _submit(request: Request, parsed: Parsed,
                  events: Callable[[list[str]], AsyncIterator[dict[str, str]]],
                  refused: Callable[[APIError], list[dict[str, str]]],
                  ) -> list[str] | Response:
    """Every choice's job, queued. For a model that is coming, once a worker of it is live:
    a non-streamed request waits here (a 499 when its client hangs up meanwhile), a stream
    is answered at once with an SSE response that waits inside it and goes on with its jobs'
    ``events`` (or ``refused``'s events of the error that ended the wait)."""
    coordinator = _coordinator(request)
    submit = functools.partial(_submit_all, coordinator, parsed.choices)
    try:
        return await asyncio.to_thread(submit)
    except SubmitError as exc:
        if exc.reason != "coming" or exc.model is None:
            raise
        model = exc.model
    if parsed.stream:
        job_ids: list[str] = []
        return _sse(request, stream_after_worker(coordinator, model, submit, job_ids, events,
                                                 refused), job_ids)
    if await or_disconnect(await_worker(coordinator, model), request.receive) is None:
        return JSONResponse(status_code=499, content={})
    return await asyncio.to_thread(submit)


def _chunk_refusal(error: APIError) -> list[dict[str, str]]:
    """A chat or text completion stream's end for an error: its error event, ``[DONE]``."""
    return [{"data": json.dumps(error.body(), separators=(",", ":"))}, {"data": "[DONE]"}]


def _responses_refusal(error: APIError) -> list[dict[str, str]]:
    """A Responses stream's end for an error: its ``error`` event."""
    body = {"type": "error", "sequence_number": 0, "code": error.code,
            "message": error.message, "param": error.param}
    return [{"event": "error", "data": json.dumps(body, separators=(",", ":"))}]


async def _generate(request: Request, parsed: Parsed) -> Any:
    hub, keys = request.app.state.hub, _coordinator(request).keys

    def stream(job_ids: list[str]) -> AsyncIterator[dict[str, str]]:
        return completion_sse(hub, keys, parsed, job_ids, int(time.time()))

    submitted = await _submit(request, parsed, stream, _chunk_refusal)
    if isinstance(submitted, Response):
        return submitted
    job_ids = submitted
    if parsed.stream:
        await _refused_early(request, job_ids)
        return _sse(request, stream(job_ids), job_ids)
    endings = await finish_jobs(request, job_ids)
    if isinstance(endings, JSONResponse):
        return endings
    return replies.response_body(parsed, [e.final for e in endings])


@router.post("/v1/responses")
async def responses(request: Request) -> Any:
    """OpenAI's Responses API over one chat job (``coordinator.openai_api.responses``)."""
    parsed, body = await asyncio.to_thread(parse_responses, await json_body(request),
                                           _aliases(request))
    created = int(time.time())
    hub, keys = request.app.state.hub, _coordinator(request).keys

    def stream(job_ids: list[str]) -> AsyncIterator[dict[str, str]]:
        return responses_sse(hub, keys, EventSequence(job_ids[0], parsed, body, created))

    submitted = await _submit(request, parsed, stream, _responses_refusal)
    if isinstance(submitted, Response):
        return submitted
    [job_id] = submitted
    if parsed.stream:
        await _refused_early(request, [job_id])
        return _sse(request, stream([job_id]), [job_id])
    endings = await finish_jobs(request, [job_id])
    if isinstance(endings, JSONResponse):
        return endings
    return response_object(job_id, parsed, body, created, endings[0].final)


def _sse(request: Request, events: AsyncIterator[dict[str, str] | bytes],
         job_ids: Sequence[str]) -> EventSourceResponse:
    """The stream of ``events`` with keep-alives (ours: sse-starlette's pings end in a blank
    line), cancelling the jobs when the client hangs up."""
    coordinator = _coordinator(request)

    async def on_close(_: Any) -> None:
        for job_id in job_ids:
            await _cancel(coordinator, job_id, "disconnected")

    return EventSourceResponse(with_keepalive(events, request.app.state.keepalive_seconds,
                                              request.app.state.hub),
                               sep="\n", ping=0, client_close_handler_callable=on_close)


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
    """Resume a streamed one-choice completion (after a dropped connection or a gateway
    restart): ``Last-Event-ID`` is the ``id`` of the last SSE event received. An id no job
    can have (rq's job ids are letters, digits, ``_`` and ``-``) is a 404 like an unknown
    one, never a ``ValueError`` from rq."""
    kind, _, job_id = completion_id.partition("-")
    unknown = APIError(404, f"no such completion: {completion_id}", "not_found_error",
                       param="completion_id")
    if kind not in ("cmpl", "chatcmpl") or not JOB_ID_PATTERN.fullmatch(job_id):
        raise unknown
    coordinator = _coordinator(request)
    try:
        job = await asyncio.to_thread(Job.fetch, job_id, connection=coordinator.connection,
                                      serializer=JSONSerializer)
    except NoSuchJobError:
        raise unknown from None
    last = request.headers.get("last-event-id", "0")
    if not (last.isascii() and last.isdigit()):  # "²" is a digit to str, not to int
        raise APIError(400, "Last-Event-ID must be the id of an event of this stream",
                       param="Last-Event-ID")
    queued = job.args[0] if job.args and isinstance(job.args[0], dict) else {}
    parsed = Parsed(CHAT if kind == "chatcmpl" else COMPLETIONS,
                    (job.meta or {}).get("model", ""),
                    [Choice({}, tool_calls=requests.reads_tool_calls(queued))], True,
                    include_usage)
    return _sse(request, completion_sse(request.app.state.hub, coordinator.keys, parsed,
                                        [job_id], int(time.time()), shown=int(last)), [job_id])


@router.get("/openapi.json", include_in_schema=False)
async def openapi(request: Request) -> dict[str, Any]:
    """The OpenAPI schema, behind the API key like the routes it describes (FastAPI's own
    is served to anyone)."""
    return request.app.openapi()


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
