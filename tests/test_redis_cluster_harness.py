"""The local Redis Cluster of tests/support/redis_cluster.py, proved with redis-py's own cluster
client (`redis.asyncio.cluster.RedisCluster`): keys spread over three masters, a failover in the
middle of writes loses no write a replica acknowledged, a slot move is followed through ASK and
MOVED, TLS with an ACL user works and a wrong password is refused, and nothing is left running."""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from pathlib import Path

import pytest
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import (
    AskError,
    AuthenticationError,
    MovedError,
    RedisClusterException,
    RedisError,
)

from kv_listener.configkit import read_secret
from tests.support.redis_cluster import LocalRedisCluster, redis_cluster_fixture, slot_of

redis_cluster = redis_cluster_fixture()


async def client(cluster: LocalRedisCluster, **overrides: object) -> RedisCluster:
    rc = RedisCluster.from_url(cluster.url, decode_responses=True,
                               **(cluster.client_kwargs() | overrides))
    await rc.initialize()
    return rc


async def test_keys_spread_over_three_masters_each_with_a_replica(
    redis_cluster: LocalRedisCluster,
) -> None:
    redis_cluster.flushall()
    masters = redis_cluster.masters()
    assert len(masters) == 3
    ranges = sorted(r for m in masters for r in m.slots)
    assert ranges[0][0] == 0 and ranges[-1][1] == 16383
    assert all(a[1] + 1 == b[0] for a, b in itertools.pairwise(ranges))
    assert sorted(r.master.port for r in redis_cluster.replicas() if r.master) == \
        sorted(m.node.port for m in masters)

    rc = await client(redis_cluster)
    try:
        for i in range(300):
            await rc.set(f"spread:{i}", i)
        for i in range(300):  # the harness and the client agree on who serves a key
            key = f"spread:{i}"
            assert rc.get_node_from_key(key).port == redis_cluster.master_of(key).node.port
    finally:
        await rc.aclose()
    sizes = [redis_cluster.admin(m.node).dbsize() for m in masters]
    assert sum(sizes) == 300 and min(sizes) > 50, sizes


async def test_failover_mid_writes_keeps_every_replicated_write(redis_cluster: LocalRedisCluster) -> None:
    redis_cluster.flushall()
    rc = await client(redis_cluster)
    replicated: dict[str, int] = {}  # acknowledged by the master and by WAIT 1 100
    errors: dict[str, int] = {}
    n = 0
    dead_slots: list[tuple[int, int]] = []  # the killed master's, once it is killed
    into_dead = 0  # writes begun on those slots while the failover was under way

    async def write() -> bool:
        nonlocal n, into_dead
        key, n = f"fo:{n}", n + 1
        if dead_slots and any(a <= slot_of(key) <= b for a, b in dead_slots):
            into_dead += 1
        try:
            await rc.set(key, n)
            # The node that took the SET: asked before it, a slot map from before the promotion
            # named the dead master; the SET refreshed the map and went to the new one.
            node = rc.get_node_from_key(key)
            if await rc.execute_command("WAIT", 1, 100, target_nodes=node) >= 1:
                replicated[key] = n
        except RedisError as exc:
            errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
            return False
        return True

    try:
        for _ in range(100):
            assert await write()
        started = time.monotonic()
        dead_slots.extend(redis_cluster.master_of("fo:0").slots)
        killed = redis_cluster.kill_master_of("fo:0")
        failover = asyncio.create_task(asyncio.to_thread(redis_cluster.wait_failover, killed))
        attempts = 0
        while not failover.done():
            attempts += 1
            assert attempts < 5000, "the write loop outlived the failover wait"
            if not await write():
                await asyncio.sleep(0.02)  # pace the retries of a failed write, not a wait
        promoted = await failover
        failover_s = time.monotonic() - started
        # Reconnected: every write after the failover succeeds (the promoted master has no
        # replica yet, so WAIT says 0 for its keys: those writes are not counted as replicated).
        dead_slots.clear()
        for _ in range(30):
            assert await write(), errors
        await asyncio.to_thread(redis_cluster.restart, killed)
        assert any(r.node is killed and r.master is promoted for r in redis_cluster.replicas())
        lost = [k for k, v in replicated.items() if await rc.get(k) != str(v)]
        assert not lost, f"{len(lost)} replicated writes lost, e.g. {lost[:5]}"
        assert failover_s < 10, failover_s
        # The writer met the failover: writes went to the dead master's slots while it was
        # under way. Whether one failed or redis-py's own retries carried it through to the
        # promoted replica depends on timing (a failed write is paced by 20 ms, a retried one
        # waits inside the client), so neither is asserted: what is, is that nothing was lost.
        assert into_dead, ("the failover was not seen by the writer", errors)
    finally:
        await rc.aclose()


async def test_slot_migration_is_followed_through_ask_and_moved(redis_cluster: LocalRedisCluster) -> None:
    redis_cluster.flushall()
    keys = [f"{{mig}}:{i}" for i in range(40)]  # one hash tag: one slot
    slot = slot_of(keys[0])
    rc = await client(redis_cluster)
    try:
        for i, key in enumerate(keys):
            await rc.set(key, i)
        source = redis_cluster.master_of_slot(slot).node
        target = next(m.node for m in redis_cluster.masters() if m.node is not source)
        migration = redis_cluster.begin_migration(slot, target)
        assert migration.move_keys(limit=20) == 20
        left = redis_cluster.admin(source).execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100)
        moved_key = next(k for k in keys if k not in left)  # EXISTS on the source would say ASK
        with pytest.raises(AskError) as ask:
            redis_cluster.admin(source).get(moved_key)
        assert ask.value.port == target.port
        # One read at a time: concurrent ASK-redirected reads fail inside redis-py 8.1 (AttributeError
        # 'NoneType' has no 'writelines': ASKING and the command go out on different pooled
        # connections); the index must not rely on them. Left for the index work (issue 16).
        values = [await rc.get(k) for k in keys]
        assert values == [str(i) for i in range(len(keys))]
        # Not asserted: a SET of a new key of the migrating slot raised MovedError from the target
        # (ASKING went out on another pooled connection); left for the index work (issue 16).
        migration.finish()
        with pytest.raises(MovedError) as moved:
            redis_cluster.admin(source).get(keys[0])
        assert moved.value.port == target.port
        assert await rc.get(keys[0]) == "0"  # follows MOVED and updates its slot table
        assert rc.get_node_from_key(keys[0]).port == target.port
        assert redis_cluster.master_of_slot(slot).node is target
    finally:
        await rc.aclose()


async def test_tls_and_acl_cluster_accepts_the_user_and_refuses_a_wrong_password(tmp_path: Path) -> None:
    with LocalRedisCluster(tmp_path, tls=True, acl=True) as cluster:
        assert cluster.acl is not None and cluster.url.startswith("rediss://")
        pids = [node.pid for node in cluster.nodes]
        password = read_secret(str(cluster.acl.password_file), None)
        assert password is not None
        rc = await client(cluster, password=password.decode())
        try:
            for i in range(30):
                await rc.set(f"tls:{i}", i)
            assert [await rc.get(f"tls:{i}") for i in range(30)] == [str(i) for i in range(30)]
        finally:
            await rc.aclose()
        with pytest.raises((AuthenticationError, RedisClusterException), match="username-password"):
            await client(cluster, password="wrong")
    for pid in pids:  # stop() left no process behind
        assert pid is not None
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
