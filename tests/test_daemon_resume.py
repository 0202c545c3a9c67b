"""Resume, resync and overflow of `GET /events/{backend}` against the real daemon process (SPEC §6).

An engine-like publisher (vLLM 0.33 map encoding over real ZMQ) drives salted chains (SPEC §3: no
detokenize needed) through `python -m kv_listener --config FILE`; consumers read the SSE stream
over real sockets:

- a consumer cut at seeded random byte positions (mid-record included) that reconnects with its
  last ID, by header and by query parameter, ends up with exactly the stream an uninterrupted
  consumer got: same IDs, events and data, contiguous, no duplicate, no gap;
- an ID of another daemon run (unknown epoch), older than the history, or ahead of the log gets a
  resync whose snapshot equals the live state (the engine model kept here, a fresh consumer's
  snapshot, `/stats` prefixes_live); the history's oldest resumable ID is still replayed;
- a consumer that stops reading gets `buffer_overflow` and its stream ends while a fast consumer
  of the same backend receives every record; resuming fills the slow one's gap exactly.

The expected live state comes from `SaltedEngine`, a model of the engine's cache written here from
SPEC §4 (token_count = chain length of the longest retained block, tier by medium), not from the
listener's code.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import random
import signal
import socket
from array import array
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kv_listener.core.model import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from kv_listener.core.salt import issue_cache_salt
from kv_listener.core.sse import SseEvent, SseParser
from kv_listener.sim.encode import encode_vllm_batch
from kv_listener.sim.publisher import SimPublisher
from tests.support.daemon import Daemon, SseClient, sse
from tests.support.ports import free_port

pytestmark = pytest.mark.timeout(60)

BACKEND = "vllm-1"
MODEL = "resume-model"
BLOCK = 16
SECRET = "resume-s3cret"
Live = dict[str, tuple[int, str]]  # prefix_hash -> (token_count, tier)


# --- the engine side ----------------------------------------------------------------------------


@dataclass
class Chain:
    """One salted chain as the engine holds it: block hashes root first, media per block."""

    salt: str
    hashes: list[int] = field(default_factory=list)
    media: list[set[str]] = field(default_factory=list)

    @property
    def live(self) -> bool:
        return any(self.media)

    @property
    def gpu(self) -> bool:
        return any("GPU" in m for m in self.media)

    def state(self) -> tuple[int, str]:
        # SPEC §4: the longest retained block (blocks are removed from the tail only here)
        return len(self.hashes) * BLOCK, "gpu_hot" if self.gpu else "storage_warm"


class SaltedEngine:
    """A vLLM-like engine whose every chain carries its own valid salt (one prefix per chain), with
    a seeded random mix of operations, and the live prefix state those operations imply."""

    def __init__(self, seed: int, backend: str = BACKEND) -> None:
        self.rng = random.Random(seed)
        self.backend = backend
        self.chains: dict[str, Chain] = {}
        self._n = 0

    def new_key(self) -> tuple[str, str]:
        """(prefix_hash, cache_salt) of a fresh system prompt."""
        self._n += 1
        key = hashlib.sha256(f"{MODEL}\x00Ssystem prompt {self._n} {self.rng.random()}".encode()).digest()
        return key.hex(), issue_cache_salt(SECRET.encode(), self.backend, key)

    def _tokens(self, n_blocks: int) -> array[int]:
        return array("I", (self.rng.randrange(1, 50000) for _ in range(n_blocks * BLOCK)))

    def live(self) -> Live:
        return {p: c.state() for p, c in self.chains.items() if c.live}

    # operations: each returns the engine events it publishes and updates the model

    def create(self, n_blocks: int | None = None) -> tuple[str, list[KvEvent]]:
        n = n_blocks or self.rng.randint(1, 4)
        prefix, salt = self.new_key()
        chain = Chain(salt, [self.rng.getrandbits(64) for _ in range(n)], [{"GPU"} for _ in range(n)])
        self.chains[prefix] = chain
        return prefix, [self.store_root(chain)]

    def store_root(self, chain: Chain) -> BlockStored:
        n = len(chain.hashes)
        # vLLM >= 0.17: the request's cache_salt sits in the first block's extra_keys entry
        return BlockStored(block_hashes=tuple(chain.hashes), parent_hash=None,
                           token_ids=self._tokens(n), block_size=BLOCK, medium="GPU",
                           extra_keys=((chain.salt,),) + (None,) * (n - 1))

    def _pick(self, pred: Any) -> Chain | None:
        cands = [c for c in self.chains.values() if c.live and pred(c)]
        return self.rng.choice(cands) if cands else None

    def extend(self) -> list[KvEvent]:
        c = self._pick(lambda c: "GPU" in c.media[-1])
        if c is None:
            return []
        h = self.rng.getrandbits(64)
        ev = BlockStored(block_hashes=(h,), parent_hash=c.hashes[-1], token_ids=self._tokens(1),
                         block_size=BLOCK, medium="GPU")
        c.hashes.append(h)
        c.media.append({"GPU"})
        return [ev]

    def trim(self) -> list[KvEvent]:
        c = self._pick(lambda c: len(c.hashes) >= 2 and c.media[-1] == {"GPU"})
        if c is None:
            return []
        h = c.hashes.pop()
        c.media.pop()
        return [BlockRemoved(block_hashes=(h,), medium="GPU")]

    def offload(self) -> list[KvEvent]:
        c = self._pick(lambda c: c.gpu)
        if c is None:
            return []
        for m in c.media:
            m.discard("GPU")
            m.add("CPU")
        # vLLM offloading connector: a tokenless CPU placeholder, then the GPU copies go
        return [BlockStored(block_hashes=tuple(c.hashes), parent_hash=None, token_ids=array("I"),
                            block_size=0, medium="CPU"),
                BlockRemoved(block_hashes=tuple(c.hashes), medium="GPU")]

    def restore(self) -> list[KvEvent]:
        c = self._pick(lambda c: not c.gpu)
        if c is None:
            return []
        for m in c.media:
            m.add("GPU")
        return [self.store_root(c)]  # known hashes stored again: they gain the GPU medium

    def evict(self) -> list[KvEvent]:
        c = self._pick(lambda c: True)
        if c is None:
            return []
        for m in c.media:
            m.clear()
        return [BlockRemoved(block_hashes=tuple(c.hashes))]

    def clear(self) -> list[KvEvent]:
        for c in self.chains.values():
            for m in c.media:
                m.clear()
        return [AllBlocksCleared()]

    def random_ops(self, n_ops: int) -> list[KvEvent]:
        events: list[KvEvent] = []
        for _ in range(n_ops):
            r = self.rng.random()
            if r < 0.35:
                events += self.create()[1]
            elif r < 0.55:
                events += self.extend()
            elif r < 0.65:
                events += self.trim()
            elif r < 0.78:
                events += self.offload()
            elif r < 0.86:
                events += self.restore()
            else:
                events += self.evict()
        return events


def publish(pub: SimPublisher, events: list[KvEvent]) -> None:
    if events:
        pub.publish(encode_vllm_batch(events, ts=0.0, version="0.33"))


# --- the listener side --------------------------------------------------------------------------


def config(tmp_path: Path, zport: int, **top: Any) -> dict[str, Any]:
    secret = tmp_path / "salt.secret"
    secret.write_text(SECRET + "\n")
    return {"listen": f"127.0.0.1:{free_port()}", "log": {"level": "info"},
            "cache_salt": {"secret_file": str(secret)},
            "sources": [{"backend_name": BACKEND, "engine": "vllm", "model": MODEL,
                         "zmq_endpoint": f"tcp://127.0.0.1:{zport}"}], **top}


@contextlib.asynccontextmanager
async def engine_and_daemon(tmp_path: Path, **top: Any) -> AsyncIterator[tuple[Daemon, SimPublisher]]:
    """The daemon on `config(tmp_path, port, **top)` and the engine's publisher on that port."""
    zport = free_port()
    async with Daemon(config(tmp_path, zport, **top), tmp_path) as daemon, \
            SimPublisher(f"tcp://127.0.0.1:{zport}", mode="connect") as pub:
        yield daemon, pub


def data(ev: SseEvent) -> dict[str, Any]:
    return dict(json.loads(ev.data))


def as_tuple(ev: SseEvent) -> tuple[str | None, str, str | None]:
    """A record as two consumers must both see it. The one data that differs is the `ts` of an
    empty log's resync (`<epoch>-0`): a resync's `cache_cleared` is stamped when it opens."""
    return ev.id, ev.event, None if ev.id is not None and ev.id.endswith("-0") else ev.data


def seq_of(event_id: str) -> int:
    return int(event_id.rpartition("-")[2])


def is_created(prefix: str) -> Any:
    return lambda e: e.event == "cache_created" and data(e).get("prefix_hash") == prefix


async def stats(session: aiohttp.ClientSession, daemon: Daemon) -> dict[str, Any]:
    async with session.get(f"{daemon.base}/stats") as resp:
        assert resp.status == 200
        body = await resp.json()
    return dict(body["sources"][BACKEND])


async def read_resync(client: SseClient) -> tuple[Live, str]:
    """Read a resync: `cache_cleared` then the snapshot, unnumbered but for the last record.
    Returns (snapshot, ID of its last record)."""
    first = await client.next()
    assert first.event == "cache_cleared"
    assert "prefix_hash" not in data(first)
    snap: Live = {}
    ev = first
    while ev.id is None:
        ev = await client.next()
        assert ev.event in ("cache_created", "cache_offloaded"), ev
        d = data(ev)
        assert d["prefix_hash"] not in snap
        snap[d["prefix_hash"]] = (d["token_count"], d["tier"])
        assert ev.event == ("cache_created" if d["tier"] == "gpu_hot" else "cache_offloaded")
    return snap, ev.id


async def settled(engine: SaltedEngine, pub: SimPublisher, client: SseClient) -> str:
    """Publish a marker chain and read `client` up to its creation: every earlier record is then
    out (creations go out at once and in order). Returns the marker's prefix hash."""
    marker, events = engine.create(1)
    publish(pub, events)
    await client.until(is_created(marker))
    return marker


# --- tests --------------------------------------------------------------------------------------


async def hopping_consumer(session: aiohttp.ClientSession, url: str, rng: random.Random,
                           stop_prefix: str, started: asyncio.Event,
                           ) -> tuple[list[SseEvent], int, int]:
    """Read `url`, cutting the connection after a random number of bytes (anywhere, mid-record
    too) and reconnecting with the last ID it holds, alternately by `Last-Event-ID` header and by
    `last_event_id` query parameter, until the creation of `stop_prefix` arrives. Returns every
    record received, the number of connections and of cuts inside a record. `started` is set once
    the first record (the new consumer's resync) is in."""
    got: list[SseEvent] = []
    last = ""
    connections = mid_record_cuts = 0
    while True:
        connections += 1
        headers = {"Accept": "text/event-stream"}
        params = {}
        if last:
            if connections % 2:
                headers["Last-Event-ID"] = last
            else:
                params["last_event_id"] = last
        resp = await session.get(url, headers=headers, params=params,
                                 timeout=aiohttp.ClientTimeout(total=None))
        try:
            assert resp.status == 200
            parser = SseParser(last_event_id=last)
            # The first connection reads its resync's record first (cut before it, the consumer
            # would hold no ID and rightly get a snapshot instead of the same stream).
            budget = rng.randint(1, 2500)
            first_conn = connections == 1
            fresh: list[SseEvent] = []
            tail = b""
            while budget > 0 or (first_conn and not fresh):
                chunk = await resp.content.read(rng.randint(1, 700))
                if not chunk:
                    raise AssertionError(f"stream ended after {len(got)} records")
                budget -= len(chunk)
                tail = (tail + chunk)[-2:]
                evs = parser.feed(chunk)
                if last and not fresh and evs:
                    # a resume starts with the record right after the ID sent, never a resync
                    assert evs[0].id is not None and seq_of(evs[0].id) == seq_of(last) + 1, evs[0]
                fresh += evs
                got += evs
                if got:
                    started.set()
                stop = is_created(stop_prefix)
                for i, e in enumerate(got[len(got) - len(evs):]):
                    if stop(e):
                        # what follows in the same chunk is past the comparison's end
                        return got[:len(got) - len(evs) + i + 1], connections, mid_record_cuts
            last = parser.last_event_id
            mid_record_cuts += tail != b"\n\n"
        finally:
            resp.close()


async def test_random_disconnects_resume_to_exactly_the_uninterrupted_stream(
        tmp_path: Path, session: aiohttp.ClientSession) -> None:
    engine = SaltedEngine(seed=20240501)
    stop_prefix, stop_salt = engine.new_key()
    async with engine_and_daemon(tmp_path, update_interval="20ms") as (daemon, pub):
        url = f"{daemon.base}/events/{BACKEND}"
        async with sse(session, url) as steady:
            first = await steady.next()
            assert first.event == "cache_cleared" and first.id is not None
            epoch = first.id.rpartition("-")[0]
            assert first.id == f"{epoch}-0"  # resync of an empty log carries <epoch>-0
            started = asyncio.Event()
            hopper = asyncio.create_task(
                hopping_consumer(session, url, random.Random(7), stop_prefix, started))
            # both consumers start from the empty log's resync, before anything is published
            waiter = asyncio.ensure_future(started.wait())
            await asyncio.wait({hopper, waiter}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            if hopper.done():
                hopper.result()  # its failure, rather than a timeout further down
            assert started.is_set()
            await pub.wait_for_subscriber()
            for rnd in range(60):
                if rnd == 30:
                    publish(pub, engine.clear())  # the engine resets its prefix cache
                for _ in range(4):
                    publish(pub, engine.random_ops(engine.rng.randint(1, 5)))
                await settled(engine, pub, steady)
            # the stop marker: a chain created with the key the hopper was told to stop at
            chain = Chain(stop_salt, [engine.rng.getrandbits(64)], [{"GPU"}])
            engine.chains[stop_prefix] = chain
            publish(pub, [engine.store_root(chain)])
            await steady.until(is_created(stop_prefix))
            got, connections, mid_record_cuts = await asyncio.wait_for(hopper, 20)
            st = await stats(session, daemon)
    assert [as_tuple(e) for e in got] == [as_tuple(e) for e in steady.events]
    ids = [e.id for e in steady.events]
    assert ids == [f"{epoch}-{i}" for i in range(len(ids))]  # contiguous from the resync's -0
    assert seq_of(st["last_event_id"]) >= len(ids) - 1  # coalesced updates may follow
    kinds = {e.event for e in steady.events[1:]}
    assert {"cache_created", "cache_offloaded", "cache_evicted", "cache_cleared"} <= kinds
    # some token-count updates were coalesced upserts of a live prefix
    assert sum(e.event == "cache_created" for e in steady.events) > len(engine.chains)
    assert connections >= 50 and mid_record_cuts >= 20
    # every reconnection was served from the history; only the two first connections resynced
    assert st["resyncs"] == {"new_consumer": 2}
    assert st["resumes"] == connections - 1
    assert st["prefixes_live"] == len(engine.live())


async def test_unknown_epoch_after_restart_gets_a_resync_equal_to_the_live_state(
        tmp_path: Path, session: aiohttp.ClientSession) -> None:
    zport = free_port()
    engine = SaltedEngine(seed=99)
    cfg = config(tmp_path, zport, update_interval="0ms")
    async with SimPublisher(f"tcp://127.0.0.1:{zport}", mode="connect") as pub:
        daemon = await Daemon(cfg, tmp_path).start()
        try:
            client = await SseClient(session, f"{daemon.base}/events/{BACKEND}").connect()
            try:
                await client.next()
                await pub.wait_for_subscriber()
                for _ in range(10):
                    publish(pub, engine.random_ops(4))
                await settled(engine, pub, client)
                old_id = client.last_event_id
                assert old_id is not None and seq_of(old_id) > 10
                old_epoch = old_id.rpartition("-")[0]
                daemon.signal(signal.SIGTERM)
                drained = await client.until(lambda e: e.event == "draining")
                assert drained.id is None
            finally:
                client.close()
            assert await daemon.wait_exit() == 0
        finally:
            await daemon.stop()
        # Same config, new process: the engine goes on, the listener starts from nothing.
        engine.chains.clear()
        async with Daemon(cfg, tmp_path) as daemon2:
            url = f"{daemon2.base}/events/{BACKEND}"
            async with sse(session, url) as steady:
                await read_resync(steady)
                await pub.wait_for_subscriber(count=2)
                for _ in range(12):
                    publish(pub, engine.random_ops(4))
                await settled(engine, pub, steady)
                st = await stats(session, daemon2)
                assert st["epoch"] != old_epoch
                async with sse(session, url, old_id) as resumed, sse(session, url) as fresh:
                    snap, last = await read_resync(resumed)
                    fresh_snap, fresh_last = await read_resync(fresh)
                    assert snap == engine.live() == fresh_snap
                    assert len(snap) == st["prefixes_live"] > 3
                    assert last == fresh_last == st["last_event_id"] == steady.last_event_id
                    assert {"storage_warm", "gpu_hot"} == {t for _, t in snap.values()}
                    st2 = await stats(session, daemon2)
                    assert st2["resyncs"]["unknown_epoch"] == 1
                    # then live records, numbered on from the snapshot's ID
                    marker, events = engine.create(2)
                    publish(pub, events)
                    live = await resumed.next()
                    assert live.id == f"{st['epoch']}-{seq_of(last) + 1}"
                    assert data(live)["prefix_hash"] == marker
                    assert data(live)["token_count"] == 2 * BLOCK


async def test_too_old_and_ahead_ids_get_a_resync_the_oldest_kept_one_a_replay(
        tmp_path: Path, session: aiohttp.ClientSession) -> None:
    engine = SaltedEngine(seed=5)
    history = 20
    async with engine_and_daemon(tmp_path, history_size=history, max_lag=10,
                                 update_interval="0ms") as (daemon, pub):
        url = f"{daemon.base}/events/{BACKEND}"
        async with sse(session, url) as early:
            await early.next()
            await pub.wait_for_subscriber()
            publish(pub, engine.create(1)[1])
            await early.until(lambda e: e.event == "cache_created")
            early_id = early.last_event_id
            assert early_id is not None and seq_of(early_id) == 1
        # Many more records than the history holds, in rounds below max_lag, read along by a
        # steady consumer (a round's marker creation says the round is out).
        async with sse(session, url) as steady:
            await read_resync(steady)
            for _ in range(15):
                publish(pub, engine.random_ops(3))
                marker = await settled(engine, pub, steady)
        st = await stats(session, daemon)
        epoch, last = st["epoch"], seq_of(st["last_event_id"])
        assert last > history + 10
        assert st["history_records"] == history
        # the oldest ID the history can continue from: replayed, the whole history
        async with sse(session, url, f"{epoch}-{last - history}") as edge:
            replay = [await edge.next() for _ in range(history)]
        assert [e.id for e in replay] == [f"{epoch}-{s}" for s in range(last - history + 1, last + 1)]
        assert replay[-1].event == "cache_created" and data(replay[-1])["prefix_hash"] == marker
        # older by one, the early consumer's ID (query form) and an ID ahead: resyncs
        targets = [f"{epoch}-{last - history - 1}", early_id, f"{epoch}-{last + 5}"]
        snaps = []
        for i, target in enumerate(targets):
            if i == 1:
                client = await SseClient(session, f"{url}?last_event_id={target}").connect()
            else:
                client = await SseClient(session, url, target).connect()
            try:
                snaps.append(await read_resync(client))
            finally:
                client.close()
        want = engine.live()
        assert len(want) == st["prefixes_live"] > 3
        assert all(snap == want and sid == st["last_event_id"] for snap, sid in snaps)
        st = await stats(session, daemon)
        assert st["resyncs"]["too_old"] == 2 and st["resyncs"]["ahead"] == 1
        assert st["resumes"] == 1


def small_rcvbuf_socket(addr_info: Any) -> socket.socket:
    family, type_, proto, _, _ = addr_info
    sock = socket.socket(family, type_, proto)
    # Set before connect, so the TCP window is small from the start: the consumer that reads
    # nothing holds back little, and the daemon's side fills up quickly.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    return sock


async def test_slow_consumer_overflows_while_a_fast_one_gets_every_record(
        tmp_path: Path, session: aiohttp.ClientSession) -> None:
    engine = SaltedEngine(seed=3)
    max_lag = 50
    async with engine_and_daemon(tmp_path, max_lag=max_lag, update_interval="0ms") as (daemon, pub), \
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(socket_factory=small_rcvbuf_socket),
                                  read_bufsize=1024) as slow_session:
        url = f"{daemon.base}/events/{BACKEND}"
        async with sse(session, url) as fast, sse(slow_session, url) as slow:
            await fast.next()
            await slow.next()
            await pub.wait_for_subscriber()
            # Batches of creations below max_lag, each read in full by the fast consumer, until
            # the slow one (which now reads nothing) is cut off.
            created = 0
            async with asyncio.timeout(40):
                while (await stats(session, daemon))["buffer_overflows"] == 0:
                    prefixes = []
                    events: list[KvEvent] = []
                    for _ in range(40):
                        p, evs = engine.create(1)
                        prefixes.append(p)
                        events += evs
                    publish(pub, events)
                    created += 40
                    await fast.until(is_created(prefixes[-1]))
            await daemon.wait_log("sse_buffer_overflow", backend=BACKEND)
            assert created > max_lag
            # The slow one reads what the transport held, then buffer_overflow, then the end.
            with pytest.raises(EOFError):
                while True:
                    await slow.next()
            assert slow.events[-1].event == "buffer_overflow" and slow.events[-1].id is None
            assert data(slow.events[-1]) == {"event": "buffer_overflow", "backend": BACKEND}
            part1 = [as_tuple(e) for e in slow.events[:-1]]
            assert part1 == [as_tuple(e) for e in fast.events[:len(part1)]]
            assert len(part1) < len(fast.events)
            st = await stats(session, daemon)
            assert st["sse_clients"] == 1 and st["buffer_overflows"] == 1
            # The fast one got every record so far and stays live.
            epoch = st["epoch"]
            assert [e.id for e in fast.events] == [f"{epoch}-{i}" for i in range(created + 1)]
            assert "buffer_overflow" not in {e.event for e in fast.events}
            marker = await settled(engine, pub, fast)
            # Resuming from the slow one's last ID fills its gap exactly, as a replay.
            assert slow.last_event_id is not None
            async with sse(session, url, slow.last_event_id) as again:
                await again.until(is_created(marker))
            assert part1 + [as_tuple(e) for e in again.events] == [as_tuple(e) for e in fast.events]
            assert (await stats(session, daemon))["resumes"] == 1


async def test_one_large_batch_does_not_overflow_a_consumer_that_is_caught_up(
        tmp_path: Path, session: aiohttp.ClientSession) -> None:
    engine = SaltedEngine(seed=11)
    max_lag = 50
    async with engine_and_daemon(tmp_path, max_lag=max_lag, update_interval="0ms") as (daemon, pub):
        async with sse(session, f"{daemon.base}/events/{BACKEND}") as fast:
            first = await fast.next()
            assert first.id is not None
            epoch = first.id.rpartition("-")[0]
            await pub.wait_for_subscriber()
            # One engine step that stores more new prefixes than max_lag; the consumer is idle,
            # reading, with nothing queued.
            events: list[KvEvent] = []
            for _ in range(max_lag + 10):
                events += engine.create(1)[1]
            publish(pub, events)
            last = await fast.until(lambda e: e.event == "buffer_overflow"
                                    or e.id == f"{epoch}-{max_lag + 10}")
            assert last.event == "cache_created"
            assert (await stats(session, daemon))["buffer_overflows"] == 0
