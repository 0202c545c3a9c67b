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

The live view (when stdout is a terminal and not `--headless`) is redrawn twice a second with
plain ANSI escapes. The demo ends after `--duration` seconds of traffic, or on Ctrl-C / SIGTERM /
SIGHUP: traffic stops, running requests finish, the listener gets SIGTERM (and must exit 0), the
router and engines stop, and the last stdout line is the summary
`routing: kv_aware=<n> fallback=<m> hit_rate=<x>`. Exit 0, or 1 when something failed.
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
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
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


def render_view(state: ViewState, width: int = 80) -> list[str]:
    """The live view as plain lines (no escapes), each cut to `width` columns; the tables fit
    in 80."""
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
        f"router admin: {state.admin_url}",
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
    lines += ["", f"{'system prompt':<14} {'prefix hash':<14} holders in the router's index "
                  "(tokens)"]
    for p in state.prefixes:
        holders = "  ".join(f"{b}: {n}" for b, n in p.holders) if p.holders else "-"
        lines.append(f"{p.label:<14} {p.prefix_hash[:12] + '..':<14} {holders}")
    if state.other_prefixes:
        lines.append(f"{'(other)':<14} {state.other_prefixes} more prefixes")
    t = state.totals
    lines += ["", f"{summary_line(t)}  ({t.requests} served, {state.rate_rps:.1f} req/s)"]
    if state.listener_warnings:
        lines.append(f"listener warnings: {state.listener_warnings}")
    return [line[:width] for line in lines]


class LiveView:
    """Redraws the view in place: cursor up over the last drawing, clear to the end, print."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self._lines = 0

    def draw(self, lines: Sequence[str]) -> None:
        buf = []
        if self._lines:
            buf.append(f"\x1b[{self._lines}F\x1b[J")
        else:
            buf.append("\x1b[?25l")  # hide the cursor while drawing
        buf.append("\n".join(lines) + "\n")
        self.out.write("".join(buf))
        self.out.flush()
        self._lines = len(lines)

    def close(self) -> None:
        self.out.write("\x1b[?25h")
        self.out.flush()


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
        self._started_at = 0.0
        self._served_times: deque[float] = deque()

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

    async def redraw(self, view: LiveView) -> None:
        while True:
            view.draw(render_view(self.view_state(), shutil.get_terminal_size().columns))
            await asyncio.sleep(REDRAW_INTERVAL_S)

    # --- main ----------------------------------------------------------------------------------

    def _on_signal(self, sig: signal.Signals) -> None:
        self.signal = sig
        self.stop.set()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            loop.add_signal_handler(sig, self._on_signal, sig)
        view = LiveView(self.out) if self.live else None
        failure: str | None = None
        code = 0
        try:
            with tempfile.TemporaryDirectory(prefix="kv-listener-demo-") as tmp:
                try:
                    if await self._setup_or_stop(Path(tmp)):
                        if not self.live:
                            self._print_start()
                        failure = await self._run_traffic(view)
                except DemoError as exc:
                    failure = str(exc)
                except Exception as exc:  # a bug: one line for the operator, details in the log
                    log.error("demo_failed", exc_info=exc)
                    failure = f"{type(exc).__name__}: {exc}"
                finally:
                    self.stopping = True
                    code = await self.teardown()
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                loop.remove_signal_handler(sig)
            if view is not None:
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
        self.out.write(summary_line(self.totals) + "\n")
        self.out.flush()
        return 0 if failure is None else 1

    async def _setup_or_stop(self, tmp: Path) -> bool:
        """Set up, unless a signal comes first (Ctrl-C while the listener starts): then False,
        and whatever was started is stopped by `teardown`."""
        return await run_unless_stopped(self.setup(tmp), self.stop)

    async def _run_traffic(self, view: LiveView | None) -> str | None:
        self._started_at = time.monotonic()
        traffic = asyncio.create_task(self.traffic(), name="demo-traffic")
        drawer = asyncio.create_task(self.redraw(view), name="demo-view") if view else None
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
            if drawer is not None:
                drawer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await drawer
                assert view is not None
                view.draw(render_view(self.view_state(done=True),
                                      shutil.get_terminal_size().columns))
        return None

    def _print_start(self) -> None:
        assert self.router is not None and self.listener is not None
        self.out.write(
            f"demo: {self.n_engines} simulated vLLM engines -> listener pid {self.listener.pid} "
            f"(http://127.0.0.1:{self.listener_port}/events/...) -> router "
            f"(http://127.0.0.1:{self.admin_port}/admin/kv-index/stats)\n")
        self.out.flush()

    def _print_end(self) -> None:
        state = self.view_state(done=True)
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
    live = not headless and sys.stdout.isatty()
    return asyncio.run(Demo(duration_s, engines, live).run())
