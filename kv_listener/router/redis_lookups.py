"""`LookupBatcher`: the Redis index's reads, batched the way a pipelining connection pool batches
("natural batching"), for one Redis server or a Redis Cluster.

A `lookup()` that finds no lookup in flight goes out at once (in a task started for it, so
lookups of the same event-loop tick share its round trip); lookups that arrive while a lookup
round trip is in flight wait for it and then go out together as one pipeline
(`transaction=False`, at most `LOOKUP_BATCH` prefixes; a larger backlog takes several). On a
cluster the pipeline is redis-py's cluster pipeline, which sends each node its prefixes in
parallel: still one round trip per batch. Lookups of one prefix in a window share one round trip,
and each caller gets its own list. A cancelled caller only drops its own answer. A failed round
trip is one failure (one `on_error` call), and every caller of that batch, and of the batches
waiting behind it while `paused` (the wrapper's fallback is active), gets None; a command error of
one prefix (a foreign key of the wrong type) fails only that prefix's callers. The raw replies are
read in either protocol (redis-py 8 speaks RESP3 by default, older versions RESP2).

Reads are `ZREVRANGEBYSCORE <key> +inf -inf WITHSCORES` on both ZSETs (on the GPU one only when
`storage_offloading` is off: such a router never writes a warm holder and its in-memory twin never
reports one, so it does not read them either).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import Any

from kv_listener.core.model import Tier
from kv_listener.router.index import Holder, sort_holders

#: Most prefixes one lookup pipeline carries (2 commands each, 1 without storage offloading):
#: enough for a burst of concurrent requests, small enough that a reply stays well inside one
#: command timeout. A module constant: SPEC §8 names no key for it.
LOOKUP_BATCH = 256

_ALL_WITH_SCORES = (b"+inf", b"-inf", b"WITHSCORES")

#: One prefix's waiting callers: each has its own future, so a cancelled caller cancels only its
#: own. A result of None means "Redis failed" (or was not asked): the wrapper reads its fallback.
_Waiters = list[asyncio.Future[list[Holder] | None]]


def as_str(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _score_rows(rows: Any) -> Any:
    """`(member, score)` pairs of a raw `... WITHSCORES` reply: RESP3 sends them nested (scores
    as doubles), RESP2 flat (scores as strings)."""
    if rows and not isinstance(rows[0], list | tuple):
        return zip(rows[::2], map(float, rows[1::2]), strict=True)
    return rows


def holders_of(hot_rows: Any, warm_rows: Any) -> list[Holder]:
    """Holders from the raw replies of the GPU and the warm ZSET."""
    found: dict[str, Holder] = {}
    for member, score in _score_rows(hot_rows):
        name = as_str(member)
        found[name] = Holder(name, int(score), Tier.GPU_HOT)
    for member, score in _score_rows(warm_rows):
        name = as_str(member)
        # Both ZSETs can name a backend only for a moment between two routers' writes; GPU
        # wins, as it would after the second write.
        if name not in found:
            found[name] = Holder(name, int(score), Tier.STORAGE_WARM)
    return sort_holders(list(found.values()))


def _cancel_all(batch: dict[str, _Waiters]) -> None:
    for waiters in batch.values():
        for fut in waiters:
            fut.cancel()


class LookupBatcher:
    """Batched holder lookups. `hot_key`/`warm_key` are the keys' bytes before and after the
    prefix hash (`(b"cr:kvidx:", b"")`, or `(b"cr:kvidx:{", b"}")` with cluster hash tags);
    `on_error(exc)` hears of each failed round trip (or prefix), `on_success()` of each round
    trip that answered every prefix."""

    def __init__(self, client: Any, *, hot_key: tuple[bytes, bytes], warm_key: tuple[bytes, bytes],
                 warm: bool, on_error: Callable[[BaseException], None],
                 on_success: Callable[[], None], errors: tuple[type[Exception], ...],
                 cluster: bool = False) -> None:
        self.client = client
        self._errors = errors  # what a failed round trip raises (the store's REDIS_ERRORS)
        self._hot, self._warm_key, self._warm = hot_key, warm_key, warm
        self._on_error = on_error
        self._on_success = on_success
        # redis-py's cluster pipeline looks up each command's routing policy by its name as a
        # str; the single-server pipeline takes it pre-encoded.
        self._zrev: str | bytes = "ZREVRANGEBYSCORE" if cluster else b"ZREVRANGEBYSCORE"
        #: While True no lookup round trip is sent: waiting callers get None at once (the
        #: wrapper's fallback serves them; a lone lookup would not go to Redis either).
        self.paused = False
        self.round_trips = 0  # lookup pipelines sent to Redis (this process)
        # Prefixes waiting for the next round trip (insertion order = arrival order), and the
        # task sending them; it runs while there is anything to send, one round trip at a time.
        self._waiting: dict[str, _Waiters] = {}
        self._task: asyncio.Task[None] | None = None

    def lookup(self, prefix_hash: str) -> asyncio.Future[list[Holder] | None]:
        """The holders of `prefix_hash` (a well-formed one) from the next lookup round trip;
        None when it failed or was not sent (`paused`)."""
        fut: asyncio.Future[list[Holder] | None] = asyncio.get_running_loop().create_future()
        waiters = self._waiting.get(prefix_hash)
        if waiters is None:
            self._waiting[prefix_hash] = [fut]
        else:
            waiters.append(fut)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._send())
        return fut

    async def drain(self) -> None:
        """Return once the lookups already waiting are answered (bounded by the timeouts)."""
        if self._task is not None:
            await self._task

    async def _send(self) -> None:
        """Send what is waiting, one round trip at a time, until nothing is. Its own task, so a
        cancelled caller never cancels a round trip other callers wait for."""
        try:
            while self._waiting:
                if len(self._waiting) <= LOOKUP_BATCH:
                    batch, self._waiting = self._waiting, {}
                else:
                    batch = {ph: self._waiting.pop(ph)
                             for ph in list(itertools.islice(self._waiting, LOOKUP_BATCH))}
                await self._batch(batch)
        except BaseException:  # cancelled (loop shutdown): nobody may wait forever
            _cancel_all(self._waiting)
            self._waiting = {}
            raise
        finally:
            self._task = None

    async def _round_trip(self, prefixes: list[str]) -> list[Any]:
        warm = self._warm
        (hot, hot_end), (warm_key, warm_end) = self._hot, self._warm_key
        zrev = self._zrev
        async with self.client.pipeline(transaction=False) as pipe:
            # Raw commands, pre-encoded: no response callback re-shapes the rows (redis-py's
            # re-encodes every RESP3 score to bytes and parses it again), and no argument is
            # encoded per call. `holders_of` reads either protocol's rows.
            for ph in prefixes:
                key = ph.encode()
                pipe.execute_command(zrev, hot + key + hot_end, *_ALL_WITH_SCORES)
                if warm:
                    pipe.execute_command(zrev, warm_key + key + warm_end, *_ALL_WITH_SCORES)
            self.round_trips += 1
            results: list[Any] = await pipe.execute(raise_on_error=False)
            return results

    async def _batch(self, batch: dict[str, _Waiters]) -> None:
        # Prefixes whose every caller was cancelled meanwhile are not looked up.
        prefixes = [ph for ph, waiters in batch.items() if not all(f.done() for f in waiters)]
        if not prefixes:
            return
        results: list[Any] | None = None
        try:
            # The round trip before this one failed: its callers and these read the fallback
            # (a single query does not go to Redis while the fallback is active either).
            if not self.paused:
                results = await self._round_trip(prefixes)
        except self._errors as exc:
            self._on_error(exc)
        except asyncio.CancelledError:
            _cancel_all(batch)
            raise
        except Exception as exc:  # a bug: every caller raises it, as one query would
            for waiters in batch.values():
                for fut in waiters:
                    if not fut.done():
                        fut.set_exception(exc)
            return
        step = 2 if self._warm else 1
        ok = results is not None
        for i, ph in enumerate(prefixes):
            holders = None
            if results is not None:
                hot_rows = results[i * step]
                warm_rows = results[i * step + 1] if self._warm else ()
                failed = next((r for r in (hot_rows, warm_rows) if isinstance(r, Exception)), None)
                if failed is not None:
                    ok = False
                    self._on_error(failed)  # only this prefix's callers miss Redis
                else:
                    holders = holders_of(hot_rows, warm_rows)
            first = True
            for fut in batch[ph]:
                if not fut.done():
                    # Each caller owns its list (callers may sort or extend theirs).
                    fut.set_result(holders if first or holders is None else list(holders))
                    first = False
        if ok:
            self._on_success()
