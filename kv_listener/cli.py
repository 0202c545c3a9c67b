"""Command line: argv -> config -> app. Exit codes: 0 ok, 1 runtime failure, 2 usage/config error.

    continuum-kv-listener --config PATH           run the listener
    continuum-kv-listener router --config PATH    run the companion router (ROUTER.yaml)
    continuum-kv-listener demo [--duration S] [--engines N] [--headless]
                                                  the whole pipeline locally, simulated engines
    continuum-kv-listener simulate --config PATH [--duration S]
                                                  simulated engines feeding a listener file's
                                                  loopback endpoints
    continuum-kv-listener config validate PATH    check a listener or router file
    continuum-kv-listener --version

Errors are one line on stderr each, never a traceback: operators read these in `journalctl`.
A listener or router that cannot start writes them in its file's log format (JSON unless the
file says `log.format: console`), so a log pipeline that expects JSON gets JSON even then.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from kv_listener import __version__
from kv_listener.config import LISTENER_TOP_KEYS, parse_config
from kv_listener.configkit import ConfigError, YamlContentError, is_router_file, read_yaml
from kv_listener.errors import StartError

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
    val = cfg_sub.add_parser(
        "validate", help="check a listener or router configuration file",
        description="Check a listener file (top-level 'sources') or a router file (top-level "
        "'kv_cache_index') exactly as a start or a SIGHUP reload would: YAML syntax, duplicate "
        "keys, unknown keys, types, ranges, addresses, referenced files. Every problem is "
        "printed as 'PATH: error: KEY: message', then 'PATH: N error(s)'; warnings (valid, but "
        "probably not what was meant) as 'PATH: warning: ...'. Nothing is started or bound.",
        epilog="Exit status: 0 valid (warnings allowed), 2 invalid or unreadable.")
    val.add_argument("path", metavar="PATH", help="the YAML file to check")

    rtr = sub.add_parser("router", help="run the companion router (KV index, scorer, consumers, "
                                        "event bus, admin JSON)")
    rtr.add_argument("--config", "-c", metavar="PATH", dest="router_config", required=True,
                     help="router configuration file (YAML, top-level kv_cache_index)")

    sim = sub.add_parser(
        "simulate", help="simulated engines feeding a listener file's loopback endpoints",
        description="For every vLLM or SGLang source of a listener file, a simulated engine "
        "publishes real-format KV events to its zmq_endpoint (in the opposite mode of the "
        "source) and serves its loopback detokenize_endpoint and /tokenizer_info; TRT-LLM "
        "sources get a simulated /kv_cache_events at a loopback trtllm_endpoint. A chat "
        "workload runs until --duration or Ctrl-C.",
        epilog="Exit status: 0 clean stop, 2 invalid file, 1 runtime failure (a busy port).")
    sim.add_argument("--config", "-c", metavar="PATH", dest="simulate_config", required=True,
                     help="the LISTENER configuration file whose endpoints to feed")
    sim.add_argument("--duration", metavar="S", type=_duration_s, default=None,
                     help="stop after S seconds (default: run until Ctrl-C)")

    demo = sub.add_parser("demo", help="run simulated engines, the listener and the router on "
                                       "127.0.0.1 with a live view")
    demo.add_argument("--duration", metavar="S", type=_duration_s, default=None,
                      help="stop after S seconds (default: run until Ctrl-C)")
    demo.add_argument("--engines", metavar="N", type=_engines, default=2,
                      help=f"simulated engines, {MIN_ENGINES}..{MAX_ENGINES} (default 2)")
    demo.add_argument("--headless", action="store_true",
                      help="no live view: plain progress lines, the figures per backend and the "
                           "summary line (also when stdout is not a TTY)")
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
    except YamlContentError as exc:
        return _print_file_errors(path, exc.problems)
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
        return _print_file_errors(path, exc.errors)
    for w in warnings:
        sys.stdout.write(f"{path}: warning: {w}\n")
    sys.stdout.write(f"{path}: {summary}\n")
    return EXIT_OK


def _print_file_errors(path: str, errors: Sequence[str]) -> int:
    for err in errors:
        sys.stderr.write(f"{path}: error: {err}\n")
    sys.stderr.write(f"{path}: {len(errors)} error(s)\n")
    return EXIT_USAGE


def _file_log_format(path: str) -> str | None:
    """The log format a file asks for (`json` by default), or None when it cannot be told."""
    try:
        raw = read_yaml(path)
    except ConfigError:
        return None
    if not isinstance(raw, dict):
        return None
    log = raw.get("log")
    fmt = log.get("format", "json") if isinstance(log, dict) else "json"
    return fmt if fmt in ("json", "console") else None


def _fatal(event: str, errors: Sequence[str], code: int, path: str | None) -> int:
    """Errors that stop a listener or router: JSON log lines when the process logs JSON (or
    its file asks for it and logging was not set up yet), else one plain line each."""
    from kv_listener.logging import configure_logging, configured_format, log_fatal  # noqa: PLC0415

    fmt = configured_format()
    if fmt is None and path is not None and _file_log_format(path) == "json":
        configure_logging("info", "json")
        fmt = "json"
    if fmt == "json":
        log_fatal(event, errors, exit_code=code)
    else:
        for err in errors:
            sys.stderr.write(f"{PROG}: error: {err}\n")
    return code


def _run_process(run: Callable[[str], int], path: str) -> int:
    """A long-running mode (listener, router): its start-up errors in its own log format."""
    try:
        return run(path)
    except ConfigError as exc:
        return _fatal("config_invalid", exc.errors, EXIT_USAGE, path)
    except StartError as exc:
        return _fatal("start_failed", exc.errors, EXIT_FAILURE, path)
    except KeyboardInterrupt:
        return EXIT_OK
    except Exception as exc:  # a bug: said once, in the log format, with its traceback
        from kv_listener.logging import configured_format  # noqa: PLC0415

        if configured_format() is None:
            raise
        import structlog  # noqa: PLC0415

        structlog.get_logger("kv_listener").critical("fatal_error", error=type(exc).__name__,
                                                     exc_info=exc)
        return EXIT_FAILURE


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    if args.command is not None and args.config is not None:
        where = {"router": "router --config PATH", "simulate": "simulate --config PATH",
                 "config": "config validate PATH"}.get(args.command)
        hint = f"; did you mean '{PROG} {where}'?" if where else ""
        return _fail(f"--config before a command runs the listener and cannot be combined with "
                     f"'{args.command}'{hint}")
    try:
        if args.command == "config":
            if args.config_command != "validate":
                return _fail("config needs an action: 'config validate PATH'")
            return cmd_validate(args.path)
        if args.command == "router":
            from kv_listener.router.app import run_router  # noqa: PLC0415

            return _run_process(run_router, args.router_config)
        if args.command == "simulate":
            from kv_listener.simulate import run_simulate  # noqa: PLC0415

            return run_simulate(args.simulate_config, args.duration)
        if args.command == "demo":
            from kv_listener.demo import run_demo  # noqa: PLC0415

            return run_demo(args.duration, engines=args.engines, headless=args.headless)
        if args.config is None:
            return _fail("nothing to do: give --config PATH to run, or a command (see --help)")
        from kv_listener.app import run_listener  # noqa: PLC0415

        return _run_process(run_listener, args.config)
    except ConfigError as exc:
        for err in exc.errors:
            sys.stderr.write(f"{PROG}: error: {err}\n")
        return EXIT_USAGE
    except StartError as exc:
        for err in exc.errors:
            sys.stderr.write(f"{PROG}: error: {err}\n")
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return EXIT_OK


def entrypoint() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entrypoint()
