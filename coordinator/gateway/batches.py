"""``/v1/files`` and ``/v1/batches`` (OpenAI's Batch API) over ``coordinator.batch.BatchStore``.

The routes only translate HTTP to the store (in a thread: it is synchronous Redis) and back;
the batch itself lives in Redis. A create answers at once (``validating``); every gateway's
:func:`pump` then carries open batches on (:meth:`BatchStore.advance`: lines queued, waiting
for workers, expiry), whichever gateway created them: the creator lease in Redis lets one
process at a time at a batch, and lapses within seconds when that one dies.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.datastructures import UploadFile

from coordinator.batch import MAX_FILE_BYTES, BatchError, BatchStore
from coordinator.gateway.errors import APIError
from coordinator.gateway.routes import json_body
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


def _store(request: Request) -> BatchStore:
    return request.app.state.batches


async def _call(func: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return await asyncio.to_thread(func, *args, **kwargs)
    except BatchError as exc:
        type_ = "not_found_error" if exc.status == 404 else "invalid_request_error"
        raise APIError(exc.status, str(exc), type_, param=exc.param) from None


@router.post("/v1/files")
async def upload_file(request: Request) -> dict[str, Any]:
    form = await request.form(max_part_size=MAX_FILE_BYTES)
    upload, purpose = form.get("file"), form.get("purpose")
    if not isinstance(upload, UploadFile):
        raise APIError(400, "a multipart 'file' field is required", param="file")
    content = await upload.read()
    return await _call(_store(request).upload, content, upload.filename or "upload.jsonl",
                       purpose if isinstance(purpose, str) else "")


@router.get("/v1/files")
async def list_files(request: Request, limit: int = 20, after: str | None = None,
                     purpose: str | None = None) -> dict[str, Any]:
    """Uploaded files, newest first, each with its ``expires_at`` (its TTL in Redis)."""
    if purpose not in (None, "batch"):
        raise APIError(400, "purpose: only 'batch' files are stored", param="purpose")
    files = await _call(_store(request).files, max(1, min(limit, 100)), after)
    return {"object": "list", "data": files,
            "first_id": files[0]["id"] if files else None,
            "last_id": files[-1]["id"] if files else None, "has_more": len(files) == limit}


@router.get("/v1/files/{file_id}")
async def get_file(request: Request, file_id: str) -> dict[str, Any]:
    return await _call(_store(request).file, file_id)


@router.delete("/v1/files/{file_id}")
async def delete_file(request: Request, file_id: str) -> dict[str, Any]:
    return await _call(_store(request).delete_file, file_id)


@router.get("/v1/files/{file_id}/content")
async def file_content(request: Request, file_id: str) -> Response:
    content = await _call(_store(request).content, file_id)
    return Response(content, media_type="application/jsonl")


@router.post("/v1/batches")
async def create_batch(request: Request) -> dict[str, Any]:
    body = await json_body(request)
    if not isinstance(body.get("input_file_id"), str):
        raise APIError(400, "input_file_id is required", param="input_file_id")
    if not isinstance(body.get("endpoint"), str):
        raise APIError(400, "endpoint is required", param="endpoint")
    return await _call(_store(request).create, body["input_file_id"], body["endpoint"],
                       body.get("completion_window", "24h"), body.get("metadata"))


@router.get("/v1/batches")
async def list_batches(request: Request, limit: int = 20,
                       after: str | None = None) -> dict[str, Any]:
    batches = await _call(_store(request).list, max(1, min(limit, 100)), after)
    return {"object": "list", "data": batches,
            "first_id": batches[0]["id"] if batches else None,
            "last_id": batches[-1]["id"] if batches else None,
            "has_more": len(batches) == limit}


@router.get("/v1/batches/{batch_id}")
async def get_batch(request: Request, batch_id: str) -> dict[str, Any]:
    return await _call(_store(request).get, batch_id)


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(request: Request, batch_id: str) -> dict[str, Any]:
    return await _call(_store(request).cancel, batch_id)
