"""`WaitingRedisCluster`: redis-py's asyncio cluster client whose commands wait for a connection,
as a `BlockingConnectionPool` makes the one-server client wait.

redis-py's asyncio `RedisCluster` opens at most `max_connections` connections per node and, when
a command finds them all busy, raises `MaxConnectionsError` at once (redis/redis-py#3135; redis-py
8.1 has no waiting option for the asyncio cluster client). That error is a `ConnectionError`: the
index took a burst of requests wider than `pool_size` for a lost node (retries, a warning per
burst, an "outage ridden out" that makes every consumer resync), and the client's reconnect
handling then raced with connections being opened (an AttributeError out of redis-py). Here at
most `pool_size` operations are in flight at once, a command or a pipeline's execution, each of
which holds at most one connection per node, so no node is ever asked for more; the others wait
in order, each for at most `wait_s`, then get the `ConnectionError("No connection available.")`
that `BlockingConnectionPool` raises after its timeout. A command the client issues while one of
the same task's operations is in flight (a pipeline's redirected command) goes without waiting:
waiting there could wait for itself.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextvars import ContextVar
from typing import Any

from redis.asyncio.cluster import ClusterPipeline, RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError

#: Set inside an operation's permit, for the task that holds it.
_HOLDING: ContextVar[bool] = ContextVar("kv_listener_redis_permit", default=False)


class WaitingRedisCluster(RedisCluster):
    """`RedisCluster` with `limit(pool_size, wait_s)`: operations wait for one of `pool_size`
    permits (no limit until it is called)."""

    _permits: asyncio.Semaphore | None = None
    _wait_s: float = 0.0

    def limit(self, pool_size: int, wait_s: float) -> None:
        self._permits = asyncio.Semaphore(pool_size)
        self._wait_s = wait_s

    @contextlib.asynccontextmanager
    async def permit(self) -> AsyncIterator[None]:
        permits = self._permits
        if permits is None or _HOLDING.get():
            yield
            return
        try:
            async with asyncio.timeout(self._wait_s):
                await permits.acquire()
        except TimeoutError:
            raise RedisConnectionError("No connection available.") from None
        token = _HOLDING.set(True)
        try:
            yield
        finally:
            _HOLDING.reset(token)
            permits.release()

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        async with self.permit():
            return await super().execute_command(*args, **kwargs)

    def pipeline(self, transaction: Any | None = None, shard_hint: Any | None = None) -> Any:
        if shard_hint:  # what RedisCluster.pipeline refuses, refused the same way
            return super().pipeline(transaction, shard_hint)
        return _WaitingPipeline(self, transaction)  # type: ignore[abstract]  # as redis-py does


class _WaitingPipeline(ClusterPipeline):
    cluster_client: WaitingRedisCluster

    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> Any:
        async with self.cluster_client.permit():
            return await super().execute(raise_on_error, allow_redirections)
