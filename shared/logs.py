"""structlog configuration: one JSON object per line, events with fields, never sentences.

Operators grep and ship these lines; every event name is a dotted noun.verb
(``job.started``, ``rollback.replay``) and context such as job id, worker, model and attempt
is bound once with ``bind_contextvars`` so every line of a job carries it.
"""

from __future__ import annotations

import logging
import sys
from typing import IO, Any

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}


def configure_logging(
    level: str = "info", fmt: str = "json", stream: IO[str] | None = None
) -> None:
    """Configure structlog for the process; safe to call more than once."""
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
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


def get_logger(component: str) -> structlog.typing.FilteringBoundLogger:
    """A logger whose every event carries ``component``.

    Stays a lazy proxy, so a module-level logger created at import follows a
    :func:`configure_logging` that runs later (a CLI sets its level after importing).
    """
    return structlog.get_logger(component=component)
