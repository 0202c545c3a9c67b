"""Processes failing around the engines, each ending with the convergence check: the listener
SIGKILLed and restarted, a router restarted, `redis-server` stopped and started again (empty),
SIGHUP storms over valid and invalid files."""

from __future__ import annotations

import signal

import pytest
import yaml

from tests.reliability.harness import Stack

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]


async def test_listener_sigkilled_and_restarted(stack: Stack) -> None:
    for e in stack.engines.values():
        e.traffic(15, seed=30)
    await stack.converge()
    await stack.listener.kill()
    for e in stack.engines.values():  # the engines go on meanwhile
        e.traffic(10, seed=31)
    await stack.listener.start()
    await stack.restart_views()  # the old streams ended with the process
    for name in stack.engines:  # rebuilt from each engine's replay buffer, from seq 0
        replay = await stack.listener.wait_log("zmq_startup_replay", backend=name)
        assert replay["status"] == "exact", replay
    for e in stack.engines.values():
        e.traffic(5, seed=32)
    held = await stack.converge()
    assert all(n >= 3 for n in held.values()), held


@pytest.mark.parametrize("which", ["memory", "redis"])
async def test_router_restarted(stack: Stack, which: str) -> None:
    router = next(r for r in stack.routers if r.name == which)
    await router.daemon.kill()
    for e in stack.engines.values():
        e.traffic(10, seed=33)
    await router.daemon.start()
    await stack.converge()


async def test_redis_stopped_and_started_empty(stack: Stack) -> None:
    for e in stack.engines.values():
        e.traffic(8, seed=34)
    await stack.converge()
    redis_router = next(r for r in stack.routers if r.name == "redis")
    stack.redis.stop()
    for e in stack.engines.values():
        e.traffic(12, seed=35)  # written to the fallback meanwhile, removals included
    await redis_router.daemon.wait_log("kv_index_redis_unavailable", timeout_s=15)
    stack.redis.start()  # same port, nothing in it
    await stack.converge(timeout_s=45)


async def test_sighup_storm_over_valid_and_invalid_files(stack: Stack) -> None:
    good = yaml.safe_dump(stack.listener.config)
    bad = ["", "sources: [\n", yaml.safe_dump({"kv_cache_index": {"event_sources": []}}),
           good.replace("zmq_mode: connect", "zmq_mode: sideways", 1)]
    for i in range(24):
        stack.listener.rewrite(bad[i % len(bad)] if i % 3 else good)
        stack.listener.signal(signal.SIGHUP)
        stack.engines["vllm-1" if i % 2 else "vllm-2"].traffic(2, seed=40 + i)
    stack.listener.rewrite(good)
    stack.listener.signal(signal.SIGHUP)
    await stack.listener.wait_log("config_reloaded", timeout_s=20)
    await stack.converge()
    assert await stack.healthz() == 200
