"""The reliability suite's pipeline: simulated engines -> the real listener process -> two real
router processes (in-memory index, Redis index on a real `redis-server`), and the convergence
check that ends every fault.

Truth is the engine's own: each `TruthEngine` is the project's simulated vLLM (block pool, LRU
free queue, ZMQ PUB with vLLM's replay ROUTER) whose every published batch is also folded into
an `EngineTruth` oracle *before* any fault touches the wire, and the oracle is checked against
the pool itself (the blocks it holds are exactly the pool's cached blocks). Its `/detokenize`,
`/tokenize` and `/tokenizer_info` are served by a `FaultyHttp` server that a test can take down
or make slow, failing, wrong or gigantic; its `/health` is a separate server, so a dead
`/detokenize` is not a dead engine.

`Stack.converge()` waits until neither engines nor streams have said anything for a moment, then
requires (bounded, with a deadline): pool == oracle, the listener's stream (an SSE view of each
backend) == oracle, and each router's index (read through its admin API: entries per backend,
and every prefix's holder) == oracle. Differences name prefix hashes only, never tokens.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from kv_listener.core.bus_protocol import token_hash
from kv_listener.core.decode import decode_zmq_payload
from kv_listener.core.model import BlockRemoved, BlockStored, Engine, EventBatch
from kv_listener.resolver.template import DEMO_TOKENIZER_DIR, build_prompt_parser, load_tokenizer
from kv_listener.sim.detokenize_server import DetokenizeServer, tokenizer_info
from kv_listener.sim.encode import encode_vllm_batch
from kv_listener.sim.engine import WIRE_VERSION, EngineCore, SimEngine, render_chat
from kv_listener.sim.trtllm_server import PATH as TRTLLM_PATH
from kv_listener.sim.trtllm_server import ServedTrtllm, SimTrtllmServer
from tests.engines.oracle import EngineTruth
from tests.engines.view import StreamView, diff
from tests.support.daemon import Daemon
from tests.support.ports import free_port

MODEL = "demo"
TOKENIZER = load_tokenizer(DEMO_TOKENIZER_DIR)
PARSER = build_prompt_parser(tokenizer=TOKENIZER, name="oracle")
BLOCK_SIZE = 16
POOL_BLOCKS = 96  # small: a few dozen requests evict each other's tails
ENGINE_DOWN_AFTER_S = 3.0
QUIET_S = 0.6  # longer than the listener's update_interval (50 ms here) and a detokenize trip

_TEXT = ("the quick brown fox jumps over a lazy dog while the router sends each request to "
         "the backend that already holds its system prompt in cache so time to first token "
         "stays low and the fleet serves more users with the same GPUs")
_WORDS = _TEXT.split(" ")


def messages(system: int, user: int, *, words: int = 40) -> list[dict[str, str]]:
    """A deterministic chat request: system prompt number `system` (its length varies with the
    number, so chains differ in length), a user turn number `user`."""
    n = words + (system * 7) % 50
    body = " ".join(_WORDS[(system * 3 + i * (system % 5 + 1)) % len(_WORDS)] for i in range(n))
    return [{"role": "system", "content": f"You are assistant {system}. {body}"},
            {"role": "user", "content": f"Question {user}: what does item {user * 13 % 97} mean?"}]


# --- the engine's HTTP side --------------------------------------------------------------------


class FaultyHttp(DetokenizeServer):
    """The sim engine's `/detokenize`, `/tokenize` and `/tokenizer_info` on a fixed port, with
    faults: `mode` None (answers), "500", "wrong_shape", "giant" (an answer far over the
    listener's response cap), "deep" (JSON nested 100,000 levels), "slow" (answers after
    `delay_s`); `down()` closes the port (connection refused), `up()` opens it again."""

    def __init__(self) -> None:
        super().__init__(TOKENIZER, info=tokenizer_info(DEMO_TOKENIZER_DIR), port=free_port())
        self.mode: str | None = None
        self.delay_s = 2.0
        self.faulted = asyncio.Event()  # set at the first request met by a fault

    async def _detokenize(self, request: web.Request) -> web.StreamResponse:
        if self.mode is None:
            return await super()._detokenize(request)
        self.faulted.set()
        if self.mode == "slow":
            await asyncio.sleep(self.delay_s)
            return await super()._detokenize(request)
        if self.mode == "500":
            return web.json_response({"object": "error", "code": 500}, status=500)
        if self.mode == "wrong_shape":
            return web.json_response({"tokens": [1, 2, 3]})
        if self.mode == "deep":
            return web.Response(text="[" * 100_000, content_type="application/json")
        assert self.mode == "giant", self.mode
        return web.json_response({"prompt": "x" * (8 << 20)})

    async def down(self) -> None:
        await self.close()

    async def up(self) -> None:
        await self.start()


class Health:
    """An engine's `/health` on its own port: 200 while `alive`, else closed."""

    def __init__(self) -> None:
        self.port = free_port()
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/health"

    async def up(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self._ok)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        self._runner = runner

    async def _ok(self, _: web.Request) -> web.Response:
        return web.Response(status=200)

    async def down(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


class Truthful:
    """What both simulated engines share: traffic, and their oracle kept to the pool's truth.
    A subclass has `core` (the pool), `truth` (the oracle), `exact`, `name` and `serve()`."""

    name: str
    core: EngineCore
    truth: EngineTruth
    exact: bool
    http: FaultyHttp
    health: Health
    last_publish: float

    serve: Callable[..., Any]  # (messages, output_tokens): each engine's own

    def _init_truth(self, engine: Engine) -> None:
        """An empty oracle, the engine's HTTP edge (faults injectable) and /health, not started."""
        self.truth = EngineTruth(engine=engine, model=MODEL, tokenizer=TOKENIZER, parser=PARSER)
        self.http = FaultyHttp()
        self.health = Health()
        self.last_publish = 0.0
        self.exact = True  # False after forget(): the oracle then lacks what the pool still holds

    async def _open_edges(self) -> None:
        await self.http.start()
        await self.health.up()

    async def _close_edges(self) -> None:
        await self.health.down()
        await self.http.close()

    def chat(self, system: int, user: int, output_tokens: int = 8) -> None:
        self.serve(messages(system, user), output_tokens)

    def traffic(self, n: int, *, systems: int = 10, seed: int = 0, first: int = 0) -> None:
        """`n` requests over system prompts `first`..`first + systems - 1`, each served and
        published at once (a system prompt never seen before needs the listener's resolver)."""
        for i in range(n):
            self.chat(first + (seed * 7 + i * 3) % systems, seed * 1000 + i, 4 + i % 9)

    def forget(self) -> None:
        """What the listener lost for good (a gap nothing covers): the truth it can reach is
        what the engine stores from now on."""
        self.truth.clear()
        self.exact = False

    def check_truth(self) -> None:
        """The oracle holds exactly the blocks the pool caches (so `truth` *is* the engine)."""
        held, cached = self.truth.held, len(self.core.pool.cached_hashes())
        if self.exact and held != cached:
            raise AssertionError(f"{self.name}: oracle holds {held} blocks, pool {cached}")


class TruthEngine(Truthful, SimEngine):
    """A simulated vLLM whose every published batch also feeds its oracle (`truth`), before any
    fault can hide it from the listener."""

    def __init__(self, name: str) -> None:
        super().__init__(name, TOKENIZER, num_blocks=POOL_BLOCKS, block_size=BLOCK_SIZE,
                         endpoint=f"tcp://127.0.0.1:{free_port()}",
                         replay_endpoint=f"tcp://127.0.0.1:{free_port()}")
        self._init_truth(Engine.VLLM)

    async def start(self) -> TruthEngine:
        await super().start()
        await self._open_edges()
        return self

    async def close(self) -> None:
        await self._close_edges()
        await super().close()

    def publish_step(self) -> int | None:
        events = self.core.take_events()
        if not events:
            return None
        self.batches += 1
        payload = encode_vllm_batch(events, ts=time.time(), version=WIRE_VERSION)
        seq = self.publisher.publish(payload)
        self.truth.feed_batch(decode_zmq_payload(Engine.VLLM, payload, seq).batch)
        self.last_publish = time.monotonic()
        return seq

    def restart(self) -> None:
        """The engine process restarted: an empty cache, the sequence from 0, no buffer."""
        self.core = EngineCore(POOL_BLOCKS, BLOCK_SIZE)
        self.publisher.restart()
        self.truth.clear()
        self.exact = True

    async def die(self) -> None:
        """The engine process died: no events, no /health, its cache gone with it."""
        await self.publisher.close()
        await self.health.down()
        self.core = EngineCore(POOL_BLOCKS, BLOCK_SIZE)
        self.truth.clear()
        self.exact = True

    async def revive(self) -> None:
        """A new engine process on the same ports (sequence from 0, empty buffer)."""
        self.publisher.restart()
        subscribed = self.publisher.subscribed
        await self.publisher.start()
        await self.health.up()
        # XPUB_VERBOSE: the listener's SUB subscribing again on the new socket
        await self.publisher.wait_for_subscriber(count=subscribed + 1, timeout_s=10)


class TrtllmTruthEngine(Truthful):
    """A simulated TensorRT-LLM engine: the same block pool as `TruthEngine`, its events served
    by `trtllm-serve`'s drain-on-read `POST /kv_cache_events` (the project's `SimTrtllmServer`
    on a fixed port), each event folded into the oracle as it is queued."""

    engine = "trtllm"

    def __init__(self, name: str) -> None:
        self.name = name
        self.core = EngineCore(POOL_BLOCKS, BLOCK_SIZE)
        self.server = SimTrtllmServer()
        self.port = free_port()
        self._init_truth(Engine.TRTLLM)
        self._running: ServedTrtllm | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}{TRTLLM_PATH}"

    async def start(self) -> TrtllmTruthEngine:
        self._running = await self.server.serve(port=self.port)
        await self._open_edges()
        return self

    async def close(self) -> None:
        await self._close_edges()
        if self._running is not None:
            await self._running.close()
            self._running = None

    def publish_step(self, *, lost: bool = False) -> None:
        """Queue the step's events (`lost`: they never reach the wire, their ids are skipped)."""
        events = self.core.take_events()
        for ev in events:
            if isinstance(ev, BlockStored):  # one `stored` record of single-block events
                bs = ev.block_size
                singles = [BlockStored(block_hashes=(h,),
                                       parent_hash=ev.parent_hash if i == 0 else ev.block_hashes[i - 1],
                                       token_ids=ev.token_ids[i * bs:(i + 1) * bs], block_size=bs,
                                       medium=ev.medium)
                           for i, h in enumerate(ev.block_hashes)]
                self._emit(lost, *singles)
                self.truth.feed_batch(EventBatch(time.time(), tuple(singles)))
            elif isinstance(ev, BlockRemoved):  # TRT-LLM's removed events carry no medium
                removed = BlockRemoved(ev.block_hashes)
                self._emit(lost, removed)
                self.truth.feed_batch(EventBatch(time.time(), (removed,)))
        if events:
            self.last_publish = time.monotonic()

    def _emit(self, lost: bool, *events: Any) -> None:
        if lost:
            self.server.lose(1)
        else:
            self.server.emit(*events)

    def serve(self, msgs: Sequence[Mapping[str, Any]], output_tokens: int = 0, *,
              lost: bool = False) -> None:
        rng = random.Random(len(msgs[-1]["content"]))
        self.core.serve(render_chat(TOKENIZER, msgs),
                        [rng.randrange(3, len(TOKENIZER)) for _ in range(output_tokens)])
        self.publish_step(lost=lost)


# --- the listener and the routers --------------------------------------------------------------


def source(engine: TruthEngine | TrtllmTruthEngine, **extra: Any) -> dict[str, Any]:
    if isinstance(engine, TrtllmTruthEngine):
        return {"backend_name": engine.name, "engine": "trtllm", "model": MODEL,
                "trtllm_endpoint": engine.url, "poll_interval": "100ms",
                "tokenizer": str(DEMO_TOKENIZER_DIR),  # trtllm-serve has no /detokenize
                "engine_down_after": f"{ENGINE_DOWN_AFTER_S}s", **extra}
    return {"backend_name": engine.name, "engine": "vllm", "model": MODEL,
            "zmq_endpoint": engine.endpoint, "zmq_mode": "connect",
            "replay_endpoint": engine.replay_endpoint,
            "detokenize_endpoint": engine.http.url, "health_endpoint": engine.health.url,
            "health_interval": "500ms", "engine_down_after": f"{ENGINE_DOWN_AFTER_S}s",
            "allowed_publishers": ["127.0.0.1"], **extra}


def listener_config(port: int, engines: Sequence[TruthEngine | TrtllmTruthEngine],
                    extra_sources: Sequence[Mapping[str, Any]] = (), **top: Any) -> dict[str, Any]:
    return {"listen": f"127.0.0.1:{port}", "log": {"level": "info", "format": "json"},
            "update_interval": "50ms",
            "sources": [source(e) for e in engines] + list(extra_sources), **top}


def router_config(listener: str, backends: Iterable[str], admin_port: int,
                  redis_url: str | None = None) -> dict[str, Any]:
    kv: dict[str, Any] = {"event_sources": [
        {"backend_name": b, "endpoint": f"http://{listener}/events/{b}",
         "reconnect_interval_ms": 100} for b in backends]}
    doc: dict[str, Any] = {"kv_cache_index": kv, "admin": {"listen": f"127.0.0.1:{admin_port}"},
                           "log": {"level": "info", "format": "json"}}
    if redis_url is not None:
        kv["backend"] = "redis"
        # A probe every second, not the default 30 s: the Redis fault tests wait for recovery.
        doc["response_cache"] = {"redis": {"url": redis_url, "command_timeout_ms": 500,
                                           "connect_timeout_ms": 500, "probe_interval_ms": 1000}}
    return doc


BUS_TOKEN = b"reliability-listener-token-5e1f"
BUS_CLIENT = "kv-listener-a"


def bus_listener_block(port: int, ca_file: str, token_file: Path) -> dict[str, Any]:
    """The listener's `event_bus` block: push every backend to the router's bus on `port`."""
    return {"url": f"https://127.0.0.1:{port}", "ca_file": ca_file, "tls_server_name": "localhost",
            "client_id": BUS_CLIENT, "credential_file": str(token_file),
            "reconnect_backoff": {"initial": "100ms", "max": "1s"}}


def bus_router_config(backends: Sequence[str], admin_port: int, bus_port: int, cert: str,
                      key: str) -> dict[str, Any]:
    """A router whose sources are pushed to it (transport event_bus) by the listener."""
    return {"kv_cache_index": {"event_sources": [
                {"backend_name": b, "transport": "event_bus", "reconnect_interval_ms": 100}
                for b in backends]},
            "dynamo": {"event_bus": {
                "enabled": True, "listen": f"127.0.0.1:{bus_port}",
                "tls": {"cert": cert, "key": key, "client_ca": None},
                "brokers": [{"id": BUS_CLIENT, "role": "kv_listener",
                             "token_hash": token_hash(BUS_TOKEN), "backends": list(backends)}]}},
            "admin": {"listen": f"127.0.0.1:{admin_port}"},
            "log": {"level": "info", "format": "json"}}


@dataclass(repr=False)
class RouterView:
    """One router process, read through its admin API."""

    name: str
    daemon: Daemon
    admin_port: int

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}/admin/kv-index"

    async def state(self, http: aiohttp.ClientSession, backend: str,
                    keys: Iterable[str]) -> tuple[int, dict[str, tuple[int, str]]]:
        """(entries of `backend` in the index, prefix -> (token_count, tier) for `keys`)."""
        async with http.get(f"{self.admin}/backends") as resp:
            assert resp.status == 200, f"{self.name}: /backends {resp.status}"
            body = await resp.json()
        entries = next((b["index"]["entries"] for b in body["backends"]
                        if b["backend_name"] == backend), 0)
        found: dict[str, tuple[int, str]] = {}
        for k in keys:
            async with http.get(f"{self.admin}/prefix/{k}") as resp:
                if resp.status == 404:
                    continue
                assert resp.status == 200, f"{self.name}: /prefix {resp.status}"
                holders = (await resp.json())["holders"]
            for h in holders:
                if h["backend"] == backend:
                    found[k] = (h["token_count"], h["tier"])
        return entries, found


@dataclass(repr=False)
class Stack:
    tmp: Path
    http: aiohttp.ClientSession
    engines: dict[str, Any]  # TruthEngine | TrtllmTruthEngine
    listener: Daemon
    views: dict[str, StreamView]
    routers: list[RouterView]
    redis: Any
    bus_port: int | None = None

    @property
    def base(self) -> str:
        return self.listener.base

    def engine(self, name: str) -> Any:
        return self.engines[name]

    async def restart_views(self) -> None:
        for v in self.views.values():
            await v.close()
        self.views = {n: StreamView(self.base, n) for n in self.engines}
        for v in self.views.values():
            v.start(self.http)
        async with asyncio.timeout(10):
            for v in self.views.values():
                await v.connected.wait()
                v.check()

    async def quiet(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            for v in self.views.values():
                v.check()
            latest = max([v.last_at for v in self.views.values()]
                         + [e.last_publish for e in self.engines.values()])
            now = time.monotonic()
            if now - latest >= QUIET_S:
                return
            if now >= deadline:
                raise AssertionError("engines/listener never went quiet")
            await asyncio.sleep(QUIET_S - (now - latest) + 0.01)

    async def problems(self) -> list[str]:
        out: list[str] = []
        for name, e in self.engines.items():
            e.check_truth()
            truth = e.truth.expected()
            out += [f"{name} listener stream: {d}" for d in diff(self.views[name].state, truth)]
            for r in self.routers:
                entries, found = await r.state(self.http, name, truth)
                out += [f"{name} router {r.name}: {d}" for d in diff(found, truth)]
                if entries != len(truth):
                    out.append(f"{name} router {r.name}: {entries} entries, engine holds "
                               f"{len(truth)} prefixes")
        return out

    async def converge(self, timeout_s: float = 30.0) -> dict[str, int]:
        """Quiet, then listener streams and router indexes equal every engine's truth (waiting,
        bounded, for stragglers: a resync or a detokenize retry is not a bug, staying wrong is).
        Returns backend -> prefixes held, so a test can also require it is not trivially 0."""
        deadline = time.monotonic() + timeout_s
        while True:
            await self.quiet(max(1.0, deadline - time.monotonic()))
            found = await self.problems()
            if not found:
                return {n: len(e.truth.expected()) for n, e in self.engines.items()}
            if time.monotonic() >= deadline:
                raise AssertionError("not converged after the fault:\n  " + "\n  ".join(found)
                                     + self._last_logs())
            await asyncio.sleep(0.25)

    def _last_logs(self) -> str:
        """The listener's last log lines and each router's last warnings and errors, for a
        failure message: what a process said about the fault is most of the diagnosis."""
        def lines(recs: list[dict[str, Any]]) -> str:
            return "\n  ".join(str({k: v for k, v in rec.items() if k not in ("timestamp", "_seen")})
                               for rec in recs)
        out = "\nlistener's last log lines:\n  " + lines(self.listener.read_logs()[-25:])
        for r in self.routers:
            warned = [rec for rec in r.daemon.read_logs() if rec.get("level") in ("warning", "error")]
            out += f"\nrouter {r.name}'s last warnings and errors:\n  " + lines(warned[-15:])
        return out

    async def listener_stats(self) -> dict[str, Any]:
        async with self.http.get(f"{self.base}/stats") as resp:
            assert resp.status == 200
            body: dict[str, Any] = await resp.json()
            return body

    async def healthz(self) -> int:
        async with self.http.get(f"{self.base}/healthz",
                                 timeout=aiohttp.ClientTimeout(total=5)) as resp:
            return resp.status
