"""``/v1/embeddings``, ``/tokenize`` and ``/detokenize``: each request one task, a job that a
worker of the model runs beside its generations (``worker/service/tasks.py``), answered when
it ends.

A task is queued through ``Coordinator.submit_task`` (admission as for every request, in a
thread), routed like a generation; a model that is coming is waited for as a non-streamed
completion waits for it; a client that hangs up cancels its job. Tokenizing is a worker's
job because only llama.cpp's tokenizer, which the gateway never loads, splits text exactly
as the worker's prompts are split. An answer of thousands of vectors is encoded in a
thread, not in the event loop that serves every open stream.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from coordinator.client import Coordinator
from coordinator.gateway.routes import finish_jobs, json_body
from coordinator.gateway.waiting import await_worker, or_disconnect
from coordinator.openai_api import embeddings as embeddings_api
from coordinator.openai_api import tokens as tokens_api
from coordinator.validation import SubmitError, Task
from shared.protocol import FinalEvent

router = APIRouter()


@router.post("/v1/embeddings")
async def embeddings(request: Request) -> Response:
    """OpenAI's embeddings (``coordinator.openai_api.embeddings``)."""
    parsed = await asyncio.to_thread(embeddings_api.parse, await json_body(request),
                                     request.app.state.aliases)
    final = await _run(request, parsed.request)
    if isinstance(final, Response):
        return final
    return await _json(functools.partial(embeddings_api.reply, parsed.model,
                                         parsed.encoding_format, final))


@router.post("/tokenize")
async def tokenize(request: Request) -> Response:
    """llama-server's and vLLM's tokenize (``coordinator.openai_api.tokens``)."""
    parsed = await asyncio.to_thread(tokens_api.parse_tokenize, await json_body(request),
                                     request.app.state.aliases)
    final = await _run(request, parsed.request)
    if isinstance(final, Response):
        return final
    workers = await asyncio.to_thread(_coordinator(request).registry.live_workers,
                                      parsed.request.model)
    longest = max((w.n_ctx for w in workers), default=None)
    return await _json(functools.partial(tokens_api.tokenize_reply, parsed, final, longest))


@router.post("/detokenize")
async def detokenize(request: Request) -> Response:
    """llama-server's and vLLM's detokenize (``coordinator.openai_api.tokens``)."""
    job = await asyncio.to_thread(tokens_api.parse_detokenize, await json_body(request),
                                  request.app.state.aliases)
    final = await _run(request, job)
    if isinstance(final, Response):
        return final
    return await _json(functools.partial(tokens_api.detokenize_reply, final))


def _coordinator(request: Request) -> Coordinator:
    return request.app.state.coordinator


async def _run(request: Request, task: Task) -> FinalEvent | Response:
    """The task's final event once its job ended (an ``APIError`` when it failed), or the
    499 of a client that hung up (its job cancelled)."""
    coordinator = _coordinator(request)
    submit = functools.partial(coordinator.submit_task, task)
    try:
        handle = await asyncio.to_thread(submit)
    except SubmitError as exc:
        if exc.reason != "coming" or exc.model is None:
            raise
        if await or_disconnect(await_worker(coordinator, exc.model), request.receive) is None:
            return JSONResponse(status_code=499, content={})
        handle = await asyncio.to_thread(submit)
    endings = await finish_jobs(request, [handle.job_id])
    if isinstance(endings, Response):
        return endings
    return endings[0].final


async def _json(build: Callable[[], dict[str, Any]]) -> Response:
    """The answer ``build`` makes, built and encoded in a thread."""
    body = await asyncio.to_thread(lambda: json.dumps(build(), separators=(",", ":")))
    return Response(body, media_type="application/json")
