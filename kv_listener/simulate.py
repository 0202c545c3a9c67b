"""`continuum-kv-listener simulate --config FILE [--duration S]`: simulated engines behind a
listener file's loopback endpoints, so a standalone listener (and a router reading it) runs
without a GPU.

Owns the simulated engines' lifecycle, their traffic and the progress line; which endpoint
each engine binds, connects to, serves or skips is `sim.plan.plan_engines` (pure). The file is
parsed by the listener's own `load_config`, so what the listener accepts is what is simulated.
Per source:

- vllm / sglang: a simulated engine (`sim.engine.SimEngine`, a block pool with vLLM's prefix
  caching and LRU eviction) publishes its KV events in the engine's current release layout
  (vLLM 0.33, SGLang 0.5.23), topic `zmq_topic`, to `zmq_endpoint` in the opposite mode of the
  source: a source that binds gets an engine that connects (a wildcard bind `tcp://*:P` is
  reached at 127.0.0.1:P), a source that connects gets an engine that binds. Its replay ROUTER
  binds `replay_endpoint`. Its HTTP server (`sim.server.EngineServer`: `/detokenize`,
  `/tokenize`, `/tokenizer_info`, `/health` and the OpenAI routes) listens at the
  `detokenize_endpoint`'s address; a `health_endpoint` elsewhere gets a server of its own.
- trtllm: the same engine behind a drain-on-read `/kv_cache_events` (`sim.trtllm_server`) at
  `trtllm_endpoint`.
- Loopback only: an endpoint on any other address (or one the simulator cannot serve: https,
  inproc, a path it does not have) is skipped with a one-line note. Nothing binds outside
  127.0.0.0/8 and ::1.

Traffic, per engine: Poisson arrivals of a multi-turn chat (`sim.workload.ChatSessions`: a few
shared system prompts, users coming back with follow-ups), run in process through the engine's
own scheduler. With `cache_salt` configured and its secret readable, every request carries the
salt a router would issue (`issue_cache_salt`, which the listener verifies); otherwise none. An
engine's traffic starts once the listener is attached (its SUB subscribed, or its first poll),
so the listener sees every chain from its first block. The engines use the tiny tokenizer
shipped for the demo.

Output: what is served and what is skipped, then a progress line (redrawn in place on a TTY, a
plain line every 5 s otherwise) and a last line. Exit 0 after `--duration` or on SIGINT /
SIGTERM; 2 for an invalid file (one line per error) or a file with nothing to simulate; 1 when
an address is busy or anything else fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import signal
import sys
import time
from typing import Any, TextIO

import zmq
from aiohttp import web

from kv_listener.cli import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, PROG
from kv_listener.config import ConfigError, ListenerConfig, load_config, read_secret
from kv_listener.core.model import CacheCreated, Engine, KvEvent
from kv_listener.core.salt import issue_cache_salt
from kv_listener.logging import configure_logging
from kv_listener.resolver.template import DEMO_TOKENIZER_DIR, load_tokenizer
from kv_listener.sim.detokenize_server import tokenizer_info
from kv_listener.sim.engine import SimEngine
from kv_listener.sim.openai_wire import RequestError
from kv_listener.sim.plan import EnginePlan, HttpAddr, plan_engines
from kv_listener.sim.server import EngineServer
from kv_listener.sim.service import DEMO_TIMING  # the demo's pace: requests take real time
from kv_listener.sim.trtllm_server import ServedTrtllm, SimTrtllmServer
from kv_listener.sim.workload import ChatSessions, ChatTurn

#: KV blocks per engine (16 tokens each): the five system prompts take about 140, and the open
#: conversations fill the rest within a minute; from then on the pool evicts in LRU order (the
#: least used prompts' blocks too), as a busy engine does.
ENGINE_BLOCKS = 512
#: Requests per second per engine (Poisson arrivals), and how many may be pending at once
#: (beyond that an arrival is skipped, never queued without bound).
REQUEST_RATE = 5.0
MAX_OUTSTANDING = 32
SEED = 11
#: Requests running at the end get this long to finish; the rest are aborted.
FINISH_TIMEOUT_S = 5.0
REDRAW_INTERVAL_S = 0.5
PLAIN_PROGRESS_INTERVAL_S = 5.0
#: "Until cancelled" for waits that take a timeout.
_FOREVER_S = 365 * 86400.0


class SimulateError(Exception):
    """The simulation cannot run (a busy address, ...): one line for the operator."""


def salt_secret(cfg: ListenerConfig) -> tuple[bytes | None, str]:
    """The cache-salt secret, or None; and a line that says which."""
    salt = cfg.cache_salt
    if not salt.enabled:
        return None, "requests unsalted (no cache_salt secret in the file)"
    try:
        secret = read_secret(salt.secret_file, salt.secret_env)
    except ConfigError as exc:
        return None, f"requests unsalted: the cache_salt secret is unreadable ({exc.errors[0]})"
    return secret, "requests salted with the file's cache_salt secret (issue_cache_salt)"


# --- the running engines ---------------------------------------------------------------------


def _discard(_events: list[KvEvent]) -> None:
    """The sink of an engine whose event endpoint is skipped."""


def _listen_error(name: str, addr: HttpAddr | None, exc: OSError) -> SimulateError:
    where = addr.url if addr is not None else "its HTTP address"
    why = os.strerror(exc.errno) if exc.errno else str(exc)
    return SimulateError(f"{name}: cannot listen on {where}: {why}")


async def serve_health(addr: HttpAddr) -> web.AppRunner:
    """A health probe alone: `GET path` answers 200 (an engine whose health endpoint is not
    beside its /detokenize)."""
    async def healthy(_: web.Request) -> web.StreamResponse:
        return web.Response(status=200)

    app = web.Application()
    app.router.add_get(addr.path, healthy)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    try:
        await web.TCPSite(runner, addr.host, addr.port).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner


class SimulatedBackend:
    """One source's simulated engine, its servers and its traffic."""

    def __init__(self, plan: EnginePlan, tokenizer: Any, info: dict[str, Any],
                 secret: bytes | None, max_prefix_length: int) -> None:
        src = plan.source
        self.plan = plan
        self.name = plan.name
        self.secret = secret
        self.trtllm = SimTrtllmServer() if plan.trtllm is not None else None
        sink = self.trtllm.publish if self.trtllm is not None else (
            None if plan.zmq_endpoint is not None else _discard)
        seed = SEED + plan.index
        engine = SimEngine(src.backend_name, tokenizer, num_blocks=ENGINE_BLOCKS,
                           endpoint=plan.zmq_endpoint or "", mode=plan.zmq_mode,
                           replay_endpoint=plan.replay_endpoint, topic=src.zmq_topic,
                           wire="sglang" if src.engine is Engine.SGLANG else "vllm", sink=sink,
                           seed=seed)
        http = plan.http
        self.server = EngineServer(engine, model=src.model, timing=DEMO_TIMING, tokenizer_info=info,
                                   host=http.host if http else "127.0.0.1",
                                   port=http.port if http else 0, serve_http=http is not None,
                                   health_path=plan.health_path)
        self.sessions = ChatSessions(seed=seed, model=src.model,
                                     max_prefix_length=max_prefix_length)
        self.rng = random.Random(seed)  # noqa: S311 - arrival times, not secrets
        self.attached = False
        self.requests = 0  # answered
        self.refused = 0  # refused by the engine (a conversation grown past the context)
        self.skipped = 0  # arrivals dropped: MAX_OUTSTANDING pending
        self._salts: dict[str, str] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._trt_running: ServedTrtllm | None = None
        self._health: web.AppRunner | None = None

    async def start(self) -> None:
        plan = self.plan
        try:
            await self.server.start()  # ZMQ (binds or connects), then HTTP
        except zmq.ZMQError as exc:
            where = " and ".join(e for e in (plan.zmq_endpoint, plan.replay_endpoint) if e)
            raise SimulateError(f"{self.name}: cannot bind {where}: {exc.strerror}") from None
        except OSError as exc:
            raise _listen_error(self.name, plan.http, exc) from None
        if plan.trtllm is not None and self.trtllm is not None:
            # trtllm-serve's first event: the KV cache was created (GPU level, no host level).
            self.trtllm.emit(CacheCreated((ENGINE_BLOCKS, 0)))
            t = plan.trtllm
            try:
                self._trt_running = await self.trtllm.serve(t.host, t.port, t.path)
            except OSError as exc:
                raise _listen_error(self.name, t, exc) from None
        if plan.health is not None:
            try:
                self._health = await serve_health(plan.health)
            except OSError as exc:
                raise _listen_error(self.name, plan.health, exc) from None

    async def close(self) -> None:
        await self.server.close()
        if self._trt_running is not None:
            await self._trt_running.close()
        if self._health is not None:
            await self._health.cleanup()

    # --- traffic --------------------------------------------------------------------------

    async def _until_attached(self) -> None:
        if self.trtllm is not None:
            await self.trtllm.wait_polls(1, timeout_s=_FOREVER_S)
        else:
            await self.server.engine.publisher.wait_for_subscriber(timeout_s=_FOREVER_S)

    async def traffic(self) -> None:
        """Poisson arrivals once the listener is attached, until cancelled."""
        if not self.plan.fed:
            return
        await self._until_attached()
        self.attached = True
        while True:
            if len(self._tasks) >= MAX_OUTSTANDING:
                self.skipped += 1
            else:
                task = asyncio.create_task(self._request(self.sessions.next()))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            await asyncio.sleep(self.rng.expovariate(REQUEST_RATE))

    def _salt(self, prefix_hash: str) -> str | None:
        if self.secret is None:
            return None
        salt = self._salts.get(prefix_hash)
        if salt is None:
            salt = issue_cache_salt(self.secret, self.name, bytes.fromhex(prefix_hash))
            self._salts[prefix_hash] = salt
        return salt

    async def _request(self, turn: ChatTurn) -> None:
        req = turn.request
        try:
            _, text = await self.server.chat(req.messages, max_tokens=max(1, req.output_tokens),
                                             cache_salt=self._salt(req.prefix_hash))
        except RequestError:
            self.sessions.failed(turn)
            self.refused += 1
            return
        self.sessions.answered(turn, text)
        self.requests += 1

    async def finish(self, timeout_s: float) -> None:
        """Let running requests end (then abort the rest); what they raised is raised."""
        if not self._tasks:
            return
        _, pending = await asyncio.wait(set(self._tasks), timeout=timeout_s)
        for task in pending:
            task.cancel()
        for result in await asyncio.gather(*pending, return_exceptions=True):
            if isinstance(result, Exception):
                raise result

    def progress(self) -> str:
        if not self.plan.fed:
            return f"{self.name}: http only"
        if not self.attached:
            return f"{self.name}: waiting for the listener"
        pool = self.server.engine.core.pool.stats()
        return (f"{self.name}: req {self.requests} stored {pool.stored} "
                f"evicted {pool.evicted}")


# --- the simulation --------------------------------------------------------------------------


def progress_counts(backends: list[SimulatedBackend]) -> str:
    total = sum(b.requests for b in backends)
    return f"requests {total}  | " + " | ".join(b.progress() for b in backends)


def progress_line(elapsed_s: float, duration_s: float | None,
                  backends: list[SimulatedBackend]) -> str:
    head = f"simulate {elapsed_s:5.1f}s" + (f"/{duration_s:g}s" if duration_s else "")
    return f"{head}  {progress_counts(backends)}"


class Simulation:
    def __init__(self, backends: list[SimulatedBackend], duration_s: float | None,
                 out: TextIO) -> None:
        self.backends = backends
        self.duration_s = duration_s
        self.out = out
        self.tty = out.isatty()
        self.stop = asyncio.Event()
        self._started_at = 0.0

    def _elapsed(self) -> float:
        return time.monotonic() - self._started_at

    async def _progress(self) -> None:
        interval = REDRAW_INTERVAL_S if self.tty else PLAIN_PROGRESS_INTERVAL_S
        while True:
            await asyncio.sleep(interval)
            line = progress_line(self._elapsed(), self.duration_s, self.backends)
            if self.tty:
                width = shutil.get_terminal_size().columns
                self.out.write("\r" + line[:max(20, width - 1)] + "\x1b[K")
            else:
                self.out.write(line + "\n")
            self.out.flush()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.stop.set)
        started: list[SimulatedBackend] = []
        failure: str | None = None
        try:
            for b in self.backends:
                started.append(b)
                await b.start()
            failure = await self._run_traffic()
        except SimulateError as exc:
            failure = str(exc)
        except Exception as exc:  # a bug: one line, not a traceback
            failure = f"{type(exc).__name__}: {exc}"
        finally:
            for b in reversed(started):
                await b.close()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
        if failure is not None:
            sys.stderr.write(f"{PROG}: error: simulate: {failure}\n")
            return EXIT_FAILURE
        return EXIT_OK

    async def _run_traffic(self) -> str | None:
        self._started_at = time.monotonic()
        self.out.write("simulate: running" + (f" for {self.duration_s:g} s" if self.duration_s
                                              else "") + "; Ctrl-C to stop\n")
        self.out.flush()
        traffic = [asyncio.create_task(b.traffic(), name=f"simulate:{b.name}")
                   for b in self.backends]
        progress = asyncio.create_task(self._progress(), name="simulate:progress")
        failure = None
        try:
            waiters = {asyncio.create_task(self.stop.wait()), *traffic}
            while True:
                done, _ = await asyncio.wait(waiters, timeout=self._time_left(),
                                             return_when=asyncio.FIRST_COMPLETED)
                crashed = [t for t in done if t in traffic and t.exception() is not None]
                if crashed or not done or self.stop.is_set():
                    break
                waiters -= done  # an engine with nothing to feed returned at once
            for t in crashed:
                exc = t.exception()
                failure = f"{t.get_name()}: {type(exc).__name__}: {exc}"
        finally:
            for t in (*traffic, progress):
                t.cancel()
            await asyncio.gather(*traffic, progress, return_exceptions=True)
            for task in waiters:
                task.cancel()
        for b in self.backends:
            await b.finish(FINISH_TIMEOUT_S)
        if self.tty:
            self.out.write("\n")
        self.out.write(f"simulate: stopped after {self._elapsed():.1f} s  "
                       f"{progress_counts(self.backends)}\n")
        self.out.flush()
        return failure

    def _time_left(self) -> float | None:
        if self.duration_s is None:
            return None
        return max(0.0, self.duration_s - self._elapsed())


def _interrupted(_sig: int, _frame: object) -> None:
    raise KeyboardInterrupt


def _say(out: TextIO, line: str) -> None:
    out.write(f"simulate: {line}\n")
    out.flush()


def run_simulate(config_path: str, duration: float | None) -> int:
    """Run the simulation of the listener file `config_path`; returns the exit code."""
    out = sys.stdout
    if duration is not None and not 0 < duration < float("inf"):
        sys.stderr.write(f"{PROG}: error: simulate: --duration must be a positive number of "
                         "seconds\n")
        return EXIT_USAGE
    try:
        cfg = load_config(config_path)
    except ConfigError as exc:
        for err in exc.errors:
            where = "" if err.startswith(config_path) else f"{config_path}: "
            sys.stderr.write(f"{PROG}: error: {where}{err}\n")
        return EXIT_USAGE
    plans = plan_engines(cfg)
    for plan in plans:
        for note in plan.notes:
            _say(out, f"note: {note}")
    active = [p for p in plans if p.serves]
    if not active:
        sys.stderr.write(f"{PROG}: error: simulate: {config_path}: nothing to simulate (no "
                         "source has an endpoint on a loopback address)\n")
        return EXIT_USAGE
    secret, salted = salt_secret(cfg)
    for plan in active:
        _say(out, plan.describe())
    _say(out, salted)
    # Nothing may be downloaded: the tokenizer ships in the package.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    # SIGTERM while the tokenizer loads stops as cleanly as Ctrl-C does (exit 0); the event loop
    # takes both signals over once it runs.
    signal.signal(signal.SIGTERM, _interrupted)
    # The progress line owns stdout: only the engines' warnings are logged (to stderr).
    configure_logging("warning", "console")
    tokenizer = load_tokenizer(DEMO_TOKENIZER_DIR)
    info = tokenizer_info(DEMO_TOKENIZER_DIR)

    async def main() -> int:
        backends = [SimulatedBackend(p, tokenizer, info, secret, cfg.max_prefix_length)
                    for p in active]
        return await Simulation(backends, duration, out).run()

    with contextlib.suppress(KeyboardInterrupt):
        return asyncio.run(main())
    return EXIT_OK
