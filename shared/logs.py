"""structlog configuration: one JSON object per line, events with fields, never sentences.

Operators grep and ship these lines; every event name is a dotted noun.verb
(``job.started``, ``rollback.replay``) and context such as job id, worker, model and attempt
is bound once with ``bind_contextvars`` so every line of a job carries it. Every string in an
event (fields, nested values, a formatted traceback) passes :func:`shared.redact.redact` last,
so a Redis URL or an exception text that embeds one never ships a password.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

import structlog

from shared.redact import redact

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}


def _redacted(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {k: _redacted(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_redacted(v) for v in value]
    return redact(repr(value))  # what either renderer would print for it, masked first


def redact_secrets(logger: Any, method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    """structlog processor: credentials in any value of the event are masked, strings and
    the reprs of other objects alike (the safety net behind every call site that renders a
    URL itself)."""
    return _redacted(event_dict)


class _StdlibBridge(logging.Handler):
    """Libraries' ``logging`` records (rq's text logs, redis-py) as structlog events:
    ``<library>.log`` (``rq.log``) with ``logger`` and ``message`` fields, at their own level,
    so they reach the same JSON stream (redacted, filterable) instead of raw stderr."""

    def emit(self, record: logging.LogRecord) -> None:
        if sys.is_finalizing():
            # A library's __del__ logging while the interpreter shuts down (an HTTP client's
            # "close.started"): imports fail by then, and stdlib would print a traceback.
            return
        try:
            library = record.name.split(".", 1)[0] or "root"
            method = logging.getLevelName(min(record.levelno, logging.ERROR)).lower()
            log = getattr(get_logger(library), method, None)
            if log is not None:
                log(f"{library}.log", logger=record.name, message=record.getMessage())
        except Exception:  # a broken record must never take the process down
            self.handleError(record)


def _bridge_stdlib_logging(level: int) -> None:
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, _StdlibBridge)]:
        root.removeHandler(handler)
    root.addHandler(_StdlibBridge())
    root.setLevel(level)


def configure_logging(
    level: str = "info", fmt: str = "json", stream: TextIO | None = None
) -> None:
    """Configure structlog for the process (and route stdlib ``logging`` into it); safe to
    call more than once."""
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
        redact_secrets,
    ]
    renderer: Any = (
        structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer()
    )
    structlog.configure(
        processors=[*processors, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(
            _LEVELS.get(level.lower(), logging.INFO)
        ),
        logger_factory=structlog.PrintLoggerFactory(stream or sys.stderr),
        cache_logger_on_first_use=False,
    )
    _bridge_stdlib_logging(_LEVELS.get(level.lower(), logging.INFO))


def get_logger(component: str) -> structlog.typing.FilteringBoundLogger:
    """A logger whose every event carries ``component``.

    Stays a lazy proxy, so a module-level logger created at import follows a
    :func:`configure_logging` that runs later (a CLI sets its level after importing).
    """
    return structlog.get_logger(component=component)
