"""Command line: argv -> config -> app. Exit codes: 0 ok, 1 runtime failure, 2 usage/config error.

    continuum-kv-listener --config PATH           run the listener
    continuum-kv-listener router --config PATH    run the companion router (ROUTER.yaml)
    continuum-kv-listener demo [--duration S] [--engines N] [--headless]
                                                  the whole pipeline locally, simulated engines
    continuum-kv-listener config validate PATH    check a listener or router file
    continuum-kv-listener --version

Errors are one line on stderr, never a traceback: operators read these in `journalctl`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from kv_listener import __version__
from kv_listener.config import LISTENER_TOP_KEYS, ConfigError, parse_config, read_yaml

PROG = "continuum-kv-listener"
EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse prints usage plus an error on two or more lines; we want exactly one line."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{PROG}: error: {message} (see '{PROG} --help')\n")
        raise SystemExit(EXIT_USAGE)


def _build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=PROG,
        description="KV-cache event listener: engine events -> router prefix keys, served as "
        "resumable SSE streams or pushed to a router's event bus.",
        epilog="See continuum-kv-listener(1) for the configuration reference.",
    )
    p.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    p.add_argument(
        "--config", "-c", metavar="PATH", help="listener configuration file (YAML); runs the listener"
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    cfg = sub.add_parser("config", help="configuration tools")
    cfg_sub = cfg.add_subparsers(dest="config_command", metavar="ACTION", parser_class=_Parser)
    val = cfg_sub.add_parser("validate", help="check a listener or router configuration file")
    val.add_argument("path", metavar="PATH")

    rtr = sub.add_parser("router", help="run the companion router (KV index, scorer, consumers, "
                                        "event bus, admin JSON)")
    rtr.add_argument("--config", "-c", metavar="PATH", dest="router_config", required=True,
                     help="router configuration file (YAML, top-level kv_cache_index)")

    demo = sub.add_parser("demo", help="run simulated engines, the listener and the router on "
                                       "127.0.0.1 with a live view")
    demo.add_argument("--duration", metavar="S", type=_duration_s, default=None,
                      help="stop after S seconds (default: run until Ctrl-C)")
    demo.add_argument("--engines", metavar="N", type=_engines, default=2,
                      help=f"simulated engines, {MIN_ENGINES}..{MAX_ENGINES} (default 2)")
    demo.add_argument("--headless", action="store_true",
                      help="no live view; print only the summary (also when stdout is not a TTY)")
    return p


MIN_ENGINES, MAX_ENGINES = 2, 8


def _duration_s(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value <= 86400 * 365:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def _engines(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not MIN_ENGINES <= value <= MAX_ENGINES:
        raise argparse.ArgumentTypeError(f"must be between {MIN_ENGINES} and {MAX_ENGINES}, "
                                         f"got {value}")
    return value


def _fail(message: str, code: int = EXIT_USAGE) -> int:
    sys.stderr.write(f"{PROG}: error: {message}\n")
    return code


def _config_kind(raw: Any) -> str | None:
    """Tell a listener file from a router file by its top-level keys (SPEC §8)."""
    from kv_listener.router.config import is_router_file  # noqa: PLC0415

    if not isinstance(raw, dict):
        return None
    if is_router_file(raw):
        return "router"
    if "sources" in raw or set(raw) & LISTENER_TOP_KEYS:
        return "listener"
    return None


def cmd_validate(path: str) -> int:
    try:
        raw = read_yaml(path)
    except ConfigError as exc:
        return _fail(exc.errors[0])
    kind = _config_kind(raw)
    try:
        if kind == "router":
            from kv_listener.router.config import parse_router_config  # noqa: PLC0415

            router_cfg = parse_router_config(raw)
            warnings = router_cfg.warnings
            summary = (
                f"valid router configuration ({len(router_cfg.kv_cache_index.event_sources)} event sources)"
            )
        elif kind == "listener":
            cfg = parse_config(raw)
            warnings = cfg.warnings
            summary = f"valid listener configuration ({len(cfg.sources)} sources)"
        else:
            return _fail(
                f"{path}: neither a listener file (top-level 'sources') nor a router "
                "file (top-level 'kv_cache_index')"
            )
    except ConfigError as exc:
        for err in exc.errors:
            sys.stderr.write(f"{path}: error: {err}\n")
        sys.stderr.write(f"{path}: {len(exc.errors)} error(s)\n")
        return EXIT_USAGE
    for w in warnings:
        sys.stdout.write(f"{path}: warning: {w}\n")
    sys.stdout.write(f"{path}: {summary}\n")
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    try:
        if args.command == "config":
            if args.config_command != "validate":
                return _fail("config needs an action: 'config validate PATH'")
            return cmd_validate(args.path)
        if args.command == "router":
            from kv_listener.router.app import run_router  # noqa: PLC0415

            return run_router(args.router_config)
        if args.command == "demo":
            from kv_listener.demo import run_demo  # noqa: PLC0415

            return run_demo(args.duration, engines=args.engines, headless=args.headless)
        if args.config is None:
            return _fail("nothing to do: give --config PATH to run, or a command (see --help)")
        from kv_listener.app import run_listener  # noqa: PLC0415

        return run_listener(args.config)
    except ConfigError as exc:
        for err in exc.errors:
            sys.stderr.write(f"{PROG}: error: {err}\n")
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_OK


def entrypoint() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entrypoint()
