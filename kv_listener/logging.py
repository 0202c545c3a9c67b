"""Structured logging for the daemon: structlog, JSON lines by default, console optional.

One event name per line (`zmq_gap`, `source_restarted`, ...) with key-value context; sources bind
`backend` and `engine`. Never pass salts, token IDs or prompt text to a logger.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Sequence
from types import TracebackType
from typing import TextIO

import structlog
from structlog.typing import EventDict

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


#: "format": what logging was last configured with; None until then.
_state: dict[str, str | None] = {"format": None}


def configured_format() -> str | None:
    """`json` or `console` once `configure_logging` ran, else None (fatal errors met before
    then are written as plain lines, or as JSON by whoever knows the file asks for it)."""
    return _state["format"]


def _library_record(_logger: object, _method: str, ed: EventDict) -> EventDict:
    """A stdlib record (uvicorn, hypercorn, asyncio, zmq.auth, a Python warning) keeps its text
    as `message` under one event name, so every line still has an event name to filter on."""
    record = ed.get("_record")
    name = record.name if isinstance(record, logging.LogRecord) else "unknown"
    message = ed.pop("event", "")
    ed["message"] = message.rstrip() if isinstance(message, str) else message
    ed["event"] = "python_warning" if name == "py.warnings" else "library_log"
    ed["logger"] = name
    return ed


def configure_logging(level: str = "info", fmt: str = "json", stream: TextIO | None = None) -> None:
    """Configure structlog, and render what libraries log through stdlib `logging` (uvicorn,
    hypercorn, asyncio, aiohttp, zmq.auth), Python warnings and uncaught exceptions the same
    way: with `fmt="json"` every line the process writes to `stream` is one JSON object.

    Safe to call again on reload: the level and format of an already running process change.
    """
    _state["format"] = fmt
    out = stream if stream is not None else sys.stderr
    renderer: structlog.typing.Processor
    if fmt == "console":
        renderer = structlog.dev.ConsoleRenderer(colors=False)
    else:
        renderer = structlog.processors.JSONRenderer()
    stamp = structlog.processors.TimeStamper(fmt="iso", utc=True)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            stamp,
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(file=out),
        cache_logger_on_first_use=False,
    )
    # Libraries stay quiet below WARNING unless we are debugging.
    handler = logging.StreamHandler(out)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[structlog.stdlib.add_log_level, stamp, _library_record],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.format_exc_info, renderer]))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(_LEVELS[level] if level == "debug" else logging.WARNING)
    logging.captureWarnings(True)
    # transformers logs through its own stderr handler in its own format ("[transformers] ...")
    # and, at import, advises installing PyTorch, which a tokenizer-only process never needs.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    adopt_transformers_logging()
    sys.excepthook = _log_uncaught
    threading.excepthook = _log_uncaught_in_thread
    sys.unraisablehook = _log_unraisable


def adopt_transformers_logging() -> None:
    """Once `transformers` is imported: its records go through the root handler (JSON) instead
    of its own plain-text one. Called by `configure_logging` and right after each import."""
    tf_logging = sys.modules.get("transformers.utils.logging")
    if tf_logging is not None:
        tf_logging.disable_default_handler()
        tf_logging.enable_propagation()


def _log_uncaught(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    structlog.get_logger("kv_listener").critical("uncaught_exception", exc_info=(kind, exc, tb))


def _log_uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
    if args.exc_value is None:
        return
    structlog.get_logger("kv_listener").critical(
        "uncaught_exception", thread=args.thread.name if args.thread is not None else None,
        exc_info=(args.exc_type, args.exc_value, args.exc_traceback))


def _log_unraisable(args: sys.UnraisableHookArgs) -> None:
    # e.g. an exception in a __del__ or a finalizer at interpreter exit
    exc = args.exc_value
    structlog.get_logger("kv_listener").error(
        "unraisable_exception", detail=args.err_msg or "exception ignored",
        error=type(exc).__name__ if exc is not None else None,
        exc_info=(args.exc_type, exc, args.exc_traceback) if exc is not None else None)


def log_fatal(event: str, errors: Sequence[str], **context: object) -> None:
    """The last words of a process that cannot go on (a configuration or start-up error, one
    `errors` entry per problem): one log line per problem, in the configured format."""
    log = structlog.get_logger("kv_listener")
    for err in errors:
        log.error(event, detail=err, **context)


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
