"""Many routers, one index (issue 16): three real router processes with the Redis index on a real
local Redis Cluster and `writer_lease` on, against one real listener and the truth engines of
the reliability harness. Exactly one router writes each backend; all three read the same index,
equal to what the engines hold.

Pull mode (SSE): the writer is SIGKILLed in the middle of traffic, another router takes its
backends over within the lease time, and the index is right again; then the Redis master that
holds a lease key is SIGKILLed mid traffic and its replica promoted, and the index converges
again with one writer per backend.

Push mode (event bus): the listener reaches the routers' buses through an L4 balancer (what a
Kubernetes Service is to it), so its one session lands on one router at a time. The router
holding the session writes; when the balancer moves the session to another live router, the
old one gives the leases back at once and the new one takes them; when the session's router is
SIGKILLed, the router the listener reconnects to takes over once the dead one's lease expires."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio.cluster import RedisCluster

from tests.reliability.conftest import running_stack
from tests.reliability.harness import RouterView, Stack, bus_router_config, router_config
from tests.support.daemon import Daemon
from tests.support.ports import free_port
from tests.support.redis_cluster import LocalRedisCluster
from tests.support.tls import TlsMaterial

TTL_MS, RENEW_MS = 1500, 400
NAMES = ("a", "b", "c")


async def holders(rc: RedisCluster, backends: list[str]) -> dict[str, str | None]:
    return {b: await rc.get(f"cr:kvidx:lease:{b}") for b in backends}


async def writers(stack: Any, routers: list[RouterView]) -> dict[str, list[str]]:
    """backend -> the routers whose admin API says `lease: writer` for it."""
    out: dict[str, list[str]] = {}
    for r in routers:
        async with stack.http.get(f"{r.admin}/backends") as resp:
            assert resp.status == 200
            for b in (await resp.json())["backends"]:
                if b.get("lease") == "writer":
                    out.setdefault(b["backend_name"], []).append(f"router-{r.name}")
    return out


def with_lease(doc: dict[str, Any], cluster: LocalRedisCluster, name: str) -> dict[str, Any]:
    """`doc` (a router file) on the cluster index with the writer lease, holder `router-<name>`."""
    doc["kv_cache_index"]["backend"] = "redis"
    # failover_wait_ms well above a failover (about 2.5 s here, longer on a loaded machine):
    # at 2000 ms all three routers could fall back at once during the master's failover, and a
    # router in its fallback holds no lease until its 30 s probe (the suite failed so once,
    # 2026-12-04: both lease keys empty after the failover). The default is 15000.
    doc["response_cache"] = {"redis": {"url": cluster.url, "cluster": True,
                                       "failover_wait_ms": 10000, "command_timeout_ms": 500,
                                       "connect_timeout_ms": 500}}
    doc["kv_cache_index"]["writer_lease"] = {
        "enabled": True, "ttl_ms": TTL_MS, "renew_interval_ms": RENEW_MS,
        "holder_id": f"router-{name}"}
    return doc


async def start_routers(tmp: Path, cleanup: contextlib.AsyncExitStack,
                        docs: dict[str, dict[str, Any]], admin_ports: dict[str, int]
                        ) -> list[RouterView]:
    routers = []
    for name, doc in docs.items():
        d = Daemon(doc, tmp, command=("router",), name=f"router-{name}", started="router_started")
        cleanup.push_async_callback(d.stop)
        await d.start()
        routers.append(RouterView(name, d, admin_ports[name]))
    return routers


async def start_cluster(tmp: Path, cleanup: contextlib.AsyncExitStack
                        ) -> tuple[LocalRedisCluster, RedisCluster]:
    cluster = LocalRedisCluster(tmp / "cluster")
    await asyncio.to_thread(cluster.start)
    cleanup.callback(cluster.stop)
    rc = RedisCluster.from_url(cluster.url, decode_responses=True)
    cleanup.push_async_callback(rc.aclose)
    return cluster, rc


async def one_writer_each(stack: Stack, rc: RedisCluster, routers: list[RouterView],
                          backends: list[str]) -> dict[str, str | None]:
    """Every backend has exactly one writer, a live router, and its lease key names it."""
    owners = await holders(rc, backends)
    live = {f"router-{r.name}" for r in routers}
    assert all(h in live for h in owners.values()), owners
    assert await writers(stack, routers) == {b: [h] for b, h in owners.items()}
    return owners


async def settled_one_writer_each(stack: Stack, rc: RedisCluster, routers: list[RouterView],
                                  backends: list[str]) -> dict[str, str | None]:
    """`one_writer_each`, once the leases have settled after a Redis failover (bounded).

    Replication is asynchronous: the promoted replica may hold a lease key with an older expiry
    than the last renewal the dead master acknowledged, so another router can take the lease
    while the old writer still relies on that renewal. The old writer learns it at its next
    renewal (it finds the other holder) or stops when its validity runs out: at most about one
    ttl of two writers (the caveat Redlock documents), never longer."""
    limit = (TTL_MS + 2 * RENEW_MS) / 1000 + 2.0
    deadline = time.monotonic() + limit
    while True:
        try:
            return await one_writer_each(stack, rc, routers, backends)
        except AssertionError:
            if time.monotonic() >= deadline:
                raise
        await asyncio.sleep(0.05)  # lease state changes in Redis and in the routers' admin API


async def until_held_by(rc: RedisCluster, backends: list[str], ok: Any, limit_s: float) -> float:
    """Seconds until `ok(holder)` holds for every backend's lease key (bounded by `limit_s`)."""
    start = time.monotonic()
    while True:
        now = await holders(rc, backends)
        if all(ok(h) for h in now.values()):
            return time.monotonic() - start
        assert time.monotonic() - start < limit_s, f"leases not moved in {limit_s} s: {now}"
        await asyncio.sleep(0.05)  # the lease key changes in Redis; nothing announces it


def traffic(stack: Stack, n: int, seed: int) -> None:
    for e in stack.engines.values():
        e.traffic(n, seed=seed)


@pytest.mark.timeout(240)
async def test_three_routers_one_writer_per_backend_a_killed_writer_and_a_failover(
    tmp_path: Path,
) -> None:
    async with running_stack(tmp_path) as (stack, cleanup):
        cluster, rc = await start_cluster(tmp_path, cleanup)
        backends = list(stack.engines)
        listener = stack.listener.base.removeprefix("http://")
        ports = {name: free_port() for name in NAMES}
        docs = {name: with_lease(router_config(listener, backends, ports[name]), cluster, name)
                for name in NAMES}
        routers = await start_routers(tmp_path, cleanup, docs, ports)
        stack.routers = routers  # converge() checks these three (the harness' own two as well
        # would read other indexes: they are not part of this test)

        traffic(stack, 10, seed=51)
        held = await stack.converge(timeout_s=45)
        assert all(n > 0 for n in held.values()), held
        owners = await one_writer_each(stack, rc, routers, backends)

        # Kill the writer of the first backend in the middle of traffic.
        victim_id = owners[backends[0]]
        victim = next(r for r in routers if f"router-{r.name}" == victim_id)
        traffic(stack, 6, seed=52)
        await victim.daemon.kill()
        traffic(stack, 6, seed=53)
        stack.routers = [r for r in routers if r is not victim]
        limit = (TTL_MS + 2 * RENEW_MS) / 1000 + 3.0  # + the start of the resync
        takeover_s = await until_held_by(rc, backends, lambda h: h not in (None, victim_id),
                                         limit)
        held = await stack.converge(timeout_s=45)
        assert all(n > 0 for n in held.values()), held
        await one_writer_each(stack, rc, stack.routers, backends)
        print(f"takeover after the writer's SIGKILL: {takeover_s:.2f} s (ttl {TTL_MS} ms)")

        # Kill the Redis master holding the first backend's lease key, mid traffic.
        traffic(stack, 6, seed=54)
        killed = await asyncio.to_thread(cluster.kill_master_of, f"cr:kvidx:lease:{backends[0]}")
        failed_at = time.monotonic()
        traffic(stack, 6, seed=55)
        await asyncio.to_thread(cluster.wait_failover, killed)
        failover_s = time.monotonic() - failed_at
        traffic(stack, 4, seed=56)
        # Under the fallback's 30 s probe interval: a router whose own index fell back during
        # the failover must not keep a lease (it would leave the shared index stale till then).
        held = await stack.converge(timeout_s=20)
        assert all(n > 0 for n in held.values()), held
        await settled_one_writer_each(stack, rc, stack.routers, backends)
        print(f"a master's failover under three routers: {failover_s:.2f} s, converged after "
              f"{time.monotonic() - failed_at:.2f} s")


class Balancer:
    """An L4 balancer in front of the routers' event buses (a Kubernetes Service, to the
    listener): each new TCP connection goes to the preferred port, else the next that accepts;
    TLS passes through untouched. `cut()` drops every connection (a rebalance, a node drained)."""

    def __init__(self, ports: list[int]) -> None:
        self.ports = ports
        self.preferred = 0
        self.writers: set[asyncio.StreamWriter] = set()
        self.server: asyncio.Server | None = None

    async def start(self, port: int) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", port)

    async def _serve(self, down_r: asyncio.StreamReader, down_w: asyncio.StreamWriter) -> None:
        self.writers.add(down_w)
        try:
            for i in range(len(self.ports)):
                port = self.ports[(self.preferred + i) % len(self.ports)]
                try:
                    up_r, up_w = await asyncio.open_connection("127.0.0.1", port)
                except OSError:
                    continue
                self.writers.add(up_w)
                try:
                    await asyncio.gather(_pipe(down_r, up_w), _pipe(up_r, down_w))
                finally:
                    self.writers.discard(up_w)
                return
        finally:
            down_w.transport.abort()
            self.writers.discard(down_w)

    def cut(self) -> None:
        for w in list(self.writers):
            w.transport.abort()
        self.writers.clear()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        self.cut()
        if self.server is not None:
            await self.server.wait_closed()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy until EOF or an error, then drop the other side too (no half-open connections)."""
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.transport.abort()


@pytest.mark.timeout(240)
async def test_push_mode_the_router_holding_the_session_writes(tmp_path: Path) -> None:
    tls = TlsMaterial.create(tmp_path / "tls")
    async with running_stack(tmp_path, bus=tls) as (stack, cleanup):
        cluster, rc = await start_cluster(tmp_path, cleanup)
        backends = list(stack.engines)
        admin = {name: free_port() for name in NAMES}
        bus = {name: free_port() for name in NAMES}
        docs = {name: with_lease(bus_router_config(backends, admin[name], bus[name],
                                                   tls.server.cert, tls.server.key),
                                 cluster, name)
                for name in NAMES}
        routers = await start_routers(tmp_path, cleanup, docs, admin)
        # The listener pushes to stack.bus_port: the harness' bus router leaves it to the
        # balancer in front of the three.
        await next(r for r in stack.routers if r.name == "bus").daemon.stop()
        assert stack.bus_port is not None
        lb = Balancer([bus[name] for name in NAMES])
        await lb.start(stack.bus_port)
        cleanup.push_async_callback(lb.close)
        stack.routers = routers

        traffic(stack, 10, seed=61)
        await until_held_by(rc, backends, lambda h: h == "router-a", 15.0)
        held = await stack.converge(timeout_s=45)
        assert all(n > 0 for n in held.values()), held
        await one_writer_each(stack, rc, routers, backends)

        # The balancer moves the session to c while a lives: a gives its leases back at once.
        lb.preferred = 2
        lb.cut()
        moved_s = await until_held_by(rc, backends, lambda h: h == "router-c", TTL_MS / 1000)
        traffic(stack, 6, seed=62)
        held = await stack.converge(timeout_s=45)
        assert all(n > 0 for n in held.values()), held
        await one_writer_each(stack, rc, routers, backends)

        # c, the session's router, is SIGKILLed: the listener lands on b, which takes over once
        # c's lease has expired.
        lb.preferred = 1
        traffic(stack, 6, seed=63)
        await routers[2].daemon.kill()
        traffic(stack, 6, seed=64)
        stack.routers = routers[:2]
        limit = (TTL_MS + 2 * RENEW_MS) / 1000 + 3.0  # + the listener's reconnect backoff
        takeover_s = await until_held_by(rc, backends, lambda h: h == "router-b", limit)
        held = await stack.converge(timeout_s=45)
        assert all(n > 0 for n in held.values()), held
        await one_writer_each(stack, rc, stack.routers, backends)
        print(f"push mode: session moved, leases followed in {moved_s:.2f} s; session's router "
              f"killed, taken over in {takeover_s:.2f} s (ttl {TTL_MS} ms)")
