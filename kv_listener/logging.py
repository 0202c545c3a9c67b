"""Structured logging for the daemon: structlog, JSON lines by default, console optional.

One event name per line (`zmq_gap`, `source_restarted`, ...) with key-value context; sources bind
`backend` and `engine`. Never pass salts, token IDs or prompt text to a logger.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import TextIO

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def configure_logging(level: str = "info", fmt: str = "json", stream: TextIO | None = None) -> None:
    """Configure structlog (and route stdlib logging of our libraries through the same level).

    Safe to call again on reload: the level and format of an already running process change.
    """
    out = stream if stream is not None else sys.stderr
    renderer: structlog.typing.Processor
    if fmt == "console":
        renderer = structlog.dev.ConsoleRenderer(colors=False)
    else:
        renderer = structlog.processors.JSONRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(file=out),
        cache_logger_on_first_use=False,
    )
    # Libraries (uvicorn, aiohttp, asyncio) log through stdlib; keep them quiet below WARNING
    # unless we are debugging, and make them write plain lines to the same stream.
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(_LEVELS[level] if level == "debug" else logging.WARNING)


def apply_config_logging(level: str, fmt: str, warnings: Sequence[str]) -> None:
    """At start and on every reload: (re)configure logging from the file, then log the file's
    warnings (with the new format, so they land where the operator now looks)."""
    configure_logging(level, fmt)
    log = structlog.get_logger("kv_listener.config")
    for w in warnings:
        log.warning("config_warning", detail=w)


def get_logger(name: str, **context: object) -> structlog.typing.FilteringBoundLogger:
    logger: structlog.typing.FilteringBoundLogger = structlog.get_logger(name)
    return logger.bind(**context) if context else logger
