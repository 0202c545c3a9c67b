"""`continuum-kv-listener demo`: the whole pipeline on 127.0.0.1, with simulated engines.

Owns the demo's process tree and its live view. Nothing leaves the machine and nothing is
downloaded (no GPU, no model: a tiny ChatML tokenizer ships in the package):

    chat workload --route, POST /v1/chat/completions--> simulated vLLM engines (OpenAI servers,
    `sim/server.py`) --ZMQ (vLLM 0.33 wire)--> listener (child process: `python -m kv_listener
    --config <temp file>`, the real daemon) --/detokenize--> the engines; listener --SSE
    GET /events/{backend}--> router (in process: consumers -> in-memory KV index -> overlap
    scorer) --> routing decisions for the next requests.

Each request of a seeded chat workload (a few long system prompts, many users) gets its prefix
key the router's way; the scorer picks the backend that holds the prefix (`kv_aware`) or, when no
backend scores above the pool threshold, the demo's default strategy picks the least-loaded
engine (`fallback`, round-robin among equals). The chosen engine serves it from its block pool
and answers with `usage.prompt_tokens_details.cached_tokens`: the ground truth behind the hit
rate (cached prompt tokens / prompt tokens, the engines' own measure, like vLLM's prefix cache
hit rate). Its KV events flow back through the listener into the router's index.

Setting up takes seconds (the tokenizer, then the listener's own start; 10 s and more on a busy
machine), so the first output comes at once: on a terminal (stdout a TTY, not `--headless`,
TERM not `dumb`) a start-up view lists what the demo waits for (engines up, listener ready,
router consuming, first prefix records) and gives way to the live view, redrawn twice a second
with plain ANSI escapes, a legend of its columns under it. Otherwise every line is plain text
with no escape codes: one line when the demo starts, one per stage, the per-backend figures at
the end. The demo ends after `--duration` seconds of traffic, or on Ctrl-C / SIGTERM / SIGHUP:
traffic stops, running requests finish, the listener gets SIGTERM (and must exit 0), the router
and engines stop, and the last stdout line is the summary
`routing: kv_aware=<n> fallback=<m> hit_rate=<x>`, printed once (the live view does not carry
it). Exit 0, or 1 when something failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections import deque
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

import aiohttp
import yaml

from kv_listener.config import LogConfig
from kv_listener.logging import configure_logging, get_logger
from kv_listener.resolver.template import DEMO_TOKENIZER_DIR, load_tokenizer
from kv_listener.router.app import Router
from kv_listener.router.config import (
    AdminConfig,
    EventSourceConfig,
    KvCacheIndexConfig,
    RouterConfig,
    Transport,
)
from kv_listener.router.index import InMemoryKvIndex
from kv_listener.router.metrics import Decision
from kv_listener.sim.detokenize_server import tokenizer_info
from kv_listener.sim.engine import ServeResult, SimEngine
from kv_listener.sim.server import EngineServer, ServiceTiming
from kv_listener.sim.workload import DEMO_MODEL, ChatRequest, ChatWorkload

log = get_logger("kv_listener.demo")

PROG = "continuum-kv-listener"
#: KV blocks per simulated engine (16 tokens each). The workload's five system prompts take
#: about 140 blocks together: one engine can hold them all, but not with much room for the rest.
ENGINE_BLOCKS = 256
#: How long a simulated request takes (the pace the demo had with the engines' own Timing):
#: 5 ms per prefill step, 0.3 ms per uncached prompt token, 3 ms per output token, real time.
TIMING = ServiceTiming(overhead_s=0.005, prefill_s_per_token=0.0003, decode_s_per_token=0.003,
                       time_scale=1.0)
#: Requests per second the workload sends (Poisson arrivals), over all engines.
REQUEST_RATE = 30.0
#: Requests that may wait or run at once; beyond that arrivals are skipped (never queued forever).
MAX_OUTSTANDING = 256
SEED = 7
LISTENER_START_TIMEOUT_S = 60.0
LISTENER_STOP_TIMEOUT_S = 20.0
CONNECT_TIMEOUT_S = 15.0
#: Running requests get this long to finish once traffic stops; the rest are cancelled.
FINISH_TIMEOUT_S = 5.0
REDRAW_INTERVAL_S = 0.5
#: The start-up view is redrawn this often (its clock shows that something is happening).
STARTUP_REDRAW_INTERVAL_S = 0.2
#: How long the start-up view waits for the first prefix records once traffic runs.
FIRST_RECORDS_PATIENCE_S = 10.0
#: After a SIGINT, how long to look for the listener stopping on its own (a terminal's Ctrl-C
#: reached it too) before it gets SIGTERM.
SIGINT_GRACE_S = 2.0


class DemoError(Exception):
    """The demo could not run (the listener did not start, ...): one line for the operator."""


def free_ports(n: int) -> list[int]:
    """`n` distinct TCP ports on 127.0.0.1 that were free a moment ago (the listener binds its
    HTTP and ZMQ addresses from its config file, where port 0 cannot be read back)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:  # all held open at once, so the ports differ
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


# --- counters and the view ---------------------------------------------------------------------


@dataclass(slots=True)
class BackendCounters:
    requests: int = 0  # served to the end
    kv_aware: int = 0
    fallback: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(slots=True)
class Totals:
    kv_aware: int = 0  # routing decisions (counted when made, like the router's metric)
    fallback: int = 0
    requests: int = 0  # requests served to the end
    skipped: int = 0  # arrivals dropped because MAX_OUTSTANDING requests were pending
    prompt_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def summary_line(totals: Totals) -> str:
    """The line the demo ends with (SPEC §9)."""
    return (f"routing: kv_aware={totals.kv_aware} fallback={totals.fallback} "
            f"hit_rate={totals.hit_rate:.2f}")


@dataclass(frozen=True, slots=True)
class BackendRow:
    name: str
    running: int
    counters: BackendCounters
    cached_blocks: int
    total_blocks: int
    records: int  # prefix records the router applied from this backend's stream
    connected: bool


@dataclass(frozen=True, slots=True)
class PrefixRow:
    label: str  # system prompt name
    prefix_hash: str
    holders: tuple[tuple[str, int], ...]  # (backend, token_count), most tokens first


@dataclass(frozen=True, slots=True)
class ViewState:
    elapsed_s: float
    duration_s: float | None
    backends: tuple[BackendRow, ...]
    prefixes: tuple[PrefixRow, ...]
    other_prefixes: int  # indexed prefixes that are not one of the workload's prompts
    totals: Totals
    listener: str  # e.g. "pid 1234 on 127.0.0.1:40123"
    admin_url: str
    listener_warnings: int = 0
    stopping: bool = False
    done: bool = False
    rate_rps: float = field(default=0.0)


def _bar(fraction: float, width: int = 24) -> str:
    filled = max(0, min(width, round(fraction * width)))
    return "#" * filled + "." * (width - filled)


#: What the live view's columns mean, shown under it (packed to the terminal's width).
LEGEND: tuple[tuple[str, str], ...] = (
    ("run", "in flight"),
    ("requests", "served"),
    ("kv_aware", "routed to a holder the index named"),
    ("fallback", "least-loaded (no holder)"),
    ("hit rate", "cached/prompt tokens"),
    ("cached", "engine's cached/total KV blocks"),
    ("records", "prefix records indexed"),
    ("stream", "listener -SSE-> router"),
    ("holders", "engines the index says cache the prompt"),
)


def pack(items: Sequence[str], width: int, sep: str = "  ") -> list[str]:
    """`items` in order on as few lines of `width` columns as fit, never split inside an item
    (one longer than `width` gets a line of its own and is cut by the caller)."""
    lines: list[str] = []
    for item in items:
        if lines and len(lines[-1]) + len(sep) + len(item) <= width:
            lines[-1] += sep + item
        else:
            lines.append(item)
    return lines


def render_view(state: ViewState, width: int = 80) -> list[str]:
    """The live view as plain lines (no escapes), each cut to `width` columns; the tables fit
    in 80. The summary line is not part of it: it is printed once, after the last drawing."""
    if state.duration_s is not None:
        frac = min(1.0, state.elapsed_s / state.duration_s) if state.duration_s > 0 else 1.0
        progress = (f"{state.elapsed_s:5.1f}s/{state.duration_s:g}s "
                    f"[{_bar(frac, 16)}] {frac * 100:3.0f}%")
    else:
        progress = f"{state.elapsed_s:5.1f}s"
    status = "done" if state.done else "stopping..." if state.stopping else "Ctrl-C to stop"
    lines = [
        f"{PROG} demo  {progress}  {status}",
        f"engines -ZMQ-> listener ({state.listener}) -SSE-> router",
        f"router admin: {state.admin_url}  traffic {state.rate_rps:.1f} req/s",
        "",
        f"{'backend':<8} {'run':>4} {'requests':>8} {'kv_aware':>8} {'fallback':>8} "
        f"{'hit rate':>8} {'cached':>8} {'records':>7}  stream",
    ]
    for b in state.backends:
        c = b.counters
        lines.append(
            f"{b.name:<8} {b.running:>4} {c.requests:>8} {c.kv_aware:>8} {c.fallback:>8} "
            f"{c.hit_rate:>8.2f} {f'{b.cached_blocks}/{b.total_blocks}':>8} {b.records:>7}  "
            f"{'up' if b.connected else 'down'}")
    t = state.totals
    up = sum(b.connected for b in state.backends)
    cached = f"{sum(b.cached_blocks for b in state.backends)}/" \
             f"{sum(b.total_blocks for b in state.backends)}"
    lines.append(
        f"{'all':<8} {sum(b.running for b in state.backends):>4} {t.requests:>8} "
        f"{t.kv_aware:>8} {t.fallback:>8} {t.hit_rate:>8.2f} {cached:>8} "
        f"{sum(b.records for b in state.backends):>7}  {up}/{len(state.backends)} up")
    lines += ["", f"{'system prompt':<14} {'prefix hash':<14} holders in the router's index "
                  "(tokens)"]
    for p in state.prefixes:
        holders = "  ".join(f"{b}: {n}" for b, n in p.holders) if p.holders else "-"
        lines.append(f"{p.label:<14} {p.prefix_hash[:12] + '..':<14} {holders}")
    if state.other_prefixes:
        lines.append(f"{'(other)':<14} {state.other_prefixes} more prefixes")
    if t.skipped or state.listener_warnings:
        lines += ["", f"skipped arrivals (over {MAX_OUTSTANDING} pending): {t.skipped}  "
                      f"listener warnings: {state.listener_warnings}"]
    # Last, so that a short terminal loses the legend first (see LiveView.draw).
    lines += ["", *pack([f"{k}: {v}" for k, v in LEGEND], min(width, 80))]
    return [line[:width] for line in lines]


# --- the start-up view -------------------------------------------------------------------------


@dataclass(slots=True)
class Stage:
    """One step the demo waits for before its live view means something."""

    name: str  # "engines up", ...
    waiting_for: str  # what it waits for, shown until it is done
    done_s: float | None = None  # seconds from the start when it was done
    detail: str = ""  # what came up, once done
    failed: bool = False


def startup_stages(engines: int) -> list[Stage]:
    return [
        Stage("engines up", f"{engines} simulated vLLM engines: tokenizer, servers"),
        Stage("listener ready", "the listener daemon, subscribed to their ZMQ"),
        Stage("router consuming", "its consumers on the listener's SSE streams"),
        Stage("first prefix records", "traffic's KV events in the router's index"),
    ]


def startup_line(engines: int) -> str:
    """The first line the headless demo prints, before anything starts."""
    names = ", ".join(s.name for s in startup_stages(engines))
    return (f"demo: starting {engines} simulated vLLM engines, the listener and the router on "
            f"127.0.0.1; waiting for: {names}")


def stage_line(stage: Stage) -> str:
    """A headless line for a stage that is done (or failed)."""
    when = f"{stage.done_s:.1f} s" if stage.done_s is not None else "?"
    if stage.failed:
        return f"demo: {stage.name}: failed after {when}"
    return f"demo: {stage.name} ({when}): {stage.detail}"


def render_startup(stages: Sequence[Stage], elapsed_s: float, *, status: str = "Ctrl-C to stop",
                   width: int = 80) -> list[str]:
    """The start-up view: what is starting and what it waits for (plain lines, cut to `width`;
    they fit in 80)."""
    current = next((i for i, s in enumerate(stages) if s.done_s is None), len(stages))
    lines = [f"{PROG} demo  starting {elapsed_s:5.1f}s  {status}",
             "engines -ZMQ-> listener -SSE-> router on 127.0.0.1, waiting for:", ""]
    for i, s in enumerate(stages):
        if s.failed:
            mark, when, text = "fail", f"{s.done_s or 0:4.1f}s", s.waiting_for
        elif s.done_s is not None:
            mark, when, text = " ok ", f"{s.done_s:4.1f}s", s.detail
        else:
            mark, when, text = " .. " if i == current else "    ", "", s.waiting_for
        lines.append(f"[{mark}] {s.name:<20} {when:>5}  {text}")
    lines += ["", "then the live view"]
    return [line[:width] for line in lines]


class LiveView:
    """Redraws the view in place: cursor up over the last drawing, clear to the end, print."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self._lines = 0
        self._cursor_hidden = False

    def draw(self, lines: Sequence[str], rows: int | None = None, *, last: bool = False) -> None:
        """Draw `lines`, at most `rows - 1` of them: a drawing taller than the terminal would
        scroll, and the cursor could no longer go back to its first line. The `last` drawing
        shows the cursor again before its final newline, so the line printed after it (the
        summary) starts clean."""
        if rows is not None and len(lines) >= rows:
            lines = lines[:max(1, rows - 1)]
        buf = []
        if self._lines:
            buf.append(f"\x1b[{self._lines}F\x1b[J")
        if not self._cursor_hidden and not last:
            buf.append("\x1b[?25l")  # hidden while drawing
            self._cursor_hidden = True
        buf.append("\n".join(lines))
        if last and self._cursor_hidden:
            buf.append("\x1b[?25h")
            self._cursor_hidden = False
        buf.append("\n")
        self.out.write("".join(buf))
        self.out.flush()
        self._lines = len(lines)

    def close(self) -> None:
        if self._cursor_hidden:
            self.out.write("\x1b[?25h")
            self.out.flush()
            self._cursor_hidden = False


# --- the listener child process ----------------------------------------------------------------


async def run_unless_stopped(coro: Coroutine[Any, Any, Any], stop: asyncio.Event) -> bool:
    """Run `coro` unless `stop` is set first: then it is cancelled and the answer is False.
    What `coro` raised is raised."""
    work = asyncio.ensure_future(coro)
    stopped = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({work, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if not work.done():
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        return False
    work.result()
    return True


class ListenerProcess:
    """`python -m kv_listener --config PATH` as a child: its JSON log is read line by line
    (`listener_started` tells its readiness; warnings are counted; the tail is kept for an
    error report). A subclass runs another of the package's processes by changing `ROLE`,
    `COMMAND` and the two log events (bench/soak.py runs the router so)."""

    ROLE = "listener"
    COMMAND: tuple[str, ...] = ()  # between `-m kv_listener` and `--config PATH`
    STARTED_EVENT = "listener_started"
    STOPPING_EVENT = "listener_stopping"

    def __init__(self, config_path: Path) -> None:
        self.config_path = config_path
        self.proc: asyncio.subprocess.Process | None = None
        self.started = asyncio.Event()
        self.stopping = asyncio.Event()  # it logged `listener_stopping`: a signal reached it
        self.warnings = 0
        self.tail: deque[str] = deque(maxlen=30)
        self._reader: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    async def start(self, timeout_s: float) -> None:
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   TOKENIZERS_PARALLELISM="false")
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kv_listener", *self.COMMAND, "--config", str(self.config_path),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE, env=env, limit=1 << 20)
        self._reader = asyncio.create_task(self._read_log(), name=f"{self.ROLE}-log")
        started = asyncio.create_task(self.started.wait())
        try:
            done, _ = await asyncio.wait({started, self._reader}, timeout=timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            started.cancel()
        if not self.started.is_set():
            why = "exited" if self._reader in done else f"did not start within {timeout_s:g} s"
            raise DemoError(f"the {self.ROLE} {why}: {self.last_error()}")

    def last_error(self) -> str:
        for line in reversed(self.tail):
            try:
                rec = json.loads(line)
            except ValueError:
                if line.strip():
                    return line.strip()
                continue
            if isinstance(rec, dict) and rec.get("level") in ("error", "critical"):
                return f"{rec.get('event')} {rec.get('errors') or rec.get('detail') or ''}".strip()
        return self.tail[-1].strip() if self.tail else "no output"

    async def _read_log(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        while True:
            try:
                raw = await self.proc.stderr.readline()
            except ValueError:  # a line over the reader's limit: skip it
                continue
            if not raw:
                return
            line = raw.decode("utf-8", "replace")
            self.tail.append(line)
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if not isinstance(rec, dict):
                continue
            if rec.get("event") == self.STARTED_EVENT:
                self.started.set()
            elif rec.get("event") == self.STOPPING_EVENT:
                self.stopping.set()
            elif rec.get("level") in ("warning", "error", "critical"):
                self.warnings += 1

    async def stop(self, timeout_s: float, *, grace_s: float = 0.0) -> int:
        """SIGTERM, wait for the exit; killed (and reported as -9) after `timeout_s`.

        A terminal's Ctrl-C reaches the whole process group, the listener included, and it
        stops by itself: then it must not get a second signal (once it has begun to stop, it no
        longer handles them). `grace_s` is how long to watch its log for `listener_stopping`
        before sending SIGTERM."""
        if self.proc is None:
            return 0
        if grace_s > 0 and not self.stopping.is_set() and self.proc.returncode is None:
            waiters = {asyncio.create_task(self.stopping.wait()),
                       asyncio.create_task(self.proc.wait())}
            _, pending = await asyncio.wait(waiters, timeout=grace_s,
                                            return_when=asyncio.FIRST_COMPLETED)
            for t in pending:
                t.cancel()
        if self.proc.returncode is None and not self.stopping.is_set():
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
        if self.proc.returncode is None:
            try:
                await asyncio.wait_for(self.proc.wait(), timeout_s)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                await self.proc.wait()
        if self._reader is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        code = self.proc.returncode
        assert code is not None
        return code


def listener_config(port: int, engines: Sequence[EngineServer],
                    tokenizer_dir: str) -> dict[str, Any]:
    """The listener's YAML for the demo: one vLLM source per engine, in the usual deployment:
    the listener binds each `zmq_endpoint` (publishers checked against `allowed_publishers`)
    and the engine connects to it, vLLM's `tcp://host:port` form. Prompts are decoded by the
    engines' `/detokenize` (authoritative); the chat template is learned from the same
    tokenizer directory the engines use, as an operator with the model's files would."""
    return {
        "listen": f"127.0.0.1:{port}",
        "log": {"level": "info", "format": "json"},
        "history_size": 10000,
        "update_interval": "100ms",
        "sources": [
            {"backend_name": s.engine.name, "engine": "vllm", "model": DEMO_MODEL,
             "zmq_endpoint": s.engine.endpoint, "zmq_mode": "bind",
             "replay_endpoint": s.engine.replay_endpoint,
             "detokenize_endpoint": s.url + "/detokenize",
             "tokenizer": tokenizer_dir, "allowed_publishers": ["127.0.0.1"]}
            for s in engines
        ],
    }


# --- the demo ----------------------------------------------------------------------------------


class Demo:
    def __init__(self, duration_s: float | None, engines: int, live: bool,
                 out: TextIO = sys.stdout) -> None:
        self.duration_s = duration_s
        self.n_engines = engines
        self.live = live
        self.out = out
        self.workload = ChatWorkload(seed=SEED)
        self.names = [f"vllm-{i + 1}" for i in range(engines)]
        self.engines: dict[str, SimEngine] = {}
        self.servers: dict[str, EngineServer] = {}  # each engine's OpenAI server (the same
        # simulated engine the cluster benchmark puts behind routers)
        self.http: aiohttp.ClientSession | None = None
        self.counters = {n: BackendCounters() for n in self.names}
        self.totals = Totals()
        self.listener: ListenerProcess | None = None
        self.listener_port = 0
        self.admin_port = 0
        self.router: Router | None = None
        self.stop = asyncio.Event()
        self.signal: signal.Signals | None = None  # the signal that ended the demo, if any
        self.stopping = False
        self._rr = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._rng = random.Random(SEED)  # noqa: S311 - arrival times, not secrets
        self._started_at = 0.0  # traffic started (monotonic), 0 until then
        self._served_times: deque[float] = deque()
        self._t0 = time.monotonic()  # the demo started: the start-up view counts from here
        self.stages = startup_stages(engines)
        self._stage = {s.name: s for s in self.stages}
        self.view_live = False  # the start-up view has given way to the live view
        #: The view when traffic ended, shown while the parts stop and after: their streams
        #: close and the request rate decays, which would blur the figures of the run.
        self.final: ViewState | None = None

    def _stage_done(self, name: str, detail: str) -> None:
        stage = self._stage[name]
        stage.done_s, stage.detail = time.monotonic() - self._t0, detail
        if not self.live:
            self.out.write(stage_line(stage) + "\n")
            self.out.flush()

    def _stage_failed(self) -> None:
        """The stage being waited for when the demo failed or was stopped."""
        stage = next((s for s in self.stages if s.done_s is None), None)
        if stage is not None:
            stage.done_s, stage.failed = time.monotonic() - self._t0, True

    # --- setup ---------------------------------------------------------------------------------

    async def setup(self, tmp: Path) -> None:
        tokenizer = await asyncio.to_thread(load_tokenizer, DEMO_TOKENIZER_DIR)
        info = tokenizer_info(DEMO_TOKENIZER_DIR)
        self.http = aiohttp.ClientSession()
        self.listener_port, *zmq_ports = free_ports(1 + len(self.names))
        for i, (name, zmq_port) in enumerate(zip(self.names, zmq_ports, strict=True)):
            # The engine connects to the address the listener will bind; ZMQ retries until it
            # does, and `wait_for_subscriber` below confirms the connection.
            engine = SimEngine(name, tokenizer, num_blocks=ENGINE_BLOCKS,
                               endpoint=f"tcp://127.0.0.1:{zmq_port}", mode="connect",
                               seed=SEED + i)
            self.engines[name] = engine
            self.servers[name] = await EngineServer(
                engine, model=DEMO_MODEL, timing=TIMING, tokenizer_info=info).start()
        self._stage_done("engines up", ", ".join(f"{n} :{s.port}" for n, s in self.servers.items()))
        config_path = tmp / "listener.yaml"
        config_path.write_text(yaml.safe_dump(listener_config(
            self.listener_port, list(self.servers.values()), str(DEMO_TOKENIZER_DIR))))
        self.listener = ListenerProcess(config_path)
        await self.listener.start(LISTENER_START_TIMEOUT_S)
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                for engine in self.engines.values():
                    await engine.publisher.wait_for_subscriber(timeout_s=CONNECT_TIMEOUT_S)
        except TimeoutError:
            raise DemoError("the listener did not subscribe to the engines' event sockets") from None
        self._stage_done("listener ready", f"pid {self.listener.pid}, port {self.listener_port}")
        sources = tuple(
            EventSourceConfig(name, Transport.SSE,
                              f"http://127.0.0.1:{self.listener_port}/events/{name}",
                              reconnect_interval_ms=200)
            for name in self.names)
        self.router = Router(RouterConfig(
            kv_cache_index=KvCacheIndexConfig(event_sources=sources),
            admin=AdminConfig("127.0.0.1", 0), log=LogConfig("error", "console")))
        await self.router.start()
        self.admin_port = self.router.admin_port
        # Traffic starts once every stream is connected, so the first records are not missed
        # (they would only arrive later, through the resync of a late connection).
        consumers = self.router.consumers
        assert consumers is not None
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        while not all(consumers.state(n).connected for n in self.names):
            if time.monotonic() > deadline:
                raise DemoError("the router could not connect to the listener's event streams")
            await asyncio.sleep(0.05)  # no event to await: the consumers expose state only
        self._stage_done("router consuming", f"{len(self.names)} streams, admin port {self.admin_port}")

    async def await_first_records(self) -> None:
        """Once traffic runs: until the router's index applied a first prefix record (or
        FIRST_RECORDS_PATIENCE_S passed: the live view then shows where they stay), then the
        live view takes over."""
        assert self.router is not None and self.router.consumers is not None
        consumers = self.router.consumers
        deadline = time.monotonic() + FIRST_RECORDS_PATIENCE_S
        while (applied := sum(consumers.state(n).applied for n in self.names)) == 0:
            if time.monotonic() > deadline:
                self._stage_done("first prefix records",
                                 f"none after {FIRST_RECORDS_PATIENCE_S:g} s of traffic")
                break
            await asyncio.sleep(0.05)  # no event to await: the consumers expose state only
        else:
            self._stage_done("first prefix records", f"{applied} applied; traffic "
                             + (f"for {self.duration_s:g} s" if self.duration_s else
                                "until Ctrl-C"))
        self.view_live = True

    async def teardown(self) -> int:
        """Stop everything; returns the listener's exit code."""
        code = 0
        if self.listener is not None:
            # Ctrl-C in a terminal signals the listener too (same process group).
            grace = SIGINT_GRACE_S if self.signal is signal.SIGINT else 0.0
            code = await self.listener.stop(LISTENER_STOP_TIMEOUT_S, grace_s=grace)
        if self.router is not None:
            await self.router.stop()
        for server in self.servers.values():
            await server.close()  # closes its engine too
        if self.http is not None:
            await self.http.close()
        return code

    # --- traffic -------------------------------------------------------------------------------

    def _fallback_backend(self) -> str:
        """The default strategy: least in flight, round-robin among equals."""
        assert self.router is not None and self.router.scorer is not None
        in_flight = self.router.scorer.in_flight
        n = len(self.names)
        order = [self.names[(self._rr + i) % n] for i in range(n)]
        best = min(order, key=in_flight.in_flight)
        self._rr = (self.names.index(best) + 1) % n
        return best

    async def _handle(self, req: ChatRequest) -> None:
        router = self.router
        assert router is not None and router.scorer is not None
        scorer = router.scorer
        sel = await scorer.select(req.prefix_hash, self.names)
        if sel.decision is Decision.KV_AWARE and sel.backend is not None:
            backend = sel.backend
            self.totals.kv_aware += 1
            self.counters[backend].kv_aware += 1
        else:
            backend = self._fallback_backend()
            self.totals.fallback += 1
            self.counters[backend].fallback += 1
        scorer.in_flight.start(backend)
        try:
            result = await self._generate(backend, req)
        finally:
            scorer.in_flight.finish(backend)
        scorer.health.record(backend, True)
        self._served(backend, result)

    async def _generate(self, backend: str, req: ChatRequest) -> ServeResult:
        """The request through the engine's OpenAI route, as a client of vLLM sends it; the
        engine's own usage says what its prefix cache served."""
        assert self.http is not None
        body = {**req.body, "max_tokens": max(1, req.output_tokens)}
        async with self.http.post(self.servers[backend].url + "/v1/chat/completions",
                                  json=body) as resp:
            if resp.status != 200:
                raise DemoError(f"{backend} answered {resp.status}: {(await resp.text())[:200]}")
            answer = await resp.json()
        used = answer["usage"]
        return ServeResult(req.index, int(used["prompt_tokens"]),
                           int(used["prompt_tokens_details"]["cached_tokens"]),
                           int(used["completion_tokens"]))

    def _served(self, backend: str, result: ServeResult) -> None:
        for c in (self.counters[backend], self.totals):
            c.requests += 1
            c.prompt_tokens += result.prompt_tokens
            c.hit_tokens += result.hit_tokens
        self._served_times.append(time.monotonic())

    async def traffic(self) -> None:
        """Poisson arrivals at REQUEST_RATE until stopped."""
        while not self.stop.is_set():
            req = self.workload.next()
            if len(self._tasks) >= MAX_OUTSTANDING:
                self.totals.skipped += 1
            else:
                task = asyncio.create_task(self._handle(req))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            await asyncio.sleep(self._rng.expovariate(REQUEST_RATE))

    async def finish_requests(self) -> None:
        if not self._tasks:
            return
        _, pending = await asyncio.wait(set(self._tasks), timeout=FINISH_TIMEOUT_S)
        for task in pending:
            task.cancel()
        results = await asyncio.gather(*pending, return_exceptions=True)
        for r in results:
            if isinstance(r, Exception):
                raise r

    # --- view ----------------------------------------------------------------------------------

    def view_state(self, *, done: bool = False) -> ViewState:
        assert self.router is not None and self.listener is not None
        consumers = self.router.consumers
        assert consumers is not None
        index = self.router.index
        holders: dict[str, list[tuple[str, int]]] = {}
        if isinstance(index, InMemoryKvIndex):
            for ph, backend, _tier, tokens, _age in index.entries():
                holders.setdefault(ph, []).append((backend, tokens))
        labels = {h: name for name, h in self.workload.prefix_hashes().items()}
        prefixes = tuple(
            PrefixRow(label, ph, tuple(sorted(holders.get(ph, ()), key=lambda x: (-x[1], x[0]))))
            for ph, label in labels.items())
        now = time.monotonic()
        while self._served_times and now - self._served_times[0] > 5.0:
            self._served_times.popleft()
        elapsed = now - self._started_at
        backends = []
        for name in self.names:
            engine = self.engines[name]
            pool = engine.core.pool.stats()
            st = consumers.state(name)
            backends.append(BackendRow(name, self.servers[name].num_running, self.counters[name],
                                       pool.cached,
                                       pool.num_blocks, st.applied, st.connected))
        return ViewState(
            elapsed_s=elapsed, duration_s=self.duration_s, backends=tuple(backends),
            prefixes=prefixes, other_prefixes=len(set(holders) - set(labels)),
            totals=self.totals,
            listener=f"pid {self.listener.pid}, port {self.listener_port}",
            admin_url=f"http://127.0.0.1:{self.admin_port}/admin/kv-index/stats",
            listener_warnings=self.listener.warnings, stopping=self.stopping, done=done,
            rate_rps=len(self._served_times) / min(5.0, max(elapsed, 1e-3)))

    def _draw(self, view: LiveView, *, done: bool = False) -> None:
        """One drawing: the start-up view, the live view, or (`done`) the last one."""
        size = shutil.get_terminal_size()
        if self.final is not None:
            lines = render_view(replace(self.final, stopping=not done, done=done), size.columns)
        elif self.view_live:
            lines = render_view(self.view_state(), size.columns)
        else:
            status = ("stopped" if done else "stopping..." if self.stopping or self.stop.is_set()
                      else "Ctrl-C to stop")
            lines = render_startup(self.stages, time.monotonic() - self._t0, status=status,
                                   width=size.columns)
        view.draw(lines, size.lines, last=done)

    async def redraw(self, view: LiveView) -> None:
        """The start-up view until the first prefix records are in, then the live view."""
        while True:
            self._draw(view)
            await asyncio.sleep(REDRAW_INTERVAL_S if self.view_live else STARTUP_REDRAW_INTERVAL_S)

    # --- main ----------------------------------------------------------------------------------

    def _on_signal(self, sig: signal.Signals) -> None:
        self.signal = sig
        self.stop.set()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            loop.add_signal_handler(sig, self._on_signal, sig)
        # Something on the screen at once: setting up takes seconds (the tokenizer, the
        # listener's own start), more on a busy machine.
        view = LiveView(self.out) if self.live else None
        drawer = asyncio.create_task(self.redraw(view), name="demo-view") if view else None
        if view is None:
            self.out.write(startup_line(self.n_engines) + "\n")
            self.out.flush()
        failure: str | None = None
        code = 0
        try:
            with tempfile.TemporaryDirectory(prefix="kv-listener-demo-") as tmp:
                try:
                    if await self._setup_or_stop(Path(tmp)):
                        failure = await self._run_traffic()
                except DemoError as exc:
                    failure = str(exc)
                except Exception as exc:  # a bug: one line for the operator, details in the log
                    log.error("demo_failed", exc_info=exc)
                    failure = f"{type(exc).__name__}: {exc}"
                finally:
                    if failure is not None:
                        self._stage_failed()
                    self.stopping = True
                    code = await self.teardown()
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                loop.remove_signal_handler(sig)
            if drawer is not None:
                drawer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await drawer
            if view is not None:
                self._draw(view, done=True)
                view.close()
        # A Ctrl-C that reached the listener while it was still starting (before its signal
        # handlers) ends it by SIGINT: the same interruption as ours, not a failure.
        interrupted = self.signal is signal.SIGINT and code == -signal.SIGINT
        if failure is None and code != 0 and not interrupted:
            failure = f"the listener exited with status {code} after SIGTERM"
        if failure is not None:
            sys.stderr.write(f"{PROG}: error: demo: {failure}\n")
        elif not self.live and self._started_at:
            self._print_end()
        # The one summary line (the live view does not repeat it), last on stdout (SPEC §9).
        self.out.write(summary_line(self.totals) + "\n")
        self.out.flush()
        return 0 if failure is None else 1

    async def _setup_or_stop(self, tmp: Path) -> bool:
        """Set up, unless a signal comes first (Ctrl-C while the listener starts): then False,
        and whatever was started is stopped by `teardown`."""
        return await run_unless_stopped(self.setup(tmp), self.stop)

    async def _run_traffic(self) -> str | None:
        self._started_at = time.monotonic()
        traffic = asyncio.create_task(self.traffic(), name="demo-traffic")
        first = asyncio.create_task(self.await_first_records(), name="demo-first-records")
        try:
            waiters = {asyncio.create_task(self.stop.wait()), traffic}
            _, pending = await asyncio.wait(waiters, timeout=self.duration_s,
                                            return_when=asyncio.FIRST_COMPLETED)
            for t in pending - {traffic}:
                t.cancel()
            if traffic.done() and (exc := traffic.exception()) is not None:
                raise exc
            self.stopping = True
            self.stop.set()
            traffic.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await traffic
            await self.finish_requests()
        finally:
            first.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await first
            self.final = self.view_state(done=True)
        return None

    def _print_end(self) -> None:
        state = self.final or self.view_state(done=True)
        for b in state.backends:
            c = b.counters
            self.out.write(f"{b.name}: requests={c.requests} kv_aware={c.kv_aware} "
                           f"fallback={c.fallback} hit_rate={c.hit_rate:.2f} "
                           f"cached_blocks={b.cached_blocks}/{b.total_blocks} "
                           f"index_records={b.records}\n")
        for p in state.prefixes:
            holders = " ".join(f"{b}:{n}" for b, n in p.holders) or "-"
            self.out.write(f"prefix {p.label} {p.prefix_hash[:12]} holders {holders}\n")


def run_demo(duration_s: float | None, engines: int = 2, headless: bool = False) -> int:
    """Run the demo; returns the exit code (0, or 1 when a part failed)."""
    # Nothing may be downloaded: the tokenizer ships in the package.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # transformers advises installing PyTorch on import: noise here, only tokenizers are used.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    # The view owns the terminal: only errors are logged (to stderr).
    configure_logging("error", "console")
    live = wants_live_view(headless, sys.stdout, os.environ)
    return asyncio.run(Demo(duration_s, engines, live).run())


def wants_live_view(headless: bool, out: TextIO, env: Mapping[str, str]) -> bool:
    """Redrawing in place needs a terminal that understands cursor movement: `--headless`, a
    pipe, a file or TERM=dumb get plain lines with no escape codes."""
    return not headless and out.isatty() and env.get("TERM", "") != "dumb"
