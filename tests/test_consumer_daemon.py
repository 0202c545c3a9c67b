"""The router's consumer against the real listener process over SSE: records reach the index,
and after the listener restarts (new epoch) the consumer resyncs by itself so the index holds the
new state only."""

from __future__ import annotations

import asyncio
import hashlib
import signal
from array import array
from pathlib import Path

import pytest

from kv_listener.core.model import BlockStored, Tier
from kv_listener.core.records import Record
from kv_listener.core.salt import issue_cache_salt
from kv_listener.router.config import EventSourceConfig
from kv_listener.router.consumer import KvEventConsumerManager, index_applier
from kv_listener.router.index import Holder, InMemoryKvIndex
from kv_listener.sim.encode import encode_vllm_batch
from kv_listener.sim.publisher import SimPublisher
from tests.support.daemon import Daemon
from tests.support.ports import free_port

pytestmark = pytest.mark.timeout(60)
MODEL = "m"


def salted_chain(system: str, tag: bytes, n_blocks: int = 2) -> tuple[BlockStored, str]:
    key = hashlib.sha256(MODEL.encode() + b"\x00S" + system.encode()).digest()
    salt = issue_cache_salt(b"s3cret", "vllm-1", key)
    hashes = tuple(int.from_bytes(hashlib.sha256(tag + bytes([i])).digest()[:8], "big")
                   for i in range(n_blocks))
    ev = BlockStored(block_hashes=hashes, parent_hash=None,
                     token_ids=array("I", range(16 * n_blocks)), block_size=16, medium="GPU",
                     extra_keys=((salt,),) + (None,) * (n_blocks - 1))
    return ev, key.hex()


class Applied:
    def __init__(self, index: InMemoryKvIndex) -> None:
        self.into = index_applier(index)
        self.records: list[Record] = []
        self.changed = asyncio.Event()

    async def __call__(self, record: Record) -> None:
        await self.into(record)
        self.records.append(record)
        self.changed.set()

    async def until(self, pred: object, timeout_s: float = 15) -> Record:
        async with asyncio.timeout(timeout_s):
            while True:
                for r in self.records:
                    if pred(r):  # type: ignore[operator]
                        self.records.remove(r)
                        return r
                self.changed.clear()
                await self.changed.wait()


async def test_consumer_follows_the_listener_process_across_its_restart(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("s3cret")
    zport = free_port()
    cfg = {"listen": f"127.0.0.1:{free_port()}", "cache_salt": {"secret_file": str(secret)},
           "sources": [{"backend_name": "vllm-1", "engine": "vllm", "model": MODEL,
                        "zmq_endpoint": f"tcp://127.0.0.1:{zport}"}]}
    index = InMemoryKvIndex()
    applied = Applied(index)
    first, h1 = salted_chain("before restart", b"a")
    second, h2 = salted_chain("after restart", b"b", 3)
    daemon = await Daemon(cfg, tmp_path).start()
    try:
        src = EventSourceConfig("vllm-1", endpoint=f"{daemon.base}/events/vllm-1",
                                reconnect_interval_ms=50)
        async with KvEventConsumerManager([src], applied) as manager, \
                SimPublisher(f"tcp://127.0.0.1:{zport}", mode="connect") as pub:
            await pub.wait_for_subscriber()
            pub.publish(encode_vllm_batch([first], ts=1.0))
            await applied.until(lambda r: r.prefix_hash == h1)
            assert await index.query(h1) == [Holder("vllm-1", 32, Tier.GPU_HOT)]

            daemon.signal(signal.SIGTERM)
            assert await daemon.wait_exit() == 0
            await daemon.stop()
            daemon = await Daemon(cfg, tmp_path).start()  # same address, new epoch
            await pub.wait_for_subscriber(count=2)  # the new daemon's SUB joined
            pub.publish(encode_vllm_batch([second], ts=2.0))
            cleared = await applied.until(lambda r: r.event.value == "cache_cleared")
            assert cleared.id is None or cleared.id.endswith("-0")  # a resync, new epoch
            await applied.until(lambda r: r.prefix_hash == h2)
            assert await index.query(h1) == []  # the old listener's state is gone
            assert await index.query(h2) == [Holder("vllm-1", 48, Tier.GPU_HOT)]
            stats = manager.stats()["vllm-1"]
            assert stats["reconnect_count"] >= 1
            assert stats["ended"].get("draining") == 1
    finally:
        await daemon.stop()
