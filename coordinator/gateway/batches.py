"""``/v1/files`` and ``/v1/batches`` (OpenAI's Batch API) over ``coordinator.batch.BatchStore``.

The routes only translate HTTP to the store (in a thread: it is synchronous Redis) and back;
the batch itself lives in Redis. A create answers at once (``validating``); every gateway's
:func:`pump` then carries open batches on (:meth:`BatchStore.advance`: lines queued, waiting
for workers, expiry), whichever gateway created them: the creator lease in Redis lets one
process at a time at a batch, and lapses within seconds when that one dies.

Every route acts as the caller's tenant (``request.state.tenant``, decided by
``coordinator.gateway.auth.ApiKeys``), passed to the store by :func:`_call` alone: another
key's objects are 404s, listings hold the caller's own, an admin key sees everyone's.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import UploadFile

from coordinator.batch import BatchStore
from coordinator.files import MAX_FILE_BYTES, FileStore
from coordinator.gateway.errors import APIError
from coordinator.gateway.routes import json_body
from coordinator.tenancy import StoreError, Tenant
from shared.logs import get_logger

router = APIRouter()
log = get_logger("gateway")

#: Seconds between two looks at the open batches (a new one waits at most this long).
PUMP_SECONDS = 0.5
#: Threads advancing batches, apart from the pool that serves requests: a batch queueing
#: 10,000 lines, or waiting for a worker, takes no thread from the submits.
BATCH_THREADS = 8


async def pump(store: BatchStore) -> None:
    """Advance every open batch that needs a hand, each in a thread of its own, for the
    gateway's life; a Redis error only delays the next look. Cancelled at shutdown, after
    ``store.stop()`` has told the advancing threads to let go."""
    loop = asyncio.get_running_loop()
    threads = ThreadPoolExecutor(max_workers=BATCH_THREADS, thread_name_prefix="batch-pump")
    running: dict[str, asyncio.Future[bool]] = {}
    try:
        while True:
            try:
                due = await loop.run_in_executor(threads, store.needing_care)
            except Exception as exc:  # noqa: BLE001  Redis away: look again later
                log.warning("batch.pump_failed", error_type=type(exc).__name__,
                            error=str(exc))
                due = []
            for batch_id in due:
                if batch_id not in running:
                    task = loop.run_in_executor(threads, store.advance, batch_id)
                    running[batch_id] = task
                    task.add_done_callback(functools.partial(_advanced, running, batch_id))
            await asyncio.sleep(PUMP_SECONDS)
    finally:
        threads.shutdown(wait=False, cancel_futures=True)


def _advanced(running: dict[str, asyncio.Future[bool]], batch_id: str,
              task: asyncio.Future[bool]) -> None:
    running.pop(batch_id, None)
    if not task.cancelled() and task.exception() is not None:
        exc = task.exception()
        log.warning("batch.advance_failed", batch_id=batch_id,
                    error_type=type(exc).__name__, error=str(exc))


class QuotaExceeded(APIError):
    """A 429 the OpenAI SDKs do not retry (``x-should-retry: false``): a quota frees up when
    the caller deletes files or batches end, not within their seconds of backoff."""

    def response(self) -> JSONResponse:
        response = super().response()
        response.headers["x-should-retry"] = "false"
        return response


async def batches_call(request: Request, method: Callable[..., Any], *args: Any) -> Any:
    """``method`` of the gateway's ``BatchStore`` (:func:`_call`): the Batch API's routes
    and the console's."""
    return await _call(request, request.app.state.batches, method, *args)


async def files_call(request: Request, method: Callable[..., Any], *args: Any) -> Any:
    """``method`` of the gateway's ``FileStore``: :func:`_call`."""
    return await _call(request, request.app.state.batches.files, method, *args)


async def _call(request: Request, store: object, method: Callable[..., Any], *args: Any) -> Any:
    """``method`` of ``store`` in a thread, as the request's tenant (never missing: a route
    without the API-key dependency fails here instead of seeing all)."""
    tenant: Tenant = request.state.tenant
    try:
        return await asyncio.to_thread(method, store, *args, tenant=tenant)
    except StoreError as exc:
        if exc.status == 429:
            raise QuotaExceeded(429, str(exc), "insufficient_quota", param=exc.param,
                                code=exc.code) from None
        type_ = "not_found_error" if exc.status == 404 else "invalid_request_error"
        raise APIError(exc.status, str(exc), type_, param=exc.param, code=exc.code) from None


@router.post("/v1/files")
async def upload_file(request: Request) -> dict[str, Any]:
    form = await request.form(max_part_size=MAX_FILE_BYTES)
    upload, purpose = form.get("file"), form.get("purpose")
    if not isinstance(upload, UploadFile):
        raise APIError(400, "a multipart 'file' field is required", param="file")
    content = await upload.read()
    return await files_call(request, FileStore.upload, content, upload.filename or "upload.jsonl",
                        purpose if isinstance(purpose, str) else "")


#: A listing's page size: OpenAI's default and bounds (outside them: a 400 naming ``limit``).
PageLimit = Annotated[int, Query(ge=1, le=100)]


def _page(items: list[dict[str, Any]], limit: int) -> dict[str, Any]:
    """A listing page of up to ``limit`` of ``items`` (fetched one past it: whether there
    are more)."""
    shown = items[:limit]
    return {"object": "list", "data": shown,
            "first_id": shown[0]["id"] if shown else None,
            "last_id": shown[-1]["id"] if shown else None, "has_more": len(items) > limit}


@router.get("/v1/files")
async def list_files(request: Request, limit: PageLimit = 20, after: str | None = None,
                     purpose: str | None = None) -> dict[str, Any]:
    """The caller's uploaded files (an admin: everyone's), newest first, each with its
    ``expires_at`` (its TTL in Redis)."""
    if purpose not in (None, "batch"):
        raise APIError(400, "purpose: only 'batch' files are stored", param="purpose")
    return _page(await files_call(request, FileStore.uploads, limit + 1, after), limit)


@router.get("/v1/files/{file_id}")
async def get_file(request: Request, file_id: str) -> dict[str, Any]:
    return await files_call(request, FileStore.file, file_id)


@router.delete("/v1/files/{file_id}")
async def delete_file(request: Request, file_id: str) -> dict[str, Any]:
    return await files_call(request, FileStore.delete, file_id)


@router.get("/v1/files/{file_id}/content")
async def file_content(request: Request, file_id: str) -> Response:
    content = await files_call(request, FileStore.content, file_id)
    return Response(content, media_type="application/jsonl")


@router.post("/v1/batches")
async def create_batch(request: Request) -> dict[str, Any]:
    body = await json_body(request)
    if not isinstance(body.get("input_file_id"), str):
        raise APIError(400, "input_file_id is required", param="input_file_id")
    if not isinstance(body.get("endpoint"), str):
        raise APIError(400, "endpoint is required", param="endpoint")
    return await batches_call(request, BatchStore.create, body["input_file_id"], body["endpoint"],
                       body.get("completion_window", "24h"), body.get("metadata"))


@router.get("/v1/batches")
async def list_batches(request: Request, limit: PageLimit = 20,
                       after: str | None = None) -> dict[str, Any]:
    return _page(await batches_call(request, BatchStore.list, limit + 1, after), limit)


@router.get("/v1/batches/{batch_id}")
async def get_batch(request: Request, batch_id: str) -> dict[str, Any]:
    return await batches_call(request, BatchStore.get, batch_id)


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(request: Request, batch_id: str) -> dict[str, Any]:
    return await batches_call(request, BatchStore.cancel, batch_id)
