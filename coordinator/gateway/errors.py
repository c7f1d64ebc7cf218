"""Errors in OpenAI's JSON shape (``{"error": {"message", "type", "param", "code"}}``).

Every refusal maps to one status here: 400 a request we cannot run (naming the field), 401 a
missing or wrong API key, 403 a browser request from an origin not allowed, 404 an unknown
model or object, 408 a body that did not arrive in time, 413 a body over the size limit, 415 a
body that is not JSON by its Content-Type, 421 a Host the gateway is not served as, 503 with
``Retry-After`` a request the gateway cannot serve now (no live worker, none within
``SPECFLEET_WAIT_FOR_WORKER_SECONDS`` for a coming model, too many requests in flight, Redis
unreachable); anything unexpected is a 500 whose message names only its type (the
log has the rest), so internals and secrets never reach a client. A client's mistake is never a
500: the OpenAI SDKs retry those.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException

from coordinator.gateway.hub import GatewayClosing
from coordinator.openai_api.fields import RequestError
from coordinator.validation import SubmitError
from shared import redis_faults
from shared.logs import get_logger
from shared.outage import RedisOutage
from shared.protocol import Rejection, describe_validation_error

log = get_logger("gateway")

#: Seconds a client is asked to wait (``Retry-After``) before it tries again: after a 503 for
#: too many requests in flight, for no live worker, and for Redis not answering.
RETRY_OVERLOADED = 1
RETRY_NO_WORKER = 5
RETRY_REDIS = 5

#: SubmitError.reason -> (status, OpenAI error type, code, the field at fault when the error
#: names none)
_SUBMIT_STATUS = {
    "invalid": (400, "invalid_request_error", None, None),
    "context_length_exceeded": (400, "invalid_request_error", "context_length_exceeded", None),
    "unknown_model": (404, "invalid_request_error", "model_not_found", "model"),
    "no_worker": (503, "service_unavailable", "no_live_worker", "model"),
    "coming": (503, "service_unavailable", "no_live_worker", "model"),
    "wait_timeout": (503, "service_unavailable", "worker_wait_timeout", "model"),
}
#: Refusals for want of a live worker: answered with ``Retry-After``.
_NO_WORKER = frozenset({"no_worker", "coming", "wait_timeout"})
#: Where FastAPI found a bad request parameter: the first item of its error's ``loc``.
_LOCATIONS = frozenset({"body", "query", "path", "header", "cookie"})


class APIError(Exception):
    """An error answered in OpenAI's shape with ``status``."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def response(self) -> JSONResponse:
        headers = None if self.retry_after is None else {"Retry-After": str(self.retry_after)}
        return JSONResponse(status_code=self.status, headers=headers, content=self.body())

    def body(self) -> dict[str, Any]:
        """The error's JSON body (what a stream's error event carries too)."""
        return error_body(self.message, self.type, self.param, self.code)


def printable(text: str) -> str:
    """``text`` as UTF-8 can carry it: a lone surrogate (a JSON ``\\ud800`` escape, which is
    not text) is shown escaped, so an error that echoes what a client sent can always be
    sent back (rendering it raised ``UnicodeEncodeError``: a 500 for a client's mistake)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(message: str, type_: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": printable(message), "type": type_,
                      "param": None if param is None else printable(param), "code": code}}


def from_submit(exc: SubmitError) -> APIError:
    status, type_, code, param = _SUBMIT_STATUS.get(exc.reason, _SUBMIT_STATUS["invalid"])
    return APIError(status, str(exc), type_, param=exc.param or param, code=code,
                    retry_after=RETRY_NO_WORKER if exc.reason in _NO_WORKER else None)


def from_job(error: str | None, error_type: str | None, param: str | None = None) -> APIError:
    """A failed job's error, answered or streamed: 400 when the worker refused the request
    itself (a :class:`~shared.protocol.Rejection`, naming ``param`` where the worker named
    the field; one too long for the worker's context is ``context_length_exceeded``, naming
    ``max_tokens`` unless told, as at submit), else a 500."""
    message = error or "the job failed"
    rejection = Rejection.of(error_type)
    if rejection is Rejection.CONTEXT:
        return APIError(400, message, param=param or "max_tokens",
                        code="context_length_exceeded")
    if rejection is not None:
        return APIError(400, message, param=param, code="job_rejected")
    return APIError(500, message, "server_error", code="job_failed")


def from_redis(exc: Exception) -> APIError:
    """503 with ``Retry-After`` while Redis refuses for a passing reason (down, loading, out
    of memory, no free connection ...); else the 500 of anything unexpected."""
    if isinstance(exc, RedisOutage) or redis_faults.classify(exc) is not None:
        log.warning("gateway.redis_unavailable", error_type=type(exc).__name__, error=str(exc))
        return APIError(503, "Redis is not answering; try again shortly", "service_unavailable",
                        code="redis_unavailable", retry_after=RETRY_REDIS)
    log.error("gateway.error", error_type=type(exc).__name__, error=str(exc))
    return APIError(500, f"internal error ({type(exc).__name__})", "server_error")


def from_validation(exc: ValidationError | RequestValidationError) -> APIError:
    """A 400 naming the first bad field (``param``: ``limit``, as OpenAI names it, not
    FastAPI's ``query.limit``) and every problem in the message."""
    errors = [{**err, "loc": _field(exc, tuple(err.get("loc", ())))} for err in exc.errors()]
    first = (".".join(str(p) for p in errors[0]["loc"]) or "body") if errors else None
    return APIError(400, describe_validation_error(errors, subject="body") or "invalid request",
                    param=first)


def _field(exc: ValidationError | RequestValidationError,
           loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """A bad field's path without FastAPI's first item, where the field was (body, query,
    path, header)."""
    if isinstance(exc, RequestValidationError) and loc and loc[0] in _LOCATIONS:
        return loc[1:]
    return loc


def install(app: FastAPI) -> None:
    """Make every error the app raises answer in OpenAI's shape."""

    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, exc: RequestError) -> JSONResponse:
        status = 404 if exc.code == "model_not_found" else 400
        return APIError(status, str(exc), param=exc.param, code=exc.code).response()

    @app.exception_handler(SubmitError)
    async def _submit(_: Request, exc: SubmitError) -> JSONResponse:
        return from_submit(exc).response()

    @app.exception_handler(RequestValidationError)
    async def _request(_: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation(exc).response()

    @app.exception_handler(ValidationError)
    async def _pydantic(_: Request, exc: ValidationError) -> JSONResponse:
        return from_validation(exc).response()

    @app.exception_handler(GatewayClosing)
    async def _closing(_: Request, exc: GatewayClosing) -> JSONResponse:
        return APIError(503, "the gateway is shutting down; try again (another gateway)",
                        "service_unavailable", code="gateway_shutdown",
                        retry_after=RETRY_OVERLOADED).response()

    @app.exception_handler(RedisError)
    @app.exception_handler(RedisOutage)
    async def _redis(_: Request, exc: Exception) -> JSONResponse:
        return from_redis(exc).response()

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type_).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.error("gateway.error", error_type=type(exc).__name__, error=str(exc))
        return APIError(500, f"internal error ({type(exc).__name__})", "server_error").response()
