"""Many routers, one index (issue 16): three real router processes with the Redis index on a real
local Redis Cluster and `writer_lease` on, against one real listener and the truth engines of
the reliability harness. Exactly one router writes each backend; all three read the same index,
equal to what the engines hold; the writer is SIGKILLed in the middle of traffic, another router
takes its backends over within the lease time, and the index is right again."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio.cluster import RedisCluster

from tests.conftest import free_port
from tests.reliability.conftest import running_stack
from tests.reliability.harness import RouterView, router_config
from tests.support.daemon import Daemon
from tests.support.redis_cluster import LocalRedisCluster

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


@pytest.mark.timeout(240)
async def test_three_routers_one_writer_per_backend_and_a_killed_writer_is_replaced(
    tmp_path: Path,
) -> None:
    async with running_stack(tmp_path) as (stack, cleanup):
        cluster = LocalRedisCluster(tmp_path / "cluster")
        cluster.start()
        cleanup.callback(cluster.stop)
        backends = list(stack.engines)
        routers = []
        for name in NAMES:
            port = free_port()
            doc = router_config(stack.listener.base.removeprefix("http://"), backends, port,
                                cluster.url)
            doc["response_cache"]["redis"] |= {"cluster": True, "failover_wait_ms": 2000}
            doc["kv_cache_index"]["writer_lease"] = {
                "enabled": True, "ttl_ms": TTL_MS, "renew_interval_ms": RENEW_MS,
                "holder_id": f"router-{name}"}
            d = Daemon(doc, tmp_path, command=("router",), name=f"router-{name}",
                       started="router_started")
            cleanup.push_async_callback(d.stop)
            await d.start()
            routers.append(RouterView(name, d, port))
        stack.routers = routers  # converge() checks these three (the harness' own two as well
        # would read other indexes: they are not part of this test)
        rc = RedisCluster.from_url(cluster.url, decode_responses=True)
        cleanup.push_async_callback(rc.aclose)

        for e in stack.engines.values():
            e.traffic(10, seed=51)
        held = await stack.converge(timeout_s=45)
        assert all(n > 0 for n in held.values()), held
        owners = await holders(rc, backends)
        assert all(h in {f"router-{n}" for n in NAMES} for h in owners.values()), owners
        assert await writers(stack, routers) == {b: [h] for b, h in owners.items()}

        # Kill the writer of the first backend in the middle of traffic.
        victim_id = owners[backends[0]]
        victim = next(r for r in routers if f"router-{r.name}" == victim_id)
        for e in stack.engines.values():
            e.traffic(6, seed=52)
        killed_at = time.monotonic()
        await victim.daemon.kill()
        for e in stack.engines.values():
            e.traffic(6, seed=53)
        stack.routers = [r for r in routers if r is not victim]
        deadline = killed_at + (TTL_MS + 2 * RENEW_MS) / 1000 + 3.0  # + start of the resync
        while True:
            now_owners = await holders(rc, backends)
            moved = {b: h for b, h in now_owners.items() if owners[b] == victim_id}
            if all(h not in (None, victim_id) for h in moved.values()):
                break
            assert time.monotonic() < deadline, f"no takeover: {now_owners}"
            await asyncio.sleep(0.1)  # the lease key changes in Redis; nothing announces it
        takeover_s = time.monotonic() - killed_at
        assert takeover_s < deadline - killed_at
        held = await stack.converge(timeout_s=45)
        assert all(n > 0 for n in held.values()), held
        after = await holders(rc, backends)
        assert await writers(stack, stack.routers) == {b: [h] for b, h in after.items()}
        print(f"takeover after the writer's SIGKILL: {takeover_s:.2f} s (ttl {TTL_MS} ms)")
