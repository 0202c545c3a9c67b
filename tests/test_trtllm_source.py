"""TrtllmSource against a real aiohttp server playing trtllm-serve's /kv_cache_events."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
from array import array
from collections.abc import AsyncIterator
from typing import Any

import pytest
from structlog.testing import capture_logs

from kv_listener.config import SourceConfig
from kv_listener.core import model
from kv_listener.sim.trtllm_server import SimTrtllmServer
from kv_listener.sources.common import PublisherAllowList
from kv_listener.sources.trtllm import (
    AllowListResolver,
    PeerNotAllowed,
    TrtllmSource,
    backoff_delay,
    poll_backoff,
)
from kv_listener.stats import SourceStats
from tests.support.queues import get, get_batch
from tests.support.tasks import running_task

INTERVAL = 0.02


def stored(h: int, parent: int | None = None) -> model.BlockStored:
    return model.BlockStored(block_hashes=(h,), parent_hash=parent, token_ids=array("I", [1, 2]),
                             block_size=2, medium="GPU")


def config(url: str, **overrides: Any) -> SourceConfig:
    base: dict[str, Any] = {
        "backend_name": "trt-1",
        "engine": model.Engine.TRTLLM,
        "model": "m",
        "trtllm_endpoint": url,
        "poll_interval_s": INTERVAL,
        "allowed_publishers": ("127.0.0.1",),
    }
    base.update(overrides)
    return SourceConfig(**base)


@contextlib.asynccontextmanager
async def polling(
    sim: SimTrtllmServer, queue: asyncio.Queue[model.SourceItem], **kwargs: Any
) -> AsyncIterator[TrtllmSource]:
    async with await sim.serve() as server:
        source = TrtllmSource(config(server.url), queue, SourceStats(engine="trtllm"), **kwargs)
        async with running_task(source.run()):
            yield source
        assert not source.stats.ready


async def test_polls_deliver_batches_and_duplicates_are_skipped() -> None:
    sim = SimTrtllmServer()
    queue: asyncio.Queue[model.SourceItem] = asyncio.Queue(100)
    sim.emit(stored(1), stored(2, 1), window_size=4096)  # one `stored` event, two blocks
    sim.emit(model.BlockUpdated(2, "GPU", "HOST"), window_size=4096)
    async with polling(sim, queue) as source:
        first = await get_batch(queue)
        assert first.seq is None and first.dp_rank is None
        assert first.events == (stored(1), stored(2, 1), model.BlockUpdated(2, "GPU", "HOST"))
        assert sim.queued == 0  # drain-on-read
        assert source.is_ready()
        stats = source.stats
        assert stats.ready and stats.last_ok_at is not None and stats.last_event_at is not None
        # A replayed old record (id 1) and a new one (id 2).
        sim.emit_raw({"event_id": 1, "window_size": 4096,
                      "data": {"type": "removed", "block_hashes": [1]}})
        sim.emit(model.BlockRemoved((2,)), window_size=4096)
        second = await get_batch(queue)
    assert second.events == (model.BlockRemoved((2,)),)
    assert stats.events_dropped == {"duplicate_event_id": 1}
    assert stats.events_received == 4
    assert stats.gaps == 0 and not stats.clears and not stats.poll_errors


async def test_attention_dp_rank_becomes_the_batch_rank() -> None:
    sim = SimTrtllmServer()
    queue: asyncio.Queue[model.SourceItem] = asyncio.Queue(100)
    sim.emit(stored(1), dp_rank=0)
    sim.emit(stored(2), dp_rank=1)  # ids are per rank: both are 0
    async with polling(sim, queue) as source:
        a, b = await get_batch(queue), await get_batch(queue)
    assert (a.dp_rank, b.dp_rank) == (0, 1)
    assert source.stats.gaps == 0


async def test_event_id_gap_clears_then_applies() -> None:
    sim = SimTrtllmServer()
    queue: asyncio.Queue[model.SourceItem] = asyncio.Queue(100)
    sim.emit(stored(1))
    async with polling(sim, queue) as source:
        assert (await get_batch(queue)).events == (stored(1),)
        sim.lose(3)  # e.g. another poller drained them
        sim.emit(stored(5))
        cleared, batch = await get(queue), await get_batch(queue)
    assert cleared == model.SourceCleared(model.ClearReason.GAP)
    assert batch.events == (stored(5),)
    assert source.stats.gaps == 1
    assert source.stats.clears == {"gap": 1}


async def test_created_clears_and_restarts_id_tracking() -> None:
    sim = SimTrtllmServer()
    queue: asyncio.Queue[model.SourceItem] = asyncio.Queue(100)
    sim.emit(model.CacheCreated((100, 0)))
    for h in range(1, 6):
        sim.emit(stored(h))
    async with polling(sim, queue) as source:
        assert await get(queue) == model.SourceCleared(model.ClearReason.ENGINE_CLEARED)
        assert len((await get_batch(queue)).events) == 6
        sim.restart()  # trtllm-serve restarted: ids start at 0 with a `created`
        sim.emit(model.CacheCreated((100, 0)))
        sim.emit(stored(9))
        cleared, batch = await get(queue), await get_batch(queue)
    assert cleared == model.SourceCleared(model.ClearReason.ENGINE_CLEARED)
    assert batch.events == (model.CacheCreated((100, 0)), stored(9))
    assert source.stats.clears == {"engine_cleared": 2}
    assert source.stats.gaps == 0 and not source.stats.events_dropped


async def test_only_the_largest_attention_window_is_kept() -> None:
    sim = SimTrtllmServer()
    queue: asyncio.Queue[model.SourceItem] = asyncio.Queue(100)
    sim.emit(model.CacheCreated((10,)), window_size=1024)
    sim.emit(model.CacheCreated((10,)), window_size=32768)
    sim.emit(stored(1), window_size=1024)
    sim.emit(stored(2), window_size=32768)
    async with polling(sim, queue) as source:
        assert await get(queue) == model.SourceCleared(model.ClearReason.ENGINE_CLEARED)
        batch = await get_batch(queue)
        sim.emit(model.BlockRemoved((1,)), window_size=1024)
        sim.emit(model.BlockRemoved((2,)), window_size=32768)
        later = await get_batch(queue)
    assert batch.events == (model.CacheCreated((10,)), stored(2))
    assert later.events == (model.BlockRemoved((2,)),)
    assert source.stats.events_dropped == {"window_not_max": 3}


async def test_redirect_is_refused_and_not_followed() -> None:
    target = SimTrtllmServer()
    target.emit(stored(666))
    sim = SimTrtllmServer()
    queue: asyncio.Queue[model.SourceItem] = asyncio.Queue(100)
    async with await target.serve() as elsewhere:
        sim.fail_next(307, headers={"Location": elsewhere.url})
        sim.emit(stored(1))
        async with polling(sim, queue) as source:
            batch = await get_batch(queue)
    assert batch.events == (stored(1),)
    assert source.stats.poll_errors == {"redirect": 1}
    assert target.polls == 0
    assert target.queued == 1


async def test_errors_back_off_exponentially_are_counted_and_recover() -> None:
    sim = SimTrtllmServer()
    queue: asyncio.Queue[model.SourceItem] = asyncio.Queue(100)
    sim.fail_next(500, b"internal error", times=2)
    sim.fail_next(200, b"<html>not json</html>")
    sim.fail_next(200, b'{"event_id": 1}')  # JSON, not a list
    sim.emit(stored(1))
    with capture_logs() as logs:
        async with polling(sim, queue) as source:
            batch = await get_batch(queue)
            assert source.failures == 0
            assert source.next_delay_s == INTERVAL
    assert batch.events == (stored(1),)
    assert source.stats.poll_errors == {"http_status": 2, "invalid_body": 2}
    # Waits after the 1st..4th failure: 2, 4, 8, 16 intervals (lower bounds are deterministic).
    gaps = [b - a for a, b in zip(sim.poll_times, sim.poll_times[1:], strict=False)][:4]
    for i, gap in enumerate(gaps):
        assert gap >= INTERVAL * 2 ** (i + 1) * 0.9, (i, gap)
    retries = [e["retry_in_s"] for e in logs if e["event"] == "trtllm_poll_failed"]
    assert retries == [round(INTERVAL * 2**k, 3) for k in (1, 2, 3, 4)]
    assert any(e["event"] == "trtllm_poll_recovered" for e in logs)


def test_backoff_delay_is_capped() -> None:
    assert backoff_delay(0.1, 0, 30.0) == 0.1
    assert backoff_delay(0.1, 3, 30.0) == pytest.approx(0.8)
    assert backoff_delay(0.1, 20, 30.0) == 30.0
    assert backoff_delay(0.1, 10_000, 30.0) == 30.0


def test_the_poll_backoff_is_the_shared_backoff_from_twice_the_interval() -> None:
    backoff = poll_backoff(0.1, 1.0)
    assert [backoff.next_delay() for _ in range(6)] == [0.2, 0.4, 0.8, 1.0, 1.0, 1.0]
    assert [backoff_delay(0.1, n, 1.0) for n in range(1, 7)] == [0.2, 0.4, 0.8, 1.0, 1.0, 1.0]
    # A cap under two intervals (engine_down_after / 4 can be that short) is every delay.
    capped = poll_backoff(1.0, 1.5)
    assert [capped.next_delay() for _ in range(3)] == [1.5, 1.5, 1.5]
    assert backoff_delay(1.0, 1, 1.5) == 1.5


async def test_timeout_is_counted_then_polling_recovers() -> None:
    sim = SimTrtllmServer()
    queue: asyncio.Queue[model.SourceItem] = asyncio.Queue(100)
    sim.stall_next(3.0)
    async with polling(sim, queue, request_timeout_s=0.2) as source:
        await source.wait_polls(1)
        assert source.stats.poll_errors == {"timeout": 1}
        assert not source.is_ready()
        sim.emit(stored(4))
        batch = await get_batch(queue)
        assert source.is_ready()
    assert batch.events == (stored(4),)


async def test_connection_errors_are_counted_and_never_fatal() -> None:
    sim = SimTrtllmServer()
    server = await sim.serve()
    url = server.url
    await server.close()  # nothing listens on that port any more
    queue: asyncio.Queue[model.SourceItem] = asyncio.Queue(100)
    source = TrtllmSource(config(url), queue, SourceStats(engine="trtllm"))
    async with running_task(source.run()):
        await source.wait_polls(3)
    assert set(source.stats.poll_errors) == {"connection"}
    assert source.stats.poll_errors["connection"] >= 3
    assert not source.stats.ready and source.stats.last_ok_at is None
    assert not source.is_ready()
    assert queue.empty()


async def test_oversized_body_is_refused() -> None:
    sim = SimTrtllmServer()
    queue: asyncio.Queue[model.SourceItem] = asyncio.Queue(100)
    sim.fail_next(200, json.dumps([{"event_id": i} for i in range(200)]).encode())
    async with polling(sim, queue, max_body_bytes=1024) as source:
        await source.wait_polls(1)
        sim.emit(stored(1))
        await get_batch(queue)
    assert source.stats.poll_errors == {"body_too_large": 1}


def test_url_host_must_be_an_allowed_publisher() -> None:
    queue: asyncio.Queue[model.SourceItem] = asyncio.Queue(10)
    with pytest.raises(ValueError, match="not in allowed_publishers"):
        TrtllmSource(config("http://127.0.0.1:9/kv_cache_events", allowed_publishers=("10.0.0.0/8",)),
                     queue, SourceStats(engine="trtllm"))
    with pytest.raises(ValueError, match="for trtllm"):
        TrtllmSource(config("http://127.0.0.1:9/x", engine=model.Engine.VLLM), queue,
                     SourceStats(engine="vllm"))


async def test_host_name_url_is_checked_against_the_resolved_peer() -> None:
    sim = SimTrtllmServer()
    sim.emit(stored(3))
    queue: asyncio.Queue[model.SourceItem] = asyncio.Queue(10)
    async with await sim.serve() as server:
        url = server.url.replace("127.0.0.1", "localhost")
        source = TrtllmSource(config(url, allowed_publishers=("localhost",)), queue,
                              SourceStats(engine="trtllm"))
        async with running_task(source.run()):
            batch = await get_batch(queue)
    assert batch.events == (stored(3),)
    assert source.stats.refused_publishers == 0


def test_allow_list_matching() -> None:
    allow = PublisherAllowList(["10.1.0.0/16", "192.0.2.7", "::1"])
    assert allow.allows("10.1.200.3")
    assert allow.allows("::ffff:10.1.0.1")  # IPv4-mapped, as a dual-stack socket reports it
    assert allow.allows("192.0.2.7")
    assert allow.allows("[::1]")
    assert not allow.allows("10.2.0.1")
    assert not allow.allows("192.0.2.8")
    assert not allow.allows("")
    assert not allow.allows("not-an-ip")


async def test_resolver_only_returns_allowed_addresses() -> None:
    stats = SourceStats(engine="trtllm")
    refusing = AllowListResolver(PublisherAllowList(["10.0.0.0/8"]), stats)
    admitting = AllowListResolver(PublisherAllowList(["127.0.0.0/8"]), stats)
    try:
        with pytest.raises(PeerNotAllowed):
            await refusing.resolve("localhost", 80)
        assert stats.refused_publishers == 1
        results = await admitting.resolve("localhost", 80)
        assert results and {r["host"] for r in results} == {"127.0.0.1"}
    finally:
        await refusing.close()
        await admitting.close()


async def test_a_refused_connection_is_logged_with_url_and_errno() -> None:
    """`trtllm_poll_failed` said only `ClientConnectorError`: not where, not why."""
    from tests.support.ports import free_port  # noqa: PLC0415

    port = free_port()  # nothing listens there
    queue: asyncio.Queue[model.SourceItem] = asyncio.Queue(100)
    source = TrtllmSource(config(f"http://user:pw@127.0.0.1:{port}/kv_cache_events"), queue,
                          SourceStats(engine="trtllm"))
    with capture_logs() as logs:
        async with running_task(source.run()):
            await source.wait_polls(1)
    failed = [e for e in logs if e["event"] == "trtllm_poll_failed"]
    assert failed, logs
    assert failed[0]["url"] == f"http://127.0.0.1:{port}/kv_cache_events"  # no credentials
    assert failed[0]["errno"] == errno.ECONNREFUSED
    assert failed[0]["detail"] == "ClientConnectorError: Connection refused"
    assert "pw" not in json.dumps(failed)
