"""Cluster routing benchmark: does KV-aware routing pay, against the routers users would pick?

N simulated engines (default 4; `kv_listener.sim.server`: the project's vLLM-like block pool
with prefix caching and LRU eviction behind an OpenAI-compatible server, continuous batching,
prefill time proportional to uncached prompt tokens, KV events on a bound ZMQ PUB in vLLM 0.33
map encoding) serve identical seeded request streams (`cluster_workloads.py`) through each
strategy, with the engines' caches emptied between runs:

- `round_robin`;
- `chwbl`: consistent hashing with bounded loads on the prefix key (the seed's Tier 1:
  epsilon 0.25, 150 virtual nodes, clockwise overflow; `kv_listener.router.chwbl`);
- `kv_listener`: this project. The real listener daemon (a child process) consumes every
  engine's ZMQ events and resolves prefixes through the engines' `/detokenize`; the router module
  (in this process) consumes its SSE streams into its in-memory KV index and scores backends
  with the seed's pool threshold; CHWBL when the scorer does not choose. The routing runs in the
  bench process: its decision time is reported as `added ms`;
- `kv_listener_bounded`: the same with one change this benchmark proposes (not the seed's
  pipeline): a holder already at CHWBL's load bound does not take the request, the ring places
  it, so a hot prefix warms a second engine instead of queueing on its only holder;
- `oracle`: asks every engine how many tokens of the request's exact prompt it holds and how
  busy it is, and picks the lowest expected TTFT (cache and queue known exactly: an upper bound
  no router reaches);
- peers, installed by `peer_routers.py` into their own virtual environments on first use:
  smg 1.13.0 (`cache_aware`, `prefix_hash`, `round_robin`) and vllm-router 0.1.17 (`kv_aware`
  on the engines' ZMQ events with token-ID requests, `cache_aware`, `consistent_hash` with
  `X-Session-ID` set to the prefix key). A peer that cannot be installed or started is reported
  with the reason and skipped.

Workloads: `chat`, `multiturn`, `docqa`, `hotspot` (see `cluster_workloads.py`), each at
concurrency 1 and 16 (closed loop: that many clients, each sending its next request when the
last one ended), with each engine's KV pool at `--pool` x the working set (the distinct blocks
of the workload's prompts); then a sweep of the pool from 25% to 200% for `chat` at concurrency
16 with the bench's own strategies.

Figures per run: hit rate (cached / prompt tokens), prefill tokens computed, TTFT p50 / p90 /
p99 as the client sees it (request sent -> first streamed chunk), load imbalance (max / mean
requests per engine), decisions, and the router's added latency per request (bench-side
decision time; for a proxy, its TTFT minus the engine's own, over the same for round robin,
which goes to the engine directly). Output: a table on stdout, a
JSON file (`--json`), PNG plots (`--plots DIR`, needs matplotlib: `pip install -e '.[bench]'`).

Run: .venv/bin/python bench/cluster.py [--engines 4] [--requests 240] [--json FILE]
                                  [--plots DIR] [--workloads chat,...] [--strategies ...]
                                  [--no-peers] [--no-sweep] [--pool 0.5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cluster_report import (
    HEADER,
    RunResult,
    Served,
    read_json,
    row,
    settle_added,
    write_json,
    write_plots,
)
from cluster_workloads import MODEL, WORKLOADS, Req, Target, send
from quiet import quiet_libraries

from kv_listener.router.chwbl import HashRing
from tests.conftest import free_port

CONCURRENCIES = (1, 16)
SWEEP = (0.25, 0.5, 1.0, 2.0)
BENCH_STRATEGIES = ("round_robin", "chwbl", "kv_listener", "kv_listener_bounded", "oracle")


# --- strategies ----------------------------------------------------------------------------------


@dataclass(slots=True)
class Choice:
    target: Target
    engine: str  # "" when a proxy decides (the engine is read from the response)
    decision: str
    decide_s: float


class Strategy:
    """One routing strategy for one run. `choose` is called per request; `finished` when its
    response ended (in-flight accounting of the bench-side strategies)."""

    name = ""

    async def start(self) -> None:
        """Set up (a peer started, a listener connected). Raise to skip the run with a reason."""

    async def stop(self) -> None:
        """Tear down whatever `start` made."""

    async def choose(self, req: Req) -> Choice:
        raise NotImplementedError

    def finished(self, choice: Choice, served_by: str) -> None:
        """The request ended (served by `served_by`)."""


class BenchSide(Strategy):
    """Strategies that pick an engine in this process, with their own in-flight counts."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.in_flight = dict.fromkeys(fleet.names, 0)

    def _go(self, engine: str, decision: str, started: float) -> Choice:
        self.in_flight[engine] += 1
        return Choice(Target(self.fleet.url(engine)), engine, decision,
                      time.perf_counter() - started)

    def finished(self, choice: Choice, served_by: str) -> None:
        self.in_flight[choice.engine] -= 1


class RoundRobin(BenchSide):
    name = "round_robin"

    def __init__(self, fleet: Fleet) -> None:
        super().__init__(fleet)
        self._next = 0

    async def choose(self, req: Req) -> Choice:
        t0 = time.perf_counter()
        engine = self.fleet.names[self._next % len(self.fleet.names)]
        self._next += 1
        return self._go(engine, "round_robin", t0)


class Chwbl(BenchSide):
    name = "chwbl"

    def __init__(self, fleet: Fleet) -> None:
        super().__init__(fleet)
        self.ring = HashRing(fleet.names)

    async def choose(self, req: Req) -> Choice:
        t0 = time.perf_counter()
        c = self.ring.select(req.prefix_key, self.in_flight, MODEL)
        return self._go(c.backend, c.decision.value, t0)


class Oracle(BenchSide):
    """Knows each engine's cached tokens of the exact prompt and its queue: lowest expected
    TTFT (`Fleet.expected_ttft_s`)."""

    name = "oracle"

    async def choose(self, req: Req) -> Choice:
        t0 = time.perf_counter()
        tokens = self.fleet.tokens(req)
        best = min(self.fleet.names,
                   key=lambda e: (self.fleet.expected_ttft_s(e, tokens, self.in_flight[e]), e))
        return self._go(best, "oracle", t0)


class KvListener(BenchSide):
    """This project: the listener daemon on every engine's events, the router module on its
    streams (in-memory KV index, the seed's scorer and pool threshold), CHWBL as the fallback."""

    name = "kv_listener"

    def __init__(self, fleet: Fleet, workdir: Path) -> None:
        super().__init__(fleet)
        self.workdir = workdir
        self.ring = HashRing(fleet.names)
        self.daemon: Any = None
        self.router: Any = None

    async def start(self) -> None:
        from kv_listener.config import LogConfig  # noqa: PLC0415 - only this strategy
        from kv_listener.router.app import Router  # noqa: PLC0415
        from kv_listener.router.config import (  # noqa: PLC0415
            AdminConfig,
            EventSourceConfig,
            KvCacheIndexConfig,
            RouterConfig,
            Transport,
        )
        from tests.support.daemon import Daemon  # noqa: PLC0415

        port = free_port()
        config = {
            "listen": f"127.0.0.1:{port}", "log": {"level": "info", "format": "json"},
            "update_interval": "50ms",
            "sources": [{"backend_name": n, "engine": "vllm", "model": MODEL,
                         "zmq_endpoint": self.fleet.zmq(n), "zmq_mode": "connect",
                         "replay_endpoint": self.fleet.replay(n),
                         "detokenize_endpoint": self.fleet.url(n) + "/detokenize",
                         "allowed_publishers": ["127.0.0.1"]} for n in self.fleet.names]}
        self.daemon = Daemon(config, self.workdir)
        await self.daemon.start()
        await self.fleet.wait_subscribed()
        sources = tuple(EventSourceConfig(n, Transport.SSE,
                                          f"http://127.0.0.1:{port}/events/{n}",
                                          reconnect_interval_ms=100)
                        for n in self.fleet.names)
        self.router = Router(RouterConfig(
            kv_cache_index=KvCacheIndexConfig(event_sources=sources),
            admin=AdminConfig("127.0.0.1", 0), log=LogConfig("error", "console")))
        await self.router.start()
        consumers = self.router.consumers
        async with asyncio.timeout(20):
            # the consumers expose state only: there is nothing to await
            while not all(consumers.state(n).connected for n in self.fleet.names):  # noqa: ASYNC110
                await asyncio.sleep(0.05)

    async def stop(self) -> None:
        if self.router is not None:
            await self.router.stop()
        if self.daemon is not None:
            await self.daemon.stop()

    #: The seed's pipeline as is (False), or a proposal (True): a holder already at CHWBL's load
    #: bound does not take the request; the ring places it, so a hot prefix warms a second
    #: engine instead of queueing on its only holder (the seed scores holders only, and a
    #: holder's score never drops under the pool threshold however loaded it is).
    bounded = False

    async def choose(self, req: Req) -> Choice:
        t0 = time.perf_counter()
        scorer = self.router.scorer
        if req.prefix_hash is not None:
            sel = await scorer.select(req.prefix_hash, self.fleet.names)
            if sel.backend is not None and not (
                    self.bounded and self.in_flight[sel.backend] + 1 > self.ring.bound(self.in_flight)):
                scorer.in_flight.start(sel.backend)
                return self._go(sel.backend, "kv_aware", t0)
        c = self.ring.select(req.prefix_key, self.in_flight, MODEL)
        scorer.in_flight.start(c.backend)
        return self._go(c.backend, f"fallback_{c.decision.value}", t0)

    def finished(self, choice: Choice, served_by: str) -> None:
        super().finished(choice, served_by)
        self.router.scorer.in_flight.finish(choice.engine)
        self.router.scorer.health.record(choice.engine, True)


class KvListenerBounded(KvListener):
    """`kv_listener` with the load bound proposal (see `KvListener.bounded`); not the seed's."""

    name = "kv_listener_bounded"
    bounded = True


class Peer(Strategy):
    """A peer router process in front of the fleet (`peer_routers.py`)."""

    def __init__(self, fleet: Fleet, peer: str, policy: str, install: Any, log_dir: Path) -> None:
        self.fleet = fleet
        self.peer, self.policy, self.install, self.log_dir = peer, policy, install, log_dir
        self.name = f"{peer}:{policy}"
        self._cm: Any = None
        self.router: Any = None

    async def start(self) -> None:
        import peer_routers as pr  # noqa: PLC0415

        workers = [pr.WorkerSpec(self.fleet.url(n), self.fleet.zmq(n), self.fleet.replay(n))
                   for n in self.fleet.names]
        self._cm = pr.run_router(self.install, self.policy, workers, model=MODEL,
                                 log_dir=self.log_dir)
        self.router = await self._cm.__aenter__()

    async def stop(self) -> None:
        if self._cm is not None:
            await self._cm.__aexit__(None, None, None)

    async def choose(self, req: Req) -> Choice:
        form = self.router.form
        return Choice(Target(self.router.base_url, form.form, form.headers(req.prefix_hash)), "",
                      self.policy, 0.0)


# --- the engines ---------------------------------------------------------------------------------


class Fleet:
    """N simulated engines (`kv_listener.sim.server.EngineServer`), in this process, fresh per
    run (empty caches, new ports)."""

    def __init__(self, n: int, num_blocks: int, tokenizer: Any, max_num_seqs: int,
                 time_scale: float = 0.3) -> None:
        self.n, self.num_blocks, self.tokenizer = n, num_blocks, tokenizer
        self.time_scale = time_scale
        self.max_num_seqs = max_num_seqs
        self.names = [f"vllm-{i + 1}" for i in range(n)]
        self.servers: dict[str, Any] = {}
        self._tokens: dict[int, list[int]] = {}

    async def __aenter__(self) -> Fleet:
        from kv_listener.resolver.template import DEMO_TOKENIZER_DIR  # noqa: PLC0415
        from kv_listener.sim.detokenize_server import tokenizer_info  # noqa: PLC0415
        from kv_listener.sim.engine import SimEngine  # noqa: PLC0415
        from kv_listener.sim.server import EngineServer, ServiceTiming  # noqa: PLC0415

        info = tokenizer_info(DEMO_TOKENIZER_DIR)
        try:
            for i, name in enumerate(self.names):
                engine = SimEngine(name, self.tokenizer, num_blocks=self.num_blocks,
                                   max_num_seqs=self.max_num_seqs, seed=i)
                self.servers[name] = await EngineServer(
                    engine, model=MODEL, tokenizer_info=info,
                    timing=ServiceTiming(time_scale=self.time_scale)).start()
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        for server in self.servers.values():
            await server.close()

    def url(self, name: str) -> str:
        return str(self.servers[name].url)

    def zmq(self, name: str) -> str:
        port = self.servers[name].engine.endpoint.rsplit(":", 1)[1]
        return f"tcp://127.0.0.1:{port}"

    def replay(self, name: str) -> str:
        port = self.servers[name].engine.replay_endpoint.rsplit(":", 1)[1]
        return f"tcp://127.0.0.1:{port}"

    async def wait_subscribed(self) -> None:
        for server in self.servers.values():
            await server.engine.publisher.wait_for_subscriber(timeout_s=20)

    def tokens(self, req: Req) -> list[int]:
        if req.index not in self._tokens:
            from kv_listener.sim.engine import render_chat  # noqa: PLC0415
            self._tokens[req.index] = list(render_chat(self.tokenizer, req.messages))
        return self._tokens[req.index]

    def cached_tokens(self, name: str, tokens: Sequence[int]) -> int:
        from kv_listener.sim.engine import chain_digests  # noqa: PLC0415
        core = self.servers[name].engine.core
        bs = core.block_size
        return len(core.pool.lookup(chain_digests(tokens, bs)[: (len(tokens) - 1) // bs])) * bs

    def expected_ttft_s(self, name: str, tokens: Sequence[int], in_flight: int) -> float:
        """Prefill of what this engine lacks, plus the wait for a sequence slot if it is full
        (one average request's service per request ahead)."""
        timing = self.servers[name].timing
        prefill = timing.prefill_s(len(tokens) - self.cached_tokens(name, tokens))
        ahead = max(0, in_flight + 1 - self.max_num_seqs)
        return prefill + ahead * (timing.prefill_s(256) + 32 * timing.decode_step_s())

    def working_set_blocks(self, reqs: Sequence[Req]) -> int:
        from kv_listener.sim.engine import chain_digests  # noqa: PLC0415
        seen: set[bytes] = set()
        for r in reqs:
            seen.update(chain_digests(self.tokens(r), 16))
        return len(seen)


# --- a run ---------------------------------------------------------------------------------------


async def run_once(strategy: Strategy, fleet: Fleet, reqs: Sequence[Req], concurrency: int,
                   http: aiohttp.ClientSession) -> tuple[list[Served], int, float]:
    """Closed loop: `concurrency` clients take the next request in order as theirs ends."""
    served: list[Served] = []
    failed = 0
    queue = iter(reqs)
    lock = asyncio.Lock()

    async def client() -> None:
        nonlocal failed
        while True:
            async with lock:
                req = next(queue, None)
            if req is None:
                return
            choice = await strategy.choose(req)
            engine = choice.engine
            try:
                got = await send(http, choice.target, req, fleet.tokens)
                engine = got[0] or engine
                served.append(Served(engine, got[1], got[2], got[3], got[4], choice.decide_s,
                                     choice.decision))
            except (aiohttp.ClientError, RuntimeError, TimeoutError) as exc:
                failed += 1
                if failed <= 3:
                    print(f"  {strategy.name}: request {req.index} failed: {exc}",
                          file=sys.stderr)
            finally:
                strategy.finished(choice, engine)

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return served, failed, time.perf_counter() - t0


async def run_strategy(name: str, make: Callable[[Fleet], Strategy], workload: str,
                       reqs: Sequence[Req], concurrency: int, fraction: float, blocks: int,
                       args: argparse.Namespace, tokenizer: Any,
                       http: aiohttp.ClientSession) -> RunResult:
    result = RunResult(workload, name, concurrency, fraction)
    async with Fleet(args.engines, blocks, tokenizer, args.max_num_seqs,
                     args.time_scale) as fleet:
        strategy = make(fleet)
        try:
            await strategy.start()
        except Exception as exc:  # a peer that cannot start: reported, the bench goes on
            result.note = f"not run: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            await strategy.stop()
            return result
        try:
            served, failed, wall = await run_once(strategy, fleet, reqs, concurrency, http)
        finally:
            await strategy.stop()
        result.fill(served, fleet.names, failed, wall)
    return result


def strategy_makers(args: argparse.Namespace, workdir: Path, installs: dict[str, Any]
                    ) -> dict[str, Callable[[Fleet], Strategy]]:
    makers: dict[str, Callable[[Fleet], Strategy]] = {
        "round_robin": RoundRobin, "chwbl": Chwbl, "oracle": Oracle,
        "kv_listener": lambda f: KvListener(f, workdir),
        "kv_listener_bounded": lambda f: KvListenerBounded(f, workdir),
    }
    for peer, install in installs.items():
        import peer_routers as pr  # noqa: PLC0415 - only with peers

        for policy in pr.PEERS[peer].policies:
            makers[f"{peer}:{policy}"] = (
                lambda f, p=peer, pol=policy, i=install: Peer(f, p, pol, i, workdir))
    wanted = args.strategies.split(",") if args.strategies else list(makers)
    return {k: v for k, v in makers.items() if k in wanted}


def install_peers(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    if args.no_peers:
        return {}, []
    import peer_routers as pr  # noqa: PLC0415
    installs, notes = {}, []
    for peer in pr.PEERS:
        got = pr.ensure_installed(peer)
        if isinstance(got, str):
            notes.append(f"{peer}: not installed: {got}")
        else:
            installs[peer] = got
            notes.append(f"{peer} {got.version}: {'reused' if got.reused else 'installed'} "
                         f"({got.install_s:.0f} s) in {got.venv}")
    return installs, notes


async def main(args: argparse.Namespace) -> int:
    import logging  # noqa: PLC0415

    import structlog  # noqa: PLC0415

    from kv_listener.resolver.template import DEMO_TOKENIZER_DIR, load_tokenizer  # noqa: PLC0415

    # The engines and the router module run in this process: their info logs would bury the table.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))

    tokenizer = load_tokenizer(DEMO_TOKENIZER_DIR)
    installs, notes = install_peers(args)
    for n in notes:
        print(n, flush=True)
    results: list[RunResult] = []
    workloads = args.workloads.split(",")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvl-cluster-") as tmp:
        makers = strategy_makers(args, Path(tmp), installs)
        print(HEADER, flush=True)
        async with aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, limit_per_host=0)) as http:
            plan: list[tuple[str, int, float, list[str]]] = []
            for w in workloads:
                for c in CONCURRENCIES:
                    plan.append((w, c, args.pool, list(makers)))
            if not args.no_sweep and "chat" in workloads:
                bench_side = [s for s in makers if s in BENCH_STRATEGIES]
                for f in SWEEP:
                    if f != args.pool:
                        plan.append(("chat", 16, f, bench_side))
            sizing = Fleet(1, 16, tokenizer, 1)
            for w, c, fraction, strategies in plan:
                n = args.requests if c > 1 else max(20, args.requests // 6)
                reqs = WORKLOADS[w](args.seed, n)
                ws = sizing.working_set_blocks(reqs)
                longest = max(len(sizing.tokens(r)) + r.output_tokens for r in reqs) // 16 + 2
                blocks = max(longest, int(ws * fraction))
                for s in strategies:
                    r = await run_strategy(s, makers[s], w, reqs, c, fraction, blocks, args,
                                           tokenizer, http)
                    results.append(r)
                    settle_added(results)
                    print(row(r), flush=True)
    meta = {"engines": args.engines, "requests": args.requests, "seed": args.seed,
            "pool": args.pool, "max_num_seqs": args.max_num_seqs, "peers": notes,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python "
                       f"{platform.python_version()}",
            "wall_s": round(time.monotonic() - started, 1)}
    print(f"total {meta['wall_s']} s on {meta['machine']}")
    if args.json:
        write_json(Path(args.json), meta, results)
        print(f"wrote {args.json}")
    if args.plots:
        try:
            for p in write_plots(Path(args.plots), results, args.pool):
                print(f"wrote {p}")
        except ImportError:
            print("no plots: matplotlib is not installed (pip install -e '.[bench]')")
    return 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--requests", type=int, default=240,
                   help="requests per run at concurrency 16 (a sixth, at least 20, at concurrency 1)")
    p.add_argument("--max-num-seqs", type=int, default=8, help="per engine")
    p.add_argument("--pool", type=float, default=0.5,
                   help="each engine's KV pool as a fraction of the workload's working set")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--time-scale", type=float, default=0.3,
                   help="real seconds per simulated second (ServiceTiming.time_scale)")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--strategies", default="", help="comma-separated names (default: all)")
    p.add_argument("--no-peers", action="store_true")
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--json", default="")
    p.add_argument("--plots", default="", help="directory for the PNG plots")
    p.add_argument("--plot-from", default="", help="only draw the plots of a JSON file (--plots)")
    return p.parse_args(argv)


def replot(args: argparse.Namespace) -> int:
    meta, results = read_json(Path(args.plot_from))
    for p in write_plots(Path(args.plots or "."), results, float(meta["pool"])):
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    quiet_libraries()
    parsed = parse_args()
    sys.exit(replot(parsed) if parsed.plot_from else asyncio.run(main(parsed)))
