"""The standalone router (`continuum-kv-listener router --config FILE`): a real process against a
real listener SSE server (the listener's own stream hub and app, run here), its admin JSON, its
signals (SIGHUP adds a source, an invalid file keeps the running one, SIGTERM exits 0), its
one-line config errors; in process: push mode through its event bus and a reload that revokes a
listener's backend; the metrics allow-list following a reload."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from prometheus_client import CollectorRegistry

from kv_listener.core import bus_protocol as bp
from kv_listener.core.model import PrefixTransition, Tier, TransitionKind
from kv_listener.outputs.bus_client import BusClient
from kv_listener.outputs.sse_server import NoSources, create_app, serve
from kv_listener.outputs.streams import StreamHub
from kv_listener.router.app import Router, cleanup_interval_s
from kv_listener.router.config import load_router_config
from kv_listener.router.index import IndexEvent, InMemoryKvIndex
from kv_listener.router.metrics import EventDropReason, RouterMetrics
from tests.support.bus import TOKEN_A, listener_config, write_token
from tests.support.ports import free_port
from tests.support.tls import TlsMaterial
from tests.support.waits import catches, until

CMD = [sys.executable, "-m", "kv_listener"]
P = [f"{i:064x}" for i in range(1, 6)]




def new_hub(*backends: str) -> StreamHub:
    hub = StreamHub(history_size=1000, max_lag=1000, update_interval_s=0.0, max_sse_clients=16,
                    ping_interval_s=None)
    for b in backends:
        hub.add_backend(b)
    return hub


def router_file(path: Path, sse_port: int, admin_port: int, backends: Sequence[str],
                **extra: Any) -> Path:
    doc: dict[str, Any] = {
        "kv_cache_index": {"event_sources": [
            {"backend_name": b, "endpoint": f"http://127.0.0.1:{sse_port}/events/{b}",
             "reconnect_interval_ms": 50} for b in backends]},
        "admin": {"listen": f"127.0.0.1:{admin_port}"},
        "log": {"level": "info", "format": "json"},
        **extra,
    }
    path.write_text(yaml.safe_dump(doc))
    return path


class RouterProcess:
    """The router as a child process; its JSON log lines are read as they come."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.seen: list[dict[str, Any]] = []

    async def started(self) -> dict[str, Any]:
        """The `router_started` record, once the router also handles SIGHUP: it logs that line
        at the end of its start, before `run()` installs its signal handlers, and a SIGHUP in
        between ends the process (the default action; seen on two loaded cores)."""
        started = await self.event("router_started")
        await until(lambda: catches(self.proc.pid, signal.SIGHUP), "the router handling SIGHUP")
        return started

    async def event(self, name: str, timeout_s: float = 20.0) -> dict[str, Any]:
        """The next log record named `name` (records read on the way are kept in `seen`)."""
        assert self.proc.stderr is not None
        async with asyncio.timeout(timeout_s):
            while True:
                raw = await self.proc.stderr.readline()
                if not raw:
                    raise AssertionError(f"router exited before logging {name!r}: {self.seen}")
                line = raw.decode().strip()
                if not line.startswith("{"):
                    continue
                rec = json.loads(line)
                self.seen.append(rec)
                if rec.get("event") == name:
                    return dict(rec)


@contextlib.asynccontextmanager
async def router_process(config: Path) -> AsyncIterator[RouterProcess]:
    proc = await asyncio.create_subprocess_exec(
        *CMD, "router", "--config", str(config), stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE, env=dict(os.environ))
    try:
        yield RouterProcess(proc)
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


async def eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = 10.0) -> None:
    """The router is another process with no event to await: poll its HTTP API, bounded."""
    async with asyncio.timeout(timeout_s):
        while not await check():
            await asyncio.sleep(0.02)


async def get_json(http: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with http.get(url) as resp:
        return resp.status, await resp.json(content_type=None)


async def test_router_process_indexes_a_listener_stream_reloads_and_stops_with_0(
        tmp_path: Path) -> None:
    hub = new_hub("vllm-1", "vllm-2")
    sse = await serve(create_app(hub, NoSources()), "127.0.0.1", 0)
    admin_port = free_port()
    admin = f"http://127.0.0.1:{admin_port}/admin/kv-index"
    config = router_file(tmp_path / "router.yaml", sse.port, admin_port, ["vllm-1"])
    try:
        async with router_process(config) as router, aiohttp.ClientSession() as http:
            started = await router.started()
            assert started["admin"] == f"127.0.0.1:{admin_port}" and started["event_sources"] == 1
            await hub.wait_clients(lambda n: n == 1)  # the consumer of vllm-1 is connected

            hub.publish("vllm-1", [PrefixTransition(TransitionKind.CREATED, P[0], 1024,
                                                    Tier.GPU_HOT)])

            async def holds(prefix: str, backend: str) -> bool:
                status, body = await get_json(http, f"{admin}/prefix/{prefix}")
                return status == 200 and [h["backend"] for h in body["holders"]] == [backend]

            await eventually(lambda: holds(P[0], "vllm-1"))
            _, body = await get_json(http, f"{admin}/prefix/{P[0]}")
            assert body == {"prefix_hash": P[0], "holders": [
                {"backend": "vllm-1", "token_count": 1024, "tier": "gpu_hot", "score": 1.0}]}
            status, _ = await get_json(http, f"{admin}/prefix/{P[1]}")
            assert status == 404

            # SIGHUP with a second source: it connects and its records reach the index.
            router_file(config, sse.port, admin_port, ["vllm-1", "vllm-2"])
            router.proc.send_signal(signal.SIGHUP)
            reloaded = await router.event("config_reloaded")
            assert reloaded["added"] == ["vllm-2"] and reloaded["removed"] == []
            await hub.wait_clients(lambda n: n == 2)
            hub.publish("vllm-2", [PrefixTransition(TransitionKind.CREATED, P[1], 256,
                                                    Tier.GPU_HOT)])
            await eventually(lambda: holds(P[1], "vllm-2"))
            _, backends = await get_json(http, f"{admin}/backends")
            assert [(b["backend_name"], b["configured"], b["connection"]["connected"])
                    for b in backends["backends"]] == [("vllm-1", True, True),
                                                       ("vllm-2", True, True)]
            async with http.get(f"http://127.0.0.1:{admin_port}/metrics") as resp:
                metrics = await resp.text()
            assert 'continuum_kv_consumer_connected{backend="vllm-2"} 1.0' in metrics

            # An invalid file: logged, and the running configuration stays.
            good = config.read_text()
            config.write_text("kv_cache_index:\n  scoring: {overlap_weight: 0.9}\n")
            router.proc.send_signal(signal.SIGHUP)
            failed = await router.event("config_reload_failed")
            assert any("kv_cache_index.scoring" in e for e in failed["errors"])
            assert router.proc.returncode is None
            _, stats = await get_json(http, f"{admin}/stats")
            assert stats["config"]["event_sources_count"] == 2
            assert stats["index"]["prefix_count"] == 2
            config.write_text(good)

            # SIGTERM: consumers stop (the hub sees its streams close), exit 0.
            router.proc.send_signal(signal.SIGTERM)
            await router.event("router_stopped")
            assert await asyncio.wait_for(router.proc.wait(), 15) == 0
            await hub.wait_clients(lambda n: n == 0)
    finally:
        await hub.drain(timeout_s=1.0)
        await sse.stop()
        hub.close()


STORMS = 10


async def test_a_sighup_storm_ends_on_the_last_file(tmp_path: Path) -> None:
    """A SIGHUP that arrives while a reload runs is not dropped: the file may have changed
    after that reload read it, and the last SIGHUP must win."""
    hub = new_hub("vllm-1", "vllm-2", "vllm-3")
    sse = await serve(create_app(hub, NoSources()), "127.0.0.1", 0)
    admin_port = free_port()
    config = router_file(tmp_path / "router.yaml", sse.port, admin_port, ["vllm-1"])
    try:
        async with router_process(config) as router, aiohttp.ClientSession() as http:
            await router.started()
            # Storms of 30 until one SIGHUP came while a reload ran (bounded): on two loaded
            # cores the router may not run at all during a storm, and the SIGHUPs still pending
            # then are one (the kernel keeps one of a kind), so no reload was running for them.
            for _ in range(STORMS):
                for i in range(30):
                    router_file(config, sse.port, admin_port,
                                ["vllm-1", "vllm-2"] if i % 2 else ["vllm-1"])
                    router.proc.send_signal(signal.SIGHUP)
                with contextlib.suppress(TimeoutError):
                    await router.event("config_reload_queued", timeout_s=1.0)
                    break
            router_file(config, sse.port, admin_port, ["vllm-1", "vllm-3"])
            router.proc.send_signal(signal.SIGHUP)

            async def on_last_file() -> bool:
                _, body = await get_json(http, f"http://127.0.0.1:{admin_port}/admin/kv-index/backends")
                return sorted(b["backend_name"] for b in body["backends"]
                              if b["configured"]) == ["vllm-1", "vllm-3"]

            await eventually(on_last_file, timeout_s=30)
            router.proc.send_signal(signal.SIGTERM)
            await router.event("router_stopped")
            assert await asyncio.wait_for(router.proc.wait(), 15) == 0
        events = [r["event"] for r in router.seen]
        # Signals that came during a reload were queued, none dropped.
        assert "config_reload_busy" not in events
        assert "config_reload_queued" in events
    finally:
        await hub.drain(timeout_s=1.0)
        await sse.stop()
        hub.close()


def run_cli(*args: str) -> tuple[int, list[str]]:
    import subprocess  # noqa: PLC0415

    proc = subprocess.run([*CMD, *args], capture_output=True, text=True, timeout=30, check=False)
    return proc.returncode, proc.stderr.strip().splitlines()


def test_invalid_router_file_exits_2_with_one_line_per_error(tmp_path: Path) -> None:
    bad = tmp_path / "router.yaml"
    doc: dict[str, Any] = {
        "kv_cache_index": {"max_entries": -1,
                           "event_sources": [{"backend_name": "bad name!", "endpoint": "x"}]},
        "admin": {"listen": "nowhere"},
    }
    # log.format json (the default): each error is a JSON log line, as every other line is.
    bad.write_text(yaml.safe_dump(doc))
    code, lines = run_cli("router", "--config", str(bad))
    assert code == 2
    records = [json.loads(line) for line in lines]
    assert {r["event"] for r in records} == {"config_invalid"}, lines
    text = "\n".join(r["detail"] for r in records)
    for path in ("kv_cache_index.max_entries", "kv_cache_index.event_sources[0].backend_name",
                 "admin.listen"):
        assert path in text
    assert "Traceback" not in "\n".join(lines)
    # log.format console: one plain line per error.
    bad.write_text(yaml.safe_dump({**doc, "log": {"format": "console"}}))
    code, lines = run_cli("router", "--config", str(bad))
    assert code == 2
    assert all(line.startswith("continuum-kv-listener: error: ") for line in lines), lines
    assert sum("kv_cache_index.max_entries" in line for line in lines) == 1
    # `config validate` reads the same file the same way.
    code, lines = run_cli("config", "validate", str(bad))
    assert code == 2 and any("admin.listen" in line for line in lines)


def test_admin_address_in_use_exits_1(tmp_path: Path) -> None:
    """A busy port is a runtime failure (exit 1: systemd's Restart=on-failure tries again), not
    a configuration error (2: RestartPreventExitStatus keeps the unit down)."""
    import socket  # noqa: PLC0415

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        config = router_file(tmp_path / "router.yaml", 1, port, ["vllm-1"])
        code, lines = run_cli("router", "--config", str(config))
    assert code == 1
    failed = [json.loads(line) for line in lines if '"start_failed"' in line]
    assert len(failed) == 1, lines
    assert failed[0]["detail"].startswith(f"admin.listen: cannot bind 127.0.0.1:{port}"), lines
    assert failed[0]["exit_code"] == 1
    assert "Traceback" not in "\n".join(lines)
    assert all(json.loads(line) for line in lines)  # nothing but JSON lines


def test_the_example_file_validates() -> None:
    example = Path(__file__).resolve().parent.parent / "config.router.yaml.example"
    code, lines = run_cli("config", "validate", str(example))
    assert code == 0, lines


class NotifyingIndex(InMemoryKvIndex):
    """The in-memory index, telling a test when an event was applied (the router takes an index
    from the embedding application)."""

    def __init__(self) -> None:
        super().__init__()
        self._applied = asyncio.Event()

    async def apply(self, event: IndexEvent) -> None:
        await super().apply(event)
        self._applied.set()
        self._applied = asyncio.Event()

    async def wait(self, predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                while not predicate():
                    await self._applied.wait()
        except TimeoutError:
            raise AssertionError(f"the index did not get there within {timeout_s} s") from None


async def test_in_process_router_with_event_bus_push_then_reload_revokes(tmp_path: Path) -> None:
    tls = TlsMaterial.create(tmp_path / "tls")
    bus_port = free_port()

    def write(backends: list[str]) -> Path:
        path = tmp_path / "router.yaml"
        path.write_text(yaml.safe_dump({
            "kv_cache_index": {"event_sources": [
                {"backend_name": "vllm-1", "transport": "event_bus", "reconnect_interval_ms": 20}]},
            "dynamo": {"event_bus": {
                "enabled": True, "listen": f"127.0.0.1:{bus_port}",
                "tls": {"cert": tls.server.cert, "key": tls.server.key},
                "brokers": [{"id": "kv-listener-a", "role": "kv_listener",
                             "token_hash": bp.token_hash(TOKEN_A), "backends": backends}]}},
            "admin": {"listen": f"127.0.0.1:{free_port()}"},
        }))
        return path

    path = write(["vllm-1"])
    index = NotifyingIndex()
    router = Router(load_router_config(path), path, index=index)
    hub = new_hub("vllm-1")
    client = BusClient(listener_config(bus_port, tls, write_token(tmp_path, TOKEN_A)),
                       lambda: ["vllm-1"], hub.open)
    await router.start()
    task = asyncio.create_task(client.run())
    try:
        assert router.bus is not None and router.bus.port == bus_port
        await hub.wait_clients(lambda n: n == 1)  # the router's consumer subscribed via the bus
        hub.publish("vllm-1", [PrefixTransition(TransitionKind.CREATED, P[2], 512, Tier.GPU_HOT)])
        await index.wait(lambda: bool(index.query_now(P[2])))
        assert [(h.backend, h.token_count) for h in index.query_now(P[2])] == [("vllm-1", 512)]
        assert [s.sources for s in router.bus.sessions()] == [("vllm-1",)]

        # The credential may no longer announce vllm-1: the reload ends the session.
        write([])
        assert await router.reload()
        assert router.bus.sessions() == []
        assert router.config.event_bus.brokers[0].backends == ()
        await hub.wait_clients(lambda n: n == 0)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await router.stop()
        await hub.drain(timeout_s=1.0)
        hub.close()
    assert router.bus is None and router.admin_server is None


def test_metrics_allow_list_follows_a_reload() -> None:
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry, ["vllm-1"])

    def connected(backend: str) -> float | None:
        return registry.get_sample_value("continuum_kv_consumer_connected", {"backend": backend})

    assert connected("vllm-1") == 0
    metrics.event_dropped_inc("vllm-2", EventDropReason.MALFORMED_JSON)  # not allowed yet
    metrics.set_backends(["vllm-2"])
    assert connected("vllm-1") is None  # a removed backend's alert series is gone
    assert connected("vllm-2") == 0
    metrics.set_connected("vllm-2", True)
    metrics.event_dropped_inc("vllm-2", EventDropReason.MALFORMED_JSON)
    assert connected("vllm-2") == 1
    dropped = "continuum_kv_event_dropped_total"
    assert registry.get_sample_value(dropped, {"backend": "other", "reason": "malformed_json"}) == 1
    # every reason of a configured backend exists from the start, at 0 (increase() sees a first drop)
    for reason in EventDropReason:
        if reason is not EventDropReason.MALFORMED_JSON:
            assert registry.get_sample_value(dropped, {"backend": "vllm-2", "reason": reason}) == 0
    assert registry.get_sample_value(dropped, {"backend": "vllm-2", "reason": "malformed_json"}) == 1


def test_cleanup_interval_is_a_tenth_of_the_ttl_within_bounds() -> None:
    assert cleanup_interval_s(600) == 60.0
    assert cleanup_interval_s(100) == 10.0
    assert cleanup_interval_s(3) == 1.0
