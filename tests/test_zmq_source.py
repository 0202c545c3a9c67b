"""ZmqSource against SimPublisher over real ZMQ sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
from array import array
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

import pytest
import zmq
import zmq.asyncio
from structlog.testing import capture_logs

from kv_listener.config import SourceConfig
from kv_listener.core.limits import Limits, batch_weight
from kv_listener.core.model import (
    BlockRemoved,
    BlockStored,
    ClearReason,
    Engine,
    EventBatch,
    SourceCleared,
    SourceItem,
)
from kv_listener.sim.encode import encode_sglang_batch, encode_vllm_batch
from kv_listener.sim.publisher import SimPublisher
from kv_listener.sources import zmq as zmq_source_module
from kv_listener.sources.common import QueueFeeder
from kv_listener.sources.zmq import RECEIVE_BUDGET_BYTES, SOCKET_CAP_FACTOR, ZmqSource
from kv_listener.sources.zmq_backlog import recv_future
from kv_listener.stats import SourceStats
from tests.support.queues import get, get_batch
from tests.support.tasks import running_task

TIMEOUT = 5.0


def stored(h: int, parent: int | None = None) -> BlockStored:
    return BlockStored(
        block_hashes=(h,), parent_hash=parent, token_ids=array("I", [1, 2, 3, 4]), block_size=4,
        medium="GPU",
    )


def payload(*hashes: int, version: str = "0.33", dp_rank: int = 0) -> bytes:
    return encode_vllm_batch([stored(h) for h in hashes], ts=1700000000.5, dp_rank=dp_rank,
                             version=version)


def config(**overrides: Any) -> SourceConfig:
    base: dict[str, Any] = {
        "backend_name": "vllm-1",
        "engine": Engine.VLLM,
        "model": "m",
        "zmq_endpoint": "tcp://127.0.0.1:0",
        "zmq_mode": "bind",
        "allowed_publishers": ("127.0.0.1",),
    }
    base.update(overrides)
    return SourceConfig(**base)


class ObservedQueue(asyncio.Queue[SourceItem]):
    """A real bounded asyncio.Queue that also lets a test await each put attempt (accepted or
    refused), so overflow can be tested without sleeping."""

    def __init__(self, maxsize: int) -> None:
        super().__init__(maxsize)
        self.attempts = 0
        self._attempted = asyncio.Condition()

    def put_nowait(self, item: SourceItem) -> None:
        self.attempts += 1
        asyncio.get_running_loop().create_task(self._notify())
        super().put_nowait(item)

    async def _notify(self) -> None:
        async with self._attempted:
            self._attempted.notify_all()

    async def wait_attempts(self, n: int) -> None:
        async with asyncio.timeout(TIMEOUT), self._attempted:
            await self._attempted.wait_for(lambda: self.attempts >= n)


@contextlib.asynccontextmanager
async def running(source: ZmqSource) -> AsyncIterator[asyncio.Task[None]]:
    async with running_task(source.run()) as task:
        ready = asyncio.create_task(source.ready.wait())
        done, _ = await asyncio.wait({task, ready}, timeout=TIMEOUT,
                                     return_when=asyncio.FIRST_COMPLETED)
        if ready not in done:
            ready.cancel()
            if task in done:
                task.result()
            raise TimeoutError("source never became ready")
        yield task
    assert not source.stats.ready


class Connected(NamedTuple):
    pub: SimPublisher
    queue: asyncio.Queue[SourceItem]
    stats: SourceStats
    source: ZmqSource


@contextlib.asynccontextmanager
async def connected(*, replay: bool = False, replay_timeout_s: float = 5.0,
                    max_replay_backlog: int = 4096, tail_probe_s: float = 60.0,
                    receive_budget_bytes: int = RECEIVE_BUDGET_BYTES,
                    publisher: dict[str, Any] | None = None,
                    **overrides: Any) -> AsyncIterator[Connected]:
    """A publisher bound on a free port (with a replay endpoint if `replay`), a vLLM source
    connected to it, ready, subscribed and (with `replay`) past its start-up replay (answered
    empty); the source is stopped (and not ready) when the block ends."""
    opts: dict[str, Any] = {"replay_endpoint": "tcp://127.0.0.1:0"} if replay else {}
    async with SimPublisher("tcp://127.0.0.1:0", mode="bind", **opts, **(publisher or {})) as pub:
        if replay:
            overrides["replay_endpoint"] = pub.replay_endpoint
        queue: asyncio.Queue[SourceItem] = asyncio.Queue(100)
        stats = SourceStats(engine="vllm")
        source = ZmqSource(config(zmq_endpoint=pub.endpoint, zmq_mode="connect", **overrides),
                           queue, stats, replay_timeout_s=replay_timeout_s,
                           max_replay_backlog=max_replay_backlog, tail_probe_s=tail_probe_s,
                           receive_budget_bytes=receive_budget_bytes)
        async with running(source):
            assert stats.ready
            await pub.wait_for_subscriber()
            if replay:
                # The start-up replay answered (empty) before a test publishes: answered later,
                # it would carry the test's batches, or miss the ones of a restarted publisher.
                await pub.wait_for_replay_requests(1)
            yield Connected(pub, queue, stats, source)


def hashes(batch: EventBatch) -> list[int]:
    return [h for e in batch.events if isinstance(e, BlockStored) for h in e.block_hashes]


# --- normal flow ---------------------------------------------------------------------------


async def test_connect_mode_delivers_batches_in_order_with_stats() -> None:
    async with connected() as (pub, queue, stats, _):
        pub.publish(payload(11, 12))
        pub.publish(encode_vllm_batch([BlockRemoved((11,), medium="GPU")], ts=2.0))
        pub.publish(payload(13, version="0.22"))  # legacy array events, same source
        b0, b1, b2 = (await get_batch(queue), await get_batch(queue), await get_batch(queue))
    assert [b.seq for b in (b0, b1, b2)] == [0, 1, 2]
    assert hashes(b0) == [11, 12]
    assert b1.events == (BlockRemoved((11,), medium="GPU"),)
    assert hashes(b2) == [13]
    assert b0.dp_rank == 0
    assert stats.batches_received == 3
    assert stats.events_received == 4
    assert stats.events_decoded == 4
    assert stats.last_event_at is not None
    assert stats.gaps == 0 and not stats.clears
    assert queue.empty()


async def test_bind_mode_with_topic_filter_and_sglang() -> None:
    queue: asyncio.Queue[SourceItem] = asyncio.Queue(100)
    stats = SourceStats(engine="sglang")
    source = ZmqSource(config(engine=Engine.SGLANG, zmq_topic="kv@pod-1"), queue, stats)
    async with running(source):
        assert source.endpoint is not None
        assert source.endpoint.startswith("tcp://127.0.0.1:")
        assert not source.endpoint.endswith(":0")
        async with SimPublisher(source.endpoint, mode="connect", topic="kv@pod-1@model") as pub:
            await pub.wait_for_subscriber()
            # The SUB's topic filter (a byte prefix) reached the publisher.
            assert pub.subscriptions == [b"\x01kv@pod-1"]
            batch = encode_sglang_batch(
                [BlockStored((2**64 - 5,), None, array("I", [1, 2]), 2, medium="GPU")], ts=1.0
            )
            pub.publish(batch)
            got = await get_batch(queue)
    assert hashes(got) == [2**64 - 5]  # signed int64 on the wire, u64 in the model
    assert stats.batches_received == 1


async def test_cancel_closes_sockets_and_frees_the_bound_port() -> None:
    queue: asyncio.Queue[SourceItem] = asyncio.Queue(10)
    first = ZmqSource(config(), queue, SourceStats(engine="vllm"))
    async with running(first):
        endpoint = first.endpoint
    assert endpoint is not None
    second = ZmqSource(config(zmq_endpoint=endpoint), queue, SourceStats(engine="vllm"))
    async with running(second):
        assert second.endpoint == endpoint


def test_constructor_rejects_a_non_zmq_source() -> None:
    queue: asyncio.Queue[SourceItem] = asyncio.Queue(10)
    with pytest.raises(ValueError, match="vllm/sglang"):
        ZmqSource(config(engine=Engine.TRTLLM), queue, SourceStats(engine="trtllm"))
    with pytest.raises(ValueError, match="zmq_endpoint"):
        ZmqSource(config(zmq_endpoint=None), queue, SourceStats(engine="vllm"))


# --- gaps, replay, restart -----------------------------------------------------------------


@pytest.mark.parametrize("layout", ["topic", "no_topic"])
@pytest.mark.parametrize("mode", ["connect", "bind"])
async def test_gap_is_filled_by_replay_in_order(layout: str, mode: str) -> None:
    async with SimPublisher("tcp://127.0.0.1:0", mode="bind", replay_endpoint="tcp://127.0.0.1:0",
                            replay_layout=layout, topic="kv-events") as pub:  # type: ignore[arg-type]
        queue: asyncio.Queue[SourceItem] = asyncio.Queue(100)
        stats = SourceStats(engine="vllm")
        cfg = config(replay_endpoint=pub.replay_endpoint, zmq_mode=mode,
                     zmq_endpoint=pub.endpoint if mode == "connect" else "tcp://127.0.0.1:0")
        source = ZmqSource(cfg, queue, stats, tail_probe_s=60.0)  # no probe in this test
        async with running(source):
            if mode == "bind":
                assert source.endpoint is not None
                pub.connect(source.endpoint)
            await pub.wait_for_subscriber()
            # the start-up replay first (answered empty): else it can carry all five batches
            await pub.wait_for_replay_requests(1)
            pub.publish(payload(100))
            pub.drop_next(2)  # lost on the wire, kept in the replay buffer
            pub.publish(payload(101))
            pub.publish(payload(102))
            pub.publish(payload(103))  # reveals the gap
            pub.publish(payload(104))
            got = [await get_batch(queue) for _ in range(5)]
        assert [b.seq for b in got] == [0, 1, 2, 3, 4]
        assert [hashes(b) for b in got] == [[100], [101], [102], [103], [104]]
        assert pub.replay_requests == [0, 1]  # the start-up replay, then the gap
        assert (stats.gaps, stats.replays, stats.replay_failures) == (1, 1, 0)
        assert not stats.clears
        assert queue.empty()


async def test_after_engine_down_the_stream_is_rebuilt_from_the_replay_buffer() -> None:
    # The liveness watch declared the engine down (a network cut: the engine kept running and
    # publishing); the source was cleared. What comes next is rebuilt from seq 0 by replay.
    async with connected(replay=True) as (pub, queue, stats, source):
        pub.publish(payload(100))
        assert hashes(await get_batch(queue)) == [100]
        source.expect_new_stream()
        pub.publish(payload(101))  # seq 1: the batches from seq 0 are replayed first
        got = [await get_batch(queue) for _ in range(2)]
    assert [(b.seq, hashes(b)) for b in got] == [(0, [100]), (1, [101])]
    assert pub.replay_requests == [0, 0]  # the start-up replay, then the rebuild
    assert not stats.clears


async def test_gap_without_replay_clears_then_applies_the_revealing_batch() -> None:
    async with connected() as (pub, queue, stats, _):
        pub.publish(payload(1))
        pub.drop_next(2)
        pub.publish(payload(2))
        pub.publish(payload(3))
        pub.publish(payload(4))
        items = [await get(queue) for _ in range(3)]
    assert isinstance(items[0], EventBatch) and items[0].seq == 0
    assert items[1] == SourceCleared(ClearReason.GAP)
    assert isinstance(items[2], EventBatch) and items[2].seq == 3 and hashes(items[2]) == [4]
    assert (stats.gaps, stats.replays, stats.replay_failures) == (1, 0, 0)
    assert stats.clears == {"gap": 1}


async def test_replay_that_starts_above_the_requested_seq_clears() -> None:
    async with connected(replay=True, publisher={"buffer_steps": 2}) as (pub, queue, stats, _):
        pub.publish(payload(1))
        pub.drop_next(3)
        for h in (2, 3, 4):
            pub.publish(payload(h))  # buffer keeps only the last 2: seqs 2, 3
        pub.publish(payload(5))  # seq 4 reveals the gap 1..3
        items = [await get(queue) for _ in range(3)]
    assert pub.replay_requests == [0, 1]  # the start-up replay, then the gap
    assert [type(i).__name__ for i in items] == ["EventBatch", "SourceCleared", "EventBatch"]
    assert items[1] == SourceCleared(ClearReason.GAP)
    assert isinstance(items[2], EventBatch) and hashes(items[2]) == [5]
    assert (stats.gaps, stats.replays, stats.replay_failures) == (1, 0, 1)


async def test_replay_timeout_clears_keeps_live_batches_and_recovers() -> None:
    async with connected(replay=True, replay_timeout_s=0.5,
                         publisher={"replay_layout": "no_topic"}) as (pub, queue, stats, _):
        pub.replay_enabled = False  # a hung engine: requests are read, never answered
        pub.publish(payload(1))
        pub.drop_next(1)
        pub.publish(payload(2))
        pub.publish(payload(3))  # reveals the gap
        pub.publish(payload(4))  # arrive while the replay waits: kept, applied after
        pub.publish(payload(5))
        items = [await get(queue) for _ in range(5)]
        assert [type(i).__name__ for i in items] == [
            "EventBatch", "SourceCleared", "EventBatch", "EventBatch", "EventBatch"]
        assert [hashes(i) for i in items if isinstance(i, EventBatch)] == [[1], [3], [4], [5]]
        assert stats.replay_failures == 1
        # The abandoned DEALER was replaced: the next gap is replayed normally.
        pub.replay_enabled = True
        pub.drop_next(1)
        pub.publish(payload(6))
        pub.publish(payload(7))
        after = [await get_batch(queue) for _ in range(2)]
    assert [hashes(b) for b in after] == [[6], [7]]
    assert pub.replay_requests == [0, 1, 5]  # the start-up replay, then the gaps
    assert (stats.gaps, stats.replays, stats.replay_failures) == (2, 1, 1)


def wide(h: int) -> bytes:
    """A batch of 100 one-block chains (about 2 KiB); every `h` of 1-65 gives the same size."""
    return payload(*range(1000 * h, 1000 * h + 100))


@pytest.mark.parametrize("bound", ["count", "bytes"])
async def test_batches_lost_beyond_the_replay_backlog_are_noticed_without_a_later_batch(
        bound: str) -> None:
    # Live batches beyond max_replay_backlog, or beyond the receive budget in bytes, during a
    # replay are dropped. The engine then goes quiet: no later batch will show the gap they
    # leave, so the backlog must end with the newest batch seen, whose seq shows it (else
    # batches 5 and 6 are missing with no clear, for good). Before 2026-12-05 the backlog was
    # bounded in count only: 4,096 frames of up to 16 MiB each.
    size = len(wide(1))
    limit = {"max_replay_backlog": 2} if bound == "count" else {"receive_budget_bytes": size * 5 // 2}
    async with connected(replay=True, replay_timeout_s=0.3, **limit,
                         publisher={"replay_layout": "no_topic"}) as (pub, queue, stats, _):
        pub.replay_enabled = False  # a hung engine: each replay times out and clears
        pub.publish(wide(1))
        pub.drop_next(1)
        pub.publish(wide(2))  # seq 1, lost on the wire
        pub.publish(wide(3))  # seq 2 reveals the gap: a replay starts
        await pub.wait_for_replay_requests(2)  # the start-up replay, then this one
        for h in (4, 5, 6, 7):
            pub.publish(wide(h))  # seqs 3-6 during the replay: a backlog of 2 keeps 3, 6
        items = [await get(queue) for _ in range(6)]
    assert [i.seq if isinstance(i, EventBatch) else i for i in items] == [
        0, SourceCleared(ClearReason.GAP), 2, 3, SourceCleared(ClearReason.GAP), 6]
    assert stats.events_dropped == {"replay_backlog_overflow": 2}
    assert (stats.gaps, stats.replay_failures) == (2, 2)
    assert stats.clears == {"gap": 2}


@pytest.mark.parametrize("max_message_bytes", [8 << 20, 64 << 10])
async def test_the_sub_socket_queues_at_most_the_receive_budget(max_message_bytes: int) -> None:
    # libzmq's receive queue counts messages, not bytes. At its former 100,000 frames of up to
    # twice max_message_bytes, a burst of big legal batches took the daemon far past its stated
    # memory bound (bench/hostile.py: 120 frames of 3.7 MiB, peak 464 MiB over idle). A burst
    # longer than the queue waits in the publisher's instead: no loss.
    async with connected(limits=Limits(max_message_bytes=max_message_bytes)) as (
            pub, queue, stats, source):
        sub = source.socket
        assert sub is not None
        cap = SOCKET_CAP_FACTOR * max_message_bytes
        assert sub.maxmsgsize == cap
        assert sub.rcvhwm * cap <= max(RECEIVE_BUDGET_BYTES, 4 * cap)
        assert sub.rcvhwm >= max(4, RECEIVE_BUDGET_BYTES // cap)  # not smaller than it must be
        for h in range(1, 61):
            pub.publish(wide(h))
        got = [await get_batch(queue) for _ in range(60)]
    assert [b.seq for b in got] == list(range(60))
    assert (stats.gaps, stats.events_dropped) == (0, {})




@pytest.mark.parametrize("max_message_bytes", [8 << 20, 64 << 10])
async def test_the_replay_dealer_queues_at_most_the_receive_budget(max_message_bytes: int) -> None:
    # libzmq's default receive queue, 1,000 frames of up to the socket cap (16 GiB with 8 MiB
    # messages), was outside any stated bound. Now the budget or one frame; what does not fit
    # waits in the engine's ROUTER (vLLM 0.33 sizes it to its buffer, as this publisher does)
    # or is dropped there (vLLM 0.32: a hole, asked again; tests/engines/test_vllm_replay.py).
    async with connected(replay=True, limits=Limits(max_message_bytes=max_message_bytes)) as (
            pub, queue, stats, source):
        dealer = source._dealer  # the socket under test
        assert dealer is not None
        cap = SOCKET_CAP_FACTOR * max_message_bytes
        assert dealer.maxmsgsize == cap
        assert dealer.rcvhwm * cap <= max(RECEIVE_BUDGET_BYTES, cap)
        assert dealer.rcvhwm >= max(1, RECEIVE_BUDGET_BYTES // cap)  # not smaller than it must be
        pub.publish(payload(1))
        assert (await get_batch(queue)).seq == 0
        pub.drop_next(150)
        for h in range(2, 153):
            pub.publish(payload(h))  # seqs 1-150 lost on the wire, 151 reveals the gap
        got = [await get_batch(queue) for _ in range(151)]
    assert [b.seq for b in got] == list(range(1, 152))
    assert (stats.gaps, stats.replay_failures, stats.clears, stats.events_dropped) == (1, 0, {}, {})


def late_source(pub: SimPublisher, queue_size: int = 100, **kw: Any,
                ) -> tuple[asyncio.Queue[SourceItem], SourceStats, ZmqSource]:
    """A vLLM source of `pub` started after it published (its batches are in the replay buffer
    only): its queue, its stats and the source, not running yet."""
    queue: asyncio.Queue[SourceItem] = asyncio.Queue(queue_size)
    stats = SourceStats(engine="vllm")
    cfg = config(replay_endpoint=pub.replay_endpoint, zmq_mode="connect",
                 zmq_endpoint=pub.endpoint)
    return queue, stats, ZmqSource(cfg, queue, stats, tail_probe_s=60.0, **kw)


async def test_a_start_up_replay_larger_than_the_budget_comes_in_rounds() -> None:
    # The engine's whole buffer (vLLM: 10,000 batches of up to max_message_bytes) was held at
    # once before it was applied. Now a request stops at the receive budget (2 of these batches),
    # applies them and asks again from where it stopped: the same exact state, in order.
    size = len(wide(1))
    async with SimPublisher("tcp://127.0.0.1:0", mode="bind",
                            replay_endpoint="tcp://127.0.0.1:0") as pub:
        for h in range(1, 8):
            pub.publish(wide(h))  # seqs 0-6, before any listener: in the replay buffer only
        queue, stats, source = late_source(pub, receive_budget_bytes=size * 5 // 2)
        async with running(source):
            got = [await get_batch(queue) for _ in range(7)]
            await pub.wait_for_replay_requests(5)
            assert pub.replay_requests == [0, 2, 4, 6, 7]  # the last one: nothing follows
            pub.publish(wide(8))  # the live stream goes on in order
            got.append(await get_batch(queue))
    assert [b.seq for b in got] == list(range(8))
    assert [hashes(b)[0] for b in got] == [1000 * h for h in range(1, 9)]
    assert (stats.startup_replay, stats.startup_replay_batches) == ("exact", 7)
    assert not stats.clears and stats.gaps == 0


@pytest.mark.parametrize(("batches", "cut", "queue_size", "requests"), [
    # vLLM 0.32's ROUTER drops what its queue toward our DEALER cannot take, and its small end
    # marker can get through after a dropped tail (found with the real publisher: 5,500 of
    # 10,000 batches, reported exact). An answer that ended complete is now followed by a
    # request from where it stopped, until one brings nothing.
    pytest.param(10, 6, 100, [0, 6, 10], id="tail-dropped"),
    # The replay's answer is in hand: before, it went on the queue like live batches, so an
    # engine buffer longer than the queue (vLLM keeps 10,000 batches; the queue holds 10,000 or
    # 4 Mi tokens) overflowed it and the overflow clear wiped what the replay had rebuilt. Now
    # the source waits for the consumer: every batch, in order, nothing dropped, no clear.
    pytest.param(40, None, 8, [0, 40], id="longer-than-the-queue"),
])
async def test_a_start_up_replay_rebuilds_the_whole_buffer(
    batches: int, cut: int | None, queue_size: int, requests: list[int],
) -> None:
    async with SimPublisher("tcp://127.0.0.1:0", mode="bind",
                            replay_endpoint="tcp://127.0.0.1:0") as pub:
        for h in range(1, batches + 1):
            pub.publish(payload(h))  # seqs 0 .. batches - 1, in the replay buffer only
        pub.cut_next_replay = cut  # the first answer: that many batches, then the end marker
        queue, stats, source = late_source(pub, queue_size=queue_size)
        async with running(source):
            got = [await get_batch(queue) for _ in range(batches)]
            await pub.wait_for_replay_requests(len(requests))
            assert pub.replay_requests == requests  # the last one brought nothing: done
            pub.publish(payload(batches + 1))  # the live stream goes on in order
            got.append(await get_batch(queue))
    assert [b.seq for b in got] == list(range(batches + 1))
    assert [hashes(b) for b in got] == [[h] for h in range(1, batches + 2)]
    assert (stats.startup_replay, stats.startup_replay_batches) == ("exact", batches)
    assert not stats.clears and not stats.events_dropped and stats.gaps == 0


async def test_a_gap_larger_than_the_budget_is_filled_in_rounds() -> None:
    # A gap whose batches exceed the receive budget (here 2.5 of them) was cleared (incomplete),
    # and so was one whose answer had a hole (vLLM 0.32's ROUTER drops what the queue toward
    # the DEALER cannot take): each request is cut there, its run applied, the rest asked for.
    size = len(wide(1))
    async with connected(replay=True, receive_budget_bytes=size * 5 // 2) as (pub, queue, stats, _):
        pub.publish(wide(1))
        assert (await get_batch(queue)).seq == 0
        pub.drop_next(4)
        for h in (2, 3, 4, 5, 6):
            pub.publish(wide(h))  # seqs 1-4 lost, 5 reveals the gap
        got = [await get_batch(queue) for _ in range(5)]
        assert pub.replay_requests == [0, 1, 3]
    assert [b.seq for b in got] == [1, 2, 3, 4, 5]
    assert [hashes(b)[0] for b in got] == [1000 * h for h in range(2, 7)]
    assert (stats.gaps, stats.replay_failures, stats.clears) == (1, 0, {})


async def test_a_gap_fill_whose_tail_was_dropped_asks_for_the_rest() -> None:
    # vLLM 0.32's ROUTER can drop the tail of an answer and still deliver its end marker: the
    # answer looks complete but stops short of the batch that revealed the gap. It was cleared
    # (incomplete); now the rest is asked for, as after a hole.
    async with connected(replay=True) as (pub, queue, stats, _):
        pub.publish(payload(1))
        assert (await get_batch(queue)).seq == 0
        pub.drop_next(4)
        pub.cut_next_replay = 2  # the gap's answer: seqs 1-2, then the end marker
        for h in (2, 3, 4, 5, 6):
            pub.publish(payload(h))  # seqs 1-4 lost, 5 reveals the gap
        got = [await get_batch(queue) for _ in range(5)]
        assert pub.replay_requests == [0, 1, 3]
    assert [(b.seq, hashes(b)) for b in got] == [(s, [s + 1]) for s in range(1, 6)]
    assert (stats.gaps, stats.replay_failures, stats.clears) == (1, 0, {})


async def test_batches_lost_right_before_the_engine_went_quiet_come_from_its_replay() -> None:
    # The last two batches were lost on the wire (a high-water mark, a reconnect) and the engine
    # then publishes nothing: no later seq shows the gap. After tail_probe_s of silence the
    # source asks the replay buffer once for what follows its last batch.
    async with connected(replay=True, tail_probe_s=0.2) as (pub, queue, stats, _):
        pub.publish(payload(1))
        assert (await get_batch(queue)).seq == 0
        pub.drop_next(2)
        pub.publish(payload(2))
        pub.publish(payload(3))
        got = [await get_batch(queue) for _ in range(2)]
        assert [(b.seq, hashes(b)) for b in got] == [(1, [2]), (2, [3])]
        # the stream goes on from there: the next batch is in order, not a restart
        pub.publish(payload(4))
        assert (await get_batch(queue)).seq == 3
        # after the start-up replay (from 0): the probe, then what follows its run (nothing)
        assert pub.replay_requests[1:3] == [1, 3]
        assert (stats.gaps, stats.replays) == (1, 1) and not stats.clears
        assert not stats.clears and queue.empty()


async def requested(pub: SimPublisher, start: int) -> None:
    """Until the publisher got a replay request from `start` (bounded)."""
    async with asyncio.timeout(TIMEOUT):
        while start not in pub.replay_requests:
            await pub.wait_for_replay_requests(len(pub.replay_requests) + 1)


async def test_a_message_already_queued_never_overtakes_a_pending_receive() -> None:
    """The hot path takes a queued message through the SUB's sync shadow, without a Future; a
    receive left pending (a tail probe's wait, a replay's) has the next message already, and
    must give it first: the sync path must not hand out the one after it."""
    async with SimPublisher("tcp://127.0.0.1:0", mode="bind") as pub:
        source = ZmqSource(config(zmq_endpoint=pub.endpoint, zmq_mode="connect"),
                           asyncio.Queue(100), SourceStats(engine="vllm"))
        ctx = zmq.asyncio.Context()
        sub = ctx.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(pub.endpoint)
            await pub.wait_for_subscriber()
            now: zmq.Socket[bytes] = zmq.Socket.shadow(sub.underlying)
            source._live_fut = recv_future(sub)  # left pending, as a probe's wait leaves it
            pub.publish(payload(1))
            pub.publish(payload(2))
            await asyncio.wait_for(asyncio.shield(source._live_fut), TIMEOUT)  # has seq 0
            assert now.poll(int(TIMEOUT * 1000), zmq.POLLIN)  # and seq 1 is queued behind it
            got = [await source._next_live(sub, now) for _ in range(2)]
            assert [int.from_bytes(frames[1], "big") for frames in got if frames] == [0, 1]
            assert source._live_fut is None
        finally:
            sub.close(linger=0)
            ctx.destroy(linger=0)


async def test_a_quiet_engine_that_lost_nothing_is_asked_once_per_silence() -> None:
    async with connected(replay=True, tail_probe_s=0.1) as (pub, queue, stats, _):
        pub.publish(payload(1))
        assert (await get_batch(queue)).seq == 0
        await requested(pub, 1)  # the probe, answered with nothing after seq 0
        pub.publish(payload(2))
        assert (await get_batch(queue)).seq == 1
        await requested(pub, 2)  # a new silence, a new probe
        assert pub.replay_requests.count(1) == 1  # not one per tail_probe_s
        assert (stats.gaps, stats.replays, stats.replay_failures) == (0, 0, 0)
        assert not stats.clears and queue.empty()


async def test_a_source_cleared_for_a_new_stream_does_not_probe_the_old_one() -> None:
    # After engine_down the source is cleared and expects a new stream (rebuilt from seq 0 at
    # its next batch). A probe meanwhile would apply the old stream's tail onto the cleared state.
    async with connected(replay=True, tail_probe_s=0.05) as (pub, queue, stats, source):
        pub.publish(payload(1))
        assert (await get_batch(queue)).seq == 0
        source.expect_new_stream()
        pub.drop_next(1)
        pub.publish(payload(2))  # seq 1: lost on the wire, in the replay buffer
        with pytest.raises(TimeoutError):  # ten probe periods without a request
            await pub.wait_for_replay_requests(2, timeout_s=0.5)
        pub.publish(payload(3))  # seq 2: the stream is rebuilt from seq 0
        got = [await get_batch(queue) for _ in range(3)]
    assert [(b.seq, hashes(b)) for b in got] == [(0, [1]), (1, [2]), (2, [3])]
    assert pub.replay_requests == [0, 0]
    assert not stats.clears


async def test_a_probe_finding_the_buffer_moved_on_clears_then_applies_what_it_holds() -> None:
    async with connected(replay=True, tail_probe_s=0.2,
                         publisher={"buffer_steps": 2}) as (pub, queue, stats, _):
        pub.publish(payload(1))
        assert (await get_batch(queue)).seq == 0
        pub.drop_next(3)
        for h in (2, 3, 4):
            pub.publish(payload(h))  # seqs 1-3 lost; the buffer keeps only the last 2: 2, 3
        items = [await get(queue) for _ in range(3)]
        pub.publish(payload(5))  # handled once the probe is done (its follow-up request too)
        items.append(await get(queue))
    assert items[0] == SourceCleared(ClearReason.GAP)
    assert [(b.seq, hashes(b)) for b in items[1:] if isinstance(b, EventBatch)] == [
        (2, [3]), (3, [4]), (4, [5])]
    assert stats.clears == {"gap": 1} and stats.gaps == 1


async def test_engine_restart_clears_then_applies_the_new_batch() -> None:
    async with connected(replay=True) as (pub, queue, stats, _):
        for h in (1, 2, 3):
            pub.publish(payload(h))
        pub.restart()
        pub.publish(payload(9))
        pub.publish(payload(10))
        items = [await get(queue) for _ in range(6)]
    assert items[3] == SourceCleared(ClearReason.ENGINE_RESTART)
    batches = [i for i in items if isinstance(i, EventBatch)]
    assert [(b.seq, hashes(b)) for b in batches] == [(0, [1]), (1, [2]), (2, [3]), (0, [9]), (1, [10])]
    assert stats.clears == {"engine_restart": 1}
    assert stats.gaps == 0


# --- malformed input -----------------------------------------------------------------------


async def test_malformed_messages_are_counted_and_skipped() -> None:
    async with connected() as (pub, queue, stats, _):
        pub.publish(payload(1))  # seq 0
        pub.send_raw([b"", (1).to_bytes(8, "big")])  # 2 frames
        pub.send_raw([b"", (1).to_bytes(8, "big"), b"x", b"y"])  # 4 frames
        pub.send_raw([b"", b"\x00\x01", payload(7)])  # 2-byte seq
        pub.publish(b"\xc1")  # seq 1: not msgpack
        pub.publish(b"\x91\x01")  # seq 2: msgpack, not a batch
        pub.publish(payload(2))  # seq 3: still in sequence
        first, got = await get_batch(queue), await get_batch(queue)
    assert (first.seq, hashes(first)) == (0, [1])
    assert (got.seq, hashes(got)) == (3, [2])
    assert stats.events_dropped == {
        "bad_frame_count": 2, "bad_seq": 1, "invalid_msgpack": 1,
        "malformed_batch": 1,
    }
    assert stats.gaps == 0 and not stats.clears
    assert stats.batches_received == 4  # seq 0, 1, 2, 3
    assert queue.empty()


async def test_a_publisher_restarted_after_one_batch_clears_and_applies_its_batch() -> None:
    # A real vLLM that sent exactly one batch (seq 0), restarted and sent seq 0 again: the second
    # batch is the new engine's, not a duplicate (issue #10; PUB/SUB never duplicates).
    async with connected() as (pub, queue, stats, _):
        pub.publish(payload(1))  # seq 0
        pub.send_raw([b"", (0).to_bytes(8, "big"), payload(8)])  # the new engine's seq 0
        first = await get_batch(queue)
        cleared = await get(queue)
        second = await get_batch(queue)
    assert (first.seq, hashes(first)) == (0, [1])
    assert cleared == SourceCleared(ClearReason.ENGINE_RESTART)
    assert (second.seq, hashes(second)) == (0, [8])
    assert not stats.events_dropped


async def test_a_message_over_max_message_bytes_is_dropped_and_counted() -> None:
    # issue #11, finding 3: one giant frame took RSS to 545 MiB while it was decoded
    async with connected(limits=Limits(max_message_bytes=4096)) as (pub, queue, stats, _):
        pub.publish(payload(1))  # seq 0
        big = BlockStored(block_hashes=(2,), parent_hash=None,
                          token_ids=array("I", [70000] * 1200), block_size=1200, medium="GPU")
        big_payload = encode_vllm_batch([big], ts=1.0)
        assert 4096 < len(big_payload) < 2 * 4096  # under the socket's cap
        pub.publish(big_payload)  # seq 1
        pub.publish(payload(3))  # seq 2
        got = [await get_batch(queue), await get_batch(queue)]
    assert [(b.seq, hashes(b)) for b in got] == [(0, [1]), (2, [3])]
    assert stats.events_dropped == {"message_too_large": 1}
    assert stats.gaps == 0


@pytest.mark.parametrize("mode", ["connect", "bind"])
async def test_a_frame_over_the_socket_cap_costs_the_connection_not_the_source(mode: str) -> None:
    # issue #11, finding 3: ZMQ_MAXMSGSIZE (twice max_message_bytes) keeps libzmq from reading a
    # giant frame whole; it drops the connection instead, and libzmq never reconnects a
    # connecting SUB after that (a protocol error): the source must connect again itself.
    limits = Limits(max_message_bytes=4096)
    big = BlockStored(block_hashes=(2,), parent_hash=None,
                      token_ids=array("I", [70000] * 4000), block_size=4000, medium="GPU")
    big_payload = encode_vllm_batch([big], ts=1.0)
    assert len(big_payload) > 2 * limits.max_message_bytes
    queue: asyncio.Queue[SourceItem] = asyncio.Queue(100)
    stats = SourceStats(engine="vllm")
    if mode == "connect":
        pub = SimPublisher("tcp://127.0.0.1:0", mode="bind")
        await pub.start()
        source = ZmqSource(config(zmq_endpoint=pub.endpoint, zmq_mode="connect", limits=limits),
                           queue, stats)
    else:
        source = ZmqSource(config(limits=limits), queue, stats)
    try:
        async with running(source):
            if mode == "bind":
                assert source.endpoint is not None
                pub = SimPublisher(source.endpoint, mode="connect")
                await pub.start()
            await pub.wait_for_subscriber()
            pub.publish(payload(1))  # seq 0
            first = await get_batch(queue)
            pub.publish(big_payload)  # seq 1: refused by libzmq, the connection dropped
            await pub.wait_for_subscriber(count=2)  # subscribed again on a new connection
            pub.publish(payload(3))  # seq 2
            cleared = await get(queue)
            after = await get_batch(queue)
    finally:
        await pub.close()
    assert (first.seq, hashes(first)) == (0, [1])
    assert cleared == SourceCleared(ClearReason.GAP)  # seq 1 never seen: a resync, not a hole
    assert (after.seq, hashes(after)) == (2, [3])
    assert stats.zmq_disconnects == 1
    assert stats.gaps == 1


# --- allowed publishers (ZAP) --------------------------------------------------------------


async def test_refused_publisher_delivers_nothing_and_is_logged_once() -> None:
    queue: asyncio.Queue[SourceItem] = asyncio.Queue(100)
    stats = SourceStats(engine="vllm")
    source = ZmqSource(config(allowed_publishers=("127.0.0.2",)), queue, stats)
    with capture_logs() as logs:
        async with running(source):
            assert source.endpoint is not None
            port = source.endpoint.rsplit(":", 1)[1]
            async with (
                SimPublisher(source.endpoint, mode="connect") as refused,
                SimPublisher(f"tcp://127.0.0.2:0;127.0.0.1:{port}", mode="connect") as allowed,
            ):
                async with asyncio.timeout(TIMEOUT):
                    await source.peer_refused.wait()
                    source.peer_refused.clear()
                async with SimPublisher(source.endpoint, mode="connect"):
                    async with asyncio.timeout(TIMEOUT):
                        await source.peer_refused.wait()  # the second 127.0.0.1 peer
                await allowed.wait_for_subscriber()
                refused.publish(payload(666))
                allowed.publish(payload(1))
                got = await get_batch(queue)
                # The refused publisher never got a subscription: it sent nothing.
                assert refused.subscriptions == []
    assert hashes(got) == [1]
    assert queue.empty()
    assert stats.refused_publishers >= 2
    refusals = [e for e in logs if e["event"] == "zmq_publisher_refused"]
    assert [e["peer"] for e in refusals] == ["127.0.0.1"]


async def test_cidr_entry_admits_the_publisher() -> None:
    queue: asyncio.Queue[SourceItem] = asyncio.Queue(100)
    stats = SourceStats(engine="vllm")
    source = ZmqSource(config(allowed_publishers=("10.0.0.0/8", "127.0.0.0/8")), queue, stats)
    async with running(source):
        assert source.endpoint is not None
        async with SimPublisher(source.endpoint, mode="connect") as pub:
            await pub.wait_for_subscriber()
            pub.publish(payload(5))
            got = await get_batch(queue)
    assert hashes(got) == [5]
    assert stats.refused_publishers == 0


async def test_host_name_entry_admits_the_publisher() -> None:
    queue: asyncio.Queue[SourceItem] = asyncio.Queue(100)
    stats = SourceStats(engine="vllm")
    source = ZmqSource(config(allowed_publishers=("localhost",)), queue, stats)
    async with running(source):
        assert source.endpoint is not None
        async with SimPublisher(source.endpoint, mode="connect") as pub:
            await pub.wait_for_subscriber()
            pub.publish(payload(6))
            assert hashes(await get_batch(queue)) == [6]


async def test_two_sources_in_one_process_each_enforce_their_own_list() -> None:
    q_open: asyncio.Queue[SourceItem] = asyncio.Queue(10)
    q_closed: asyncio.Queue[SourceItem] = asyncio.Queue(10)
    open_src = ZmqSource(config(backend_name="a"), q_open, SourceStats(engine="vllm"))
    closed_src = ZmqSource(config(backend_name="b", allowed_publishers=("192.0.2.1",)), q_closed,
                           SourceStats(engine="vllm"))
    async with running(open_src), running(closed_src):
        assert open_src.endpoint is not None and closed_src.endpoint is not None
        async with SimPublisher(open_src.endpoint, mode="connect") as pub:
            pub.connect(closed_src.endpoint)
            async with asyncio.timeout(TIMEOUT):
                await closed_src.peer_refused.wait()
            await pub.wait_for_subscriber()
            pub.publish(payload(3))
            assert hashes(await get_batch(q_open)) == [3]
            assert pub.subscriptions == [b"\x01"]  # only the open source subscribed
    assert closed_src.stats.refused_publishers >= 1
    assert open_src.stats.refused_publishers == 0
    assert q_closed.empty()


# --- queue overflow ------------------------------------------------------------------------


async def test_full_queue_drops_counts_then_clears_before_the_next_batch() -> None:
    async with SimPublisher("tcp://127.0.0.1:0", mode="bind") as pub:
        queue = ObservedQueue(maxsize=2)
        queue.put_nowait(SourceCleared(ClearReason.SOURCE_RESTART))  # fill it ourselves
        queue.put_nowait(SourceCleared(ClearReason.SOURCE_RESTART))
        stats = SourceStats(engine="vllm")
        source = ZmqSource(config(zmq_endpoint=pub.endpoint, zmq_mode="connect"), queue, stats)
        async with running(source):
            await pub.wait_for_subscriber()
            pub.publish(payload(1, 2, 3))
            await queue.wait_attempts(3)  # refused: the queue is full
            assert stats.events_dropped == {"queue_overflow": 3}
            assert not stats.clears
            queue.get_nowait()
            queue.get_nowait()
            pub.publish(payload(4))
            first, second = await get(queue), await get_batch(queue)
    assert first == SourceCleared(ClearReason.OVERFLOW)
    assert hashes(second) == [4]
    assert stats.clears == {"overflow": 1}
    assert stats.gaps == 0  # our own loss is not an engine gap


def test_zmq_version_supports_zap() -> None:
    assert zmq.zmq_version_info() >= (4, 3)


async def test_ipv6_loopback_bind_and_allow_list() -> None:
    queue: asyncio.Queue[SourceItem] = asyncio.Queue(10)
    stats = SourceStats(engine="vllm")
    source = ZmqSource(config(zmq_endpoint="tcp://[::1]:0", allowed_publishers=("::1",)), queue,
                       stats)
    async with running(source):
        assert source.endpoint is not None and source.endpoint.startswith("tcp://[::1]:")
        async with SimPublisher(source.endpoint, mode="connect") as pub:
            await pub.wait_for_subscriber()
            pub.publish(payload(8))
            assert hashes(await get_batch(queue)) == [8]
    assert stats.refused_publishers == 0


def token_batch(n: int) -> EventBatch:
    """One one-block chain of `n` token IDs (hash `n`)."""
    ev = BlockStored(block_hashes=(n,), parent_hash=None, token_ids=array("I", [1] * n),
                     block_size=n)
    return EventBatch(ts=0.0, events=(ev,))


def feeder_of_100_tokens() -> tuple[asyncio.Queue[SourceItem], SourceStats, QueueFeeder]:
    queue: asyncio.Queue[SourceItem] = asyncio.Queue(100)
    stats = SourceStats(engine="vllm")
    return queue, stats, QueueFeeder(queue, stats, "vllm-1", max_tokens=100)


def test_the_queue_is_bounded_in_token_ids_too() -> None:
    # Few batches can hold many tokens: the queue refuses a batch once the queued ones hold
    # max_tokens token IDs, and the loss is announced by an overflow clear (issue #11).
    queue, stats, feeder = feeder_of_100_tokens()
    assert feeder.put(token_batch(60)) and stats.queued_tokens == 60
    assert not feeder.put(token_batch(50))  # would hold 110 tokens
    assert stats.events_dropped == {"queue_overflow": 1}
    taken = queue.get_nowait()
    stats.queued_tokens -= batch_weight(taken)[0]  # what the daemon's pump does
    assert feeder.put(token_batch(50))
    assert queue.get_nowait() == SourceCleared(ClearReason.OVERFLOW)
    last = queue.get_nowait()
    assert batch_weight(last) == (50, 1)
    stats.queued_tokens -= batch_weight(last)[0]
    assert feeder.put(token_batch(200))  # alone in the queue, any size is taken (the caps bound it)


def test_the_queue_is_bounded_in_block_hashes_too() -> None:
    # Removals carry no token IDs: before this bound, 10,000 queued batches of 8 MiB frames of
    # BlockRemoved hashes (about 48 B each decoded) were bounded by nothing but their count.
    # With the default bounds the queue takes batches until they hold 262,144 block hashes,
    # stored or removed; the next one is dropped and a clear is owed.
    queue: asyncio.Queue[SourceItem] = asyncio.Queue(100)
    stats = SourceStats(engine="vllm")
    feeder = QueueFeeder(queue, stats, "vllm-1")
    hashes = tuple(range(65_536))  # the per-event cap; one tuple shared by every event
    removal = EventBatch(ts=0.0, events=(BlockRemoved(block_hashes=hashes),) * 2)
    stored = EventBatch(ts=0.0, events=(BlockStored(
        block_hashes=hashes, parent_hash=None, token_ids=array("I", [1] * 16), block_size=1),))
    assert [feeder.put(removal), feeder.put(stored)] == [True, True]
    assert not feeder.put(removal), "a batch past 262,144 queued block hashes was queued"
    assert stats.events_dropped == {"queue_overflow": 2} and feeder.overflowed
    assert (stats.queued_hashes, stats.queued_tokens, batch_weight(removal)) == (196_608, 16, (0, 131_072))
    first = queue.get_nowait()
    stats.queued(*(-n for n in batch_weight(first)))  # what the daemon's pump does
    assert feeder.put(removal)
    assert [queue.get_nowait() for _ in range(3)] == [stored, SourceCleared(ClearReason.OVERFLOW),
                                                      removal]


async def test_a_batch_in_hand_waits_for_room_behind_the_clear_owed() -> None:
    # put_waiting (a replay's answer) never drops: it waits until the pump has taken enough
    # tokens (`taken`), then queues the clear owed by an earlier loss, then the batch.
    queue, stats, feeder = feeder_of_100_tokens()
    first, lost, in_hand = token_batch(60), token_batch(50), token_batch(45)
    assert feeder.put(first) and not feeder.put(lost) and feeder.overflowed
    waiting = asyncio.create_task(feeder.put_waiting(in_hand))
    await asyncio.sleep(0)  # it runs up to its wait: 60 + 45 tokens would pass the bound
    assert not waiting.done() and queue.qsize() == 1
    feeder.taken(queue.get_nowait())  # what the pump does
    async with asyncio.timeout(TIMEOUT):
        await waiting
    assert [queue.get_nowait() for _ in range(2)] == [SourceCleared(ClearReason.OVERFLOW), in_hand]
    assert not feeder.overflowed and stats.clears == {"overflow": 1}
    assert (stats.queued_tokens, stats.queued_hashes) == (45, 1)


async def test_a_busy_port_is_retried_with_the_doubling_backoff(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The bind/connect retry is kv_listener.backoff.Backoff: first delay, doubling, capped.
    monkeypatch.setattr(zmq_source_module, "_BIND_RETRY_S", 0.001)
    monkeypatch.setattr(zmq_source_module, "_BIND_RETRY_MAX_S", 0.004)
    ctx = zmq.Context()
    holder = ctx.socket(zmq.PUB)
    holder.bind("tcp://127.0.0.1:0")
    endpoint = holder.getsockopt_string(zmq.LAST_ENDPOINT)
    queue: asyncio.Queue[SourceItem] = asyncio.Queue(10)
    source = ZmqSource(config(zmq_endpoint=endpoint), queue, SourceStats(engine="vllm"))
    with capture_logs() as logs:
        task = asyncio.create_task(source.run())
        try:
            async with asyncio.timeout(TIMEOUT):
                await source.first_attach.wait()
                assert source.attach_error is not None and "Address already in use" in source.attach_error
                while sum(e["event"] == "zmq_attach_failed" for e in logs) < 5:
                    await asyncio.sleep(0.001)  # the retries' own pauses: nothing to await
                holder.close(linger=0)
                await source.ready.wait()
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            holder.close(linger=0)
            ctx.term()
    delays = [e["retry_in_s"] for e in logs if e["event"] == "zmq_attach_failed"]
    assert delays[:5] == [0.001, 0.002, 0.004, 0.004, 0.004]
    assert source.attach_error is None and source.endpoint == endpoint
