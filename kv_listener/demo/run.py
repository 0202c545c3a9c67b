"""The demo's scenario: set up the engines, the listener and the router, run the chat traffic,
keep the view up to date, and stop everything in order.

Owns the main loop (`Demo.run`, `run_demo`): signals (Ctrl-C, SIGTERM, SIGHUP end the traffic),
the start-up stages, the routing of each request (the router's scorer, or the least-loaded
fallback), the counters the view shows, the summary line and the exit code. The view is
`view.py`'s, the child processes `process.py`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections import deque
from collections.abc import Coroutine
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

import aiohttp

from kv_listener.config import LogConfig
from kv_listener.demo import settings
from kv_listener.demo.process import (
    DemoError,
    ListenerProcess,
    free_ports,
    wait_for_subscriptions,
    write_listener_config,
)
from kv_listener.demo.view import (
    BackendCounters,
    BackendRow,
    LiveView,
    PrefixRow,
    Totals,
    ViewState,
    render_startup,
    render_view,
    stage_line,
    startup_line,
    startup_stages,
    summary_line,
    wants_live_view,
)
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
from kv_listener.sim.server import EngineServer
from kv_listener.sim.service import DEMO_TIMING
from kv_listener.sim.workload import DEMO_MODEL, ChatRequest, ChatWorkload

log = get_logger("kv_listener.demo")


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


class Demo:
    """One run of the demo: its parts, its traffic and its counters; `run()` is the whole of
    it and returns the exit code."""

    def __init__(self, duration_s: float | None, engines: int, live: bool,
                 out: TextIO = sys.stdout) -> None:
        self.duration_s = duration_s
        self.n_engines = engines
        self.live = live
        self.out = out
        self.workload = ChatWorkload(seed=settings.SEED)
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
        self._rng = random.Random(settings.SEED)  # noqa: S311 - arrival times, not secrets
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
            engine = SimEngine(name, tokenizer, num_blocks=settings.ENGINE_BLOCKS,
                               endpoint=f"tcp://127.0.0.1:{zmq_port}", mode="connect",
                               seed=settings.SEED + i)
            self.engines[name] = engine
            self.servers[name] = await EngineServer(
                engine, model=DEMO_MODEL, timing=DEMO_TIMING, tokenizer_info=info).start()
        self._stage_done("engines up", ", ".join(f"{n} :{s.port}" for n, s in self.servers.items()))
        self.listener = ListenerProcess(write_listener_config(
            tmp, self.listener_port, list(self.servers.values()), str(DEMO_TOKENIZER_DIR)))
        await self.listener.start(settings.LISTENER_START_TIMEOUT_S)
        await wait_for_subscriptions(self.engines.values(), settings.CONNECT_TIMEOUT_S)
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
        deadline = time.monotonic() + settings.CONNECT_TIMEOUT_S
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
        deadline = time.monotonic() + settings.FIRST_RECORDS_PATIENCE_S
        while (applied := sum(consumers.state(n).applied for n in self.names)) == 0:
            if time.monotonic() > deadline:
                self._stage_done("first prefix records",
                                 f"none after {settings.FIRST_RECORDS_PATIENCE_S:g} s of traffic")
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
            grace = settings.SIGINT_GRACE_S if self.signal is signal.SIGINT else 0.0
            code = await self.listener.stop(settings.LISTENER_STOP_TIMEOUT_S, grace_s=grace)
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
            if len(self._tasks) >= settings.MAX_OUTSTANDING:
                self.totals.skipped += 1
            else:
                task = asyncio.create_task(self._handle(req))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            await asyncio.sleep(self._rng.expovariate(settings.REQUEST_RATE))

    async def finish_requests(self) -> None:
        if not self._tasks:
            return
        _, pending = await asyncio.wait(set(self._tasks), timeout=settings.FINISH_TIMEOUT_S)
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
            await asyncio.sleep(settings.REDRAW_INTERVAL_S if self.view_live
                                else settings.STARTUP_REDRAW_INTERVAL_S)

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
            sys.stderr.write(f"{settings.PROG}: error: demo: {failure}\n")
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
