"""Soak run of the whole pipeline at a steady request rate: memory, file descriptors and state of
the listener and the router over time. Prints figures; exits 1 when a part failed or the router's
index did not converge on the listener's live prefixes.

    .venv/bin/python bench/soak.py [--duration 30m] [--rate 30] [--engines 2] [--prompts 5]
                                   [--interval 1m] [--router-entry-ttl S]

The demo's pipeline, built from its parts (imported from `kv_listener.demo` and `kv_listener.sim`),
with the router as a process of its own: the simulated vLLM engines (block pools, ZMQ publishers)
and the `/detokenize` server run in this process; the listener (`python -m kv_listener --config
...`, the real daemon) and the router (`python -m kv_listener router --config ...`: in-memory index,
consumers of the listener's `GET /events/{backend}` streams, admin JSON) are child processes, all
on 127.0.0.1. Requests of the demo's chat workload (its five system prompts; with `--prompts N`
variants of them too, more than the engines' block pools hold, so prefixes are created and evicted
all the time) arrive at `--rate` per second (Poisson, on an absolute schedule, so the rate does not
drift when this process is late); each is routed by asking the router process
(`GET /admin/kv-index/prefix/{hash}`: its best-scored holder, `kv_aware`) or, when no backend holds
the prefix, sent to the least busy engine (`fallback`); the engine serves it and its KV events
flow back through the listener into the router's index.

Every `--interval` (a minute) and at the end, per process: RSS (VmRSS of /proc/PID/status), open
file descriptors (entries of /proc/PID/fd), threads (/proc/PID/status), asyncio tasks
(`process.asyncio_tasks` of the listener's /stats and the router's /admin/kv-index/stats) and
warnings in its log;
the listener's /stats summed over backends (blocks_tracked, tokens_retained, prefixes_live,
history_records, events dropped, clears, gaps) and the router's index (entries, expired by TTL,
evicted at capacity, records dropped, reconnects). When the traffic has stopped and the running
requests have finished: the convergence check (per backend, the router's index entries vs the
listener's prefixes_live, polled until equal with no coalesced update pending, or for
CONVERGE_TIMEOUT_S), the end figures, and one drift line per process (first interval vs last
interval, with the ratio last/first).

Ctrl-C, SIGTERM or SIGHUP ends it early: the figures so far and the drift are printed; after a
Ctrl-C (which reaches the children too, same process group) there is no end sample and no
convergence check. The machine is shared: the figures are what this run saw.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import re
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from quiet import quiet_libraries

from kv_listener.demo import (
    CONNECT_TIMEOUT_S,
    ENGINE_BLOCKS,
    FINISH_TIMEOUT_S,
    LISTENER_START_TIMEOUT_S,
    LISTENER_STOP_TIMEOUT_S,
    MAX_OUTSTANDING,
    SEED,
    SIGINT_GRACE_S,
    DemoError,
    ListenerProcess,
    Totals,
    free_ports,
    listener_config,
    run_unless_stopped,
    summary_line,
)
from kv_listener.logging import configure_logging
from kv_listener.resolver.template import DEMO_TOKENIZER_DIR, load_tokenizer
from kv_listener.sim.detokenize_server import tokenizer_info
from kv_listener.sim.engine import SimEngine, Timing
from kv_listener.sim.server import EngineServer
from kv_listener.sim.workload import (
    DEMO_MODEL,
    SYSTEM_PROMPTS,
    ChatRequest,
    ChatWorkload,
    SystemPrompt,
)

#: After the traffic: how long the router's index may take to equal the listener's live prefixes.
CONVERGE_TIMEOUT_S = 20.0
CONVERGE_POLL_S = 0.2  # nothing to await across processes: the two HTTP views are compared
STATS_TIMEOUT_S = 5.0  # one /stats or admin read
LOOKUP_TIMEOUT_S = 2.0  # one routing lookup at the router
#: The arrival schedule catches up at most this far when this process falls behind.
MAX_CATCH_UP_S = 1.0
ROUTER_RECONNECT_MS = 200
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

_DURATION_RE = re.compile(r"(\d+(?:\.\d*)?)\s*(ms|s|m|h)?")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def duration_s(text: str) -> float:
    """`90s`, `30m`, `1h`, `250ms` or plain seconds."""
    m = _DURATION_RE.fullmatch(text.strip())
    if m is None:
        raise argparse.ArgumentTypeError(f"not a duration (e.g. 90s, 30m, 1h): {text!r}")
    value = float(m[1]) * _UNIT_S[m[2]]
    if not 0 < value <= 7 * 86400:
        raise argparse.ArgumentTypeError(f"must be more than 0 and at most 7 days: {text!r}")
    return value


def fmt_elapsed(s: float) -> str:
    return f"{round(s / 60)}m" if abs(s / 60 - round(s / 60)) < 1e-6 else f"{s:g}s"


def soak_prompts(n: int) -> tuple[SystemPrompt, ...]:
    """`n` system prompts: the demo's, then variants of them (a tenant line in front, so each has
    its own prefix key and its own blocks) whose popularity falls off like a long tail."""
    base = SYSTEM_PROMPTS
    out = list(base[:n])
    for i in range(len(base), n):
        p = base[i % len(base)]
        out.append(SystemPrompt(f"{p.name}-{i}", f"Tenant {i}. {p.text}",
                                p.weight / (1 + i // len(base))))
    return tuple(out)


# --- the router child process ------------------------------------------------------------------


class RouterProcess(ListenerProcess):
    """`python -m kv_listener router --config PATH` as a child: the demo's `ListenerProcess` (its
    `stop()` with the Ctrl-C grace, `last_error()`, warning count and log tail) with the router's
    command and log events."""

    ROLE = "router"
    COMMAND = ("router",)
    STARTED_EVENT = "router_started"
    STOPPING_EVENT = "router_stopping"


def router_config(admin_port: int, listener_port: int, names: list[str],
                  entry_ttl_s: int | None) -> dict[str, Any]:
    """The router's YAML: one SSE consumer per backend of the listener, the in-memory index
    (defaults, unless `--router-entry-ttl`), admin JSON on 127.0.0.1."""
    kv: dict[str, Any] = {"event_sources": [
        {"backend_name": n, "transport": "sse",
         "endpoint": f"http://127.0.0.1:{listener_port}/events/{n}",
         "reconnect_interval_ms": ROUTER_RECONNECT_MS}
        for n in names]}
    if entry_ttl_s is not None:
        kv["entry_ttl_seconds"] = entry_ttl_s
    return {"kv_cache_index": kv, "admin": {"listen": f"127.0.0.1:{admin_port}"},
            "log": {"level": "info", "format": "json"}}


# --- figures -----------------------------------------------------------------------------------


def proc_figures(pid: int) -> dict[str, float]:
    """RSS (MiB), open file descriptors and threads of a live process, from /proc."""
    rss_kib = threads = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss_kib = int(line.split()[1])
        elif line.startswith("Threads:"):
            threads = int(line.split()[1])
    return {"rss_mib": rss_kib / 1024, "fds": len(os.listdir(f"/proc/{pid}/fd")),
            "threads": threads}


@dataclass(frozen=True, slots=True)
class Sample:
    label: str  # "1m", "2m", ..., "end"
    traffic: str
    listener: dict[str, float]
    router: dict[str, float]


def fmt_figures(figures: dict[str, float]) -> str:
    parts = []
    for name, value in figures.items():
        if name == "rss_mib":
            parts.append(f"rss {value:.1f} MiB")
        else:
            parts.append(f"{name} {int(value):,}")
    return ", ".join(parts)


def drift_line(name: str, first: Sample, last: Sample) -> str:
    a, b = getattr(first, name), getattr(last, name)
    parts = []
    for key, v0 in a.items():
        v1 = b.get(key, 0)
        ratio = f"x{v1 / v0:.2f}" if v0 else ("=" if v1 == 0 else "from 0")
        if key == "rss_mib":
            parts.append(f"rss {v0:.1f} -> {v1:.1f} MiB ({ratio})")
        else:
            parts.append(f"{key} {int(v0):,} -> {int(v1):,} ({ratio})")
    return f"drift {name} {first.label} -> {last.label}: " + ", ".join(parts)


# --- the soak ----------------------------------------------------------------------------------


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.duration_s: float = args.duration
        self.rate: float = args.rate
        self.interval_s: float = args.interval
        self.entry_ttl_s: int | None = args.router_entry_ttl
        self.names = [f"vllm-{i + 1}" for i in range(args.engines)]
        self.workload = ChatWorkload(seed=SEED, k=args.prompts, prompts=soak_prompts(args.prompts))
        self.engines: dict[str, SimEngine] = {}
        self.in_flight = dict.fromkeys(self.names, 0)
        self.totals = Totals()
        self.arrived = 0
        self.lookup_errors = 0
        self.request_errors = 0
        self.first_error: str | None = None
        self.servers: dict[str, EngineServer] = {}
        self.listener: ListenerProcess | None = None
        self.router: RouterProcess | None = None
        self.listener_url = ""
        self.router_url = ""
        self.http: aiohttp.ClientSession | None = None
        self.stop = asyncio.Event()
        self.signal: signal.Signals | None = None
        self.samples: list[Sample] = []
        self._rr = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._t0 = 0.0

    # --- setup and teardown --------------------------------------------------------------------

    async def setup(self, tmp: Path) -> None:
        tokenizer = await asyncio.to_thread(load_tokenizer, DEMO_TOKENIZER_DIR)
        info = tokenizer_info(DEMO_TOKENIZER_DIR)
        listener_port, admin_port, *zmq_ports = free_ports(2 + len(self.names))
        timing = Timing()
        for i, (name, port) in enumerate(zip(self.names, zmq_ports, strict=True)):
            engine = SimEngine(name, tokenizer, num_blocks=ENGINE_BLOCKS, timing=timing,
                               endpoint=f"tcp://127.0.0.1:{port}", mode="connect", seed=SEED + i)
            self.engines[name] = engine
            # The demo's engine server: /detokenize, /tokenizer_info and /health beside the
            # engine (it starts and closes the engine); requests still go to the engine in process.
            self.servers[name] = await EngineServer(engine, model=DEMO_MODEL,
                                                    tokenizer_info=info).start()
        path = tmp / "listener.yaml"
        path.write_text(yaml.safe_dump(listener_config(
            listener_port, list(self.servers.values()), str(DEMO_TOKENIZER_DIR))))
        self.listener = ListenerProcess(path)
        await self.listener.start(LISTENER_START_TIMEOUT_S)
        self.listener_url = f"http://127.0.0.1:{listener_port}"
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                for engine in self.engines.values():
                    await engine.publisher.wait_for_subscriber(timeout_s=CONNECT_TIMEOUT_S)
        except TimeoutError:
            raise DemoError("the listener did not subscribe to the engines' event sockets") from None
        path = tmp / "router.yaml"
        path.write_text(yaml.safe_dump(router_config(admin_port, listener_port, self.names,
                                                     self.entry_ttl_s)))
        self.router = RouterProcess(path)
        await self.router.start(LISTENER_START_TIMEOUT_S)
        self.router_url = f"http://127.0.0.1:{admin_port}"
        self.http = aiohttp.ClientSession()
        # Traffic starts once every stream is connected, so the first records are not missed.
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        while True:
            stats = await self.get_json(f"{self.router_url}/admin/kv-index/stats")
            if all(s["connected"] for s in stats["event_sources"]):
                break
            if time.monotonic() > deadline:
                raise DemoError("the router could not connect to the listener's event streams")
            await asyncio.sleep(0.05)  # the router shows its connections only in its admin JSON

    async def teardown(self) -> list[str]:
        """Stop everything (the consumer side first); returns what did not stop cleanly."""
        problems = []
        grace = SIGINT_GRACE_S if self.signal is signal.SIGINT else 0.0
        for what, child in (("router", self.router), ("listener", self.listener)):
            if child is None or child.proc is None:
                continue
            code = await child.stop(LISTENER_STOP_TIMEOUT_S, grace_s=grace)
            # A Ctrl-C that reached a child before its signal handlers were set ends it by SIGINT.
            if code != 0 and not (self.signal is signal.SIGINT and code == -signal.SIGINT):
                problems.append(f"the {what} exited with status {code}: {child.last_error()}")
        if self.http is not None:
            await self.http.close()
        for server in self.servers.values():
            await server.close()
        return problems

    async def get_json(self, url: str) -> Any:
        assert self.http is not None
        try:
            async with self.http.get(url, timeout=aiohttp.ClientTimeout(total=STATS_TIMEOUT_S)) as r:
                r.raise_for_status()
                return await r.json()
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise DemoError(f"GET {url}: {type(exc).__name__}: {exc}") from None

    # --- traffic -------------------------------------------------------------------------------

    def _least_busy(self) -> str:
        n = len(self.names)
        order = [self.names[(self._rr + i) % n] for i in range(n)]
        best = min(order, key=self.in_flight.__getitem__)
        self._rr = (self.names.index(best) + 1) % n
        return best

    async def _route(self, req: ChatRequest) -> tuple[str, bool]:
        """(backend, kv_aware): the router process's best holder with a score, else the least
        busy engine."""
        assert self.http is not None
        url = f"{self.router_url}/admin/kv-index/prefix/{req.prefix_hash}"
        try:
            async with self.http.get(url, timeout=aiohttp.ClientTimeout(total=LOOKUP_TIMEOUT_S)) as r:
                if r.status == 200:
                    for holder in (await r.json())["holders"]:  # best score first
                        if holder["score"] > 0 and holder["backend"] in self.engines:
                            return holder["backend"], True
                elif r.status != 404:  # 404: no backend holds it
                    self.lookup_errors += 1
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError):
            self.lookup_errors += 1
        return self._least_busy(), False

    async def _handle(self, req: ChatRequest) -> None:
        t = self.totals
        try:
            backend, kv_aware = await self._route(req)
            if kv_aware:
                t.kv_aware += 1
            else:
                t.fallback += 1
            self.in_flight[backend] += 1
            try:
                result = await self.engines[backend].generate(req.messages, req.output_tokens)
            finally:
                self.in_flight[backend] -= 1
        except Exception as exc:  # counted and shown once; the soak goes on
            self.request_errors += 1
            self.first_error = self.first_error or f"{type(exc).__name__}: {exc}"
            return
        t.requests += 1
        t.prompt_tokens += result.prompt_tokens
        t.hit_tokens += result.hit_tokens

    async def traffic(self, until: float) -> None:
        """Poisson arrivals at `rate` on an absolute schedule, until `until` (monotonic)."""
        rng = random.Random(SEED)
        next_at = time.monotonic()
        while not self.stop.is_set() and next_at < until:
            delay = next_at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            req = self.workload.next()
            self.arrived += 1
            if len(self._tasks) >= MAX_OUTSTANDING:
                self.totals.skipped += 1
            else:
                task = asyncio.create_task(self._handle(req))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            next_at = max(next_at + rng.expovariate(self.rate), time.monotonic() - MAX_CATCH_UP_S)

    async def finish_requests(self) -> None:
        if not self._tasks:
            return
        _, pending = await asyncio.wait(set(self._tasks), timeout=FINISH_TIMEOUT_S)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    # --- sampling ------------------------------------------------------------------------------

    async def sample(self, label: str) -> Sample:
        assert self.listener is not None and self.router is not None
        lst = await self.get_json(f"{self.listener_url}/stats")
        rtr = await self.get_json(f"{self.router_url}/admin/kv-index/stats")
        listener = proc_figures(self.listener.pid)
        listener["tasks"] = lst["process"]["asyncio_tasks"]
        sources = lst["sources"].values()
        for key in ("blocks_tracked", "tokens_retained", "prefixes_live", "history_records"):
            listener[key] = sum(s[key] for s in sources)
        listener["events_dropped"] = sum(sum(s["events_dropped"].values()) for s in sources)
        listener["clears"] = sum(s["clears"] for s in sources)
        listener["gaps"] = sum(s["gaps"] for s in sources)
        listener["warnings"] = self.listener.warnings
        router = proc_figures(self.router.pid)
        router["tasks"] = rtr["process"]["asyncio_tasks"]
        index = rtr["index"]
        router["index_entries"] = index["entry_count"]
        router["expired"] = index["total_expired"]
        router["evicted"] = index["total_evictions"]
        router["records_dropped"] = sum(s["events_dropped"] for s in rtr["event_sources"])
        router["reconnects"] = sum(s["reconnect_count"] for s in rtr["event_sources"])
        router["warnings"] = self.router.warnings
        t = self.totals
        elapsed = max(time.monotonic() - self._t0, 1e-3)
        traffic = (f"{self.arrived:,} arrived ({self.arrived / elapsed:.1f}/s), {t.requests:,} "
                   f"served, kv_aware {t.kv_aware:,}, fallback {t.fallback:,}, skipped "
                   f"{t.skipped:,}, lookup errors {self.lookup_errors}, request errors "
                   f"{self.request_errors}, hit_rate {t.hit_rate:.2f}")
        s = Sample(label, traffic, listener, router)
        self.samples.append(s)
        print(f"[{label}] traffic: {traffic}")
        print(f"[{label}] listener pid {self.listener.pid}: {fmt_figures(listener)}")
        print(f"[{label}] router   pid {self.router.pid}: {fmt_figures(router)}", flush=True)
        return s

    async def live_vs_index(self) -> tuple[dict[str, tuple[int, int]], int]:
        """backend -> (listener prefixes_live, router index entries), and the listener's
        coalesced updates not sent yet."""
        lst = await self.get_json(f"{self.listener_url}/stats")
        rtr = await self.get_json(f"{self.router_url}/admin/kv-index/stats")
        index = rtr["index"]["backends"]
        pairs = {n: (int(lst["sources"][n]["prefixes_live"]),
                     int(index.get(n, {}).get("entries", 0))) for n in self.names}
        pending = sum(int(s.get("pending_updates", 0)) for s in lst["sources"].values())
        return pairs, pending

    async def converge(self) -> bool:
        t0 = time.monotonic()
        deadline = t0 + CONVERGE_TIMEOUT_S
        while True:
            pairs, pending = await self.live_vs_index()
            equal = not pending and all(a == b for a, b in pairs.values())
            if equal or time.monotonic() >= deadline:
                break
            await asyncio.sleep(CONVERGE_POLL_S)
        took = time.monotonic() - t0
        detail = ", ".join(f"{n} listener {a:,} router {b:,} {'equal' if a == b else 'DIFFERENT'}"
                           for n, (a, b) in pairs.items())
        verdict = (f"converged after {took:.1f} s" if equal else
                   f"NOT converged after {took:.1f} s ({pending} updates pending)")
        print(f"convergence (router index vs listener prefixes_live): {detail}: {verdict}")
        return equal

    # --- main ----------------------------------------------------------------------------------

    def _on_signal(self, sig: signal.Signals) -> None:
        self.signal = sig
        self.stop.set()

    async def _until_stopped(self, coro: Any) -> bool:
        """Run `coro` unless a signal comes first: then it is cancelled and False."""
        return await run_unless_stopped(coro, self.stop)

    async def soak(self) -> str | None:
        """The traffic with a sample every interval; a failure, or None."""
        assert self.listener is not None and self.router is not None
        assert self.listener.proc is not None and self.router.proc is not None
        self._t0 = t0 = time.monotonic()
        until = t0 + self.duration_s
        traffic = asyncio.create_task(self.traffic(until), name="soak-traffic")
        exited = {asyncio.create_task(self.listener.proc.wait(), name="listener"),
                  asyncio.create_task(self.router.proc.wait(), name="router")}
        stopped = asyncio.create_task(self.stop.wait())
        failure = None
        k = 1
        try:
            while True:  # one pass per interval, bounded by `until`
                due = t0 + k * self.interval_s
                mark = min(due, until)
                done, _ = await asyncio.wait({stopped, *exited},
                                             timeout=max(0.0, mark - time.monotonic()),
                                             return_when=asyncio.FIRST_COMPLETED)
                if done & exited:
                    task = next(iter(done & exited))
                    failure = f"the {task.get_name()} exited with status {task.result()} mid-run"
                    break
                if done:  # a signal
                    break
                if due <= until:
                    await self.sample(fmt_elapsed(k * self.interval_s))
                    k += 1
                if mark >= until:
                    break
        finally:
            for t in (stopped, *exited):
                t.cancel()
            self.stop.set()  # ends the traffic loop
            await traffic
            await self.finish_requests()
        return failure

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in SIGNALS:
            loop.add_signal_handler(sig, self._on_signal, sig)
        failures: list[str] = []
        converged = False
        try:
            with tempfile.TemporaryDirectory(prefix="kv-listener-soak-") as tmp:
                try:
                    if await self._until_stopped(self.setup(Path(tmp))):
                        self._print_start()
                        failure = await self.soak()
                        if failure is not None:
                            failures.append(failure)
                        elif self.signal is not signal.SIGINT:
                            converged = await self.converge()
                            await self.sample("end")
                        self._print_drift()
                except DemoError as exc:
                    if self.signal is not signal.SIGINT:  # else: the children are stopping
                        failures.append(str(exc))
                except Exception as exc:  # a bug: one line, the traceback on stderr
                    traceback.print_exc()
                    failures.append(f"{type(exc).__name__}: {exc}")
                finally:
                    failures += await self.teardown()
        finally:
            for sig in SIGNALS:
                loop.remove_signal_handler(sig)
        if self.request_errors:
            failures.append(f"{self.request_errors} requests failed, the first: {self.first_error}")
        if self.signal is not None:
            print(f"soak: stopped early by {self.signal.name}")
        elif not failures and not converged:
            failures.append("the router's index did not converge on the listener's live prefixes")
        for f in failures:
            sys.stderr.write(f"soak: error: {f}\n")
        print(summary_line(self.totals), flush=True)
        return 1 if failures else 0

    def _print_start(self) -> None:
        assert self.listener is not None and self.router is not None
        print(f"soak: {len(self.names)} simulated vLLM engines ({ENGINE_BLOCKS} blocks each) at "
              f"{self.rate:g} requests/s for {fmt_elapsed(self.duration_s)} -> listener pid "
              f"{self.listener.pid} ({self.listener_url}/stats) -> router pid {self.router.pid} "
              f"({self.router_url}/admin/kv-index/stats); figures every "
              f"{fmt_elapsed(self.interval_s)}; {os.cpu_count()} CPUs, load average "
              f"{os.getloadavg()[0]:.2f}")

    def _print_drift(self) -> None:
        periodic = [s for s in self.samples if s.label != "end"]
        if len(self.samples) < 2:
            print("drift: fewer than two samples")
            return
        first = periodic[0]
        last = periodic[-1] if len(periodic) > 1 else self.samples[-1]
        for name in ("listener", "router"):
            print(drift_line(name, first, last))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=duration_s, default=duration_s("30m"),
                    help="traffic time: 90s, 30m, 1h (default 30m)")
    ap.add_argument("--rate", type=float, default=30.0, help="requests/s over all engines (30)")
    ap.add_argument("--engines", type=int, default=2, choices=range(1, 9), metavar="N",
                    help="simulated engines, 1..8 (2)")
    ap.add_argument("--prompts", type=int, default=len(SYSTEM_PROMPTS), metavar="N",
                    help=f"system prompts (prefixes) in the workload; more than the engines' "
                         f"blocks hold makes them churn (default {len(SYSTEM_PROMPTS)}, the demo's)")
    ap.add_argument("--interval", type=duration_s, default=60.0, help="figures every (1m)")
    ap.add_argument("--router-entry-ttl", type=int, default=None, metavar="S",
                    help="the router's kv_cache_index.entry_ttl_seconds (default: its own, 600)")
    args = ap.parse_args()
    if not args.rate > 0:
        ap.error("--rate must be positive")
    if not 1 <= args.prompts <= 100_000:
        ap.error("--prompts must be between 1 and 100000")
    # Nothing may be downloaded: the tokenizer ships in the package.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    configure_logging("error", "console")  # the engines' and servers' logs: errors only
    with contextlib.suppress(KeyboardInterrupt):  # a Ctrl-C before the handlers are in place
        return asyncio.run(Soak(args).run())
    return 130


if __name__ == "__main__":
    quiet_libraries()
    sys.exit(main())
