"""The two sides around the daemon in the push-mode daemon tests (tests/test_push_daemon.py).

Engine side: `Chain`, a salted vLLM chain whose prefix key and block hashes are computed here with
hashlib (SPEC §2), not with the listener's code, encoded as vLLM 0.33 publishes it. Router side:
`Router`, an `EventBusServer` that can be closed and started again on the same port, with a
consumer manager (`transport: event_bus`) applying every record to an `InMemoryKvIndex`, and
`Tap`, the consumer's recorded view of one pushed stream. `Router.wait` is how the tests await
what the consumer applied, read or was refused (no sleeps).
"""

from __future__ import annotations

import asyncio
import hashlib
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kv_listener.core.eventlog import RecordEvent
from kv_listener.core.model import BlockRemoved, BlockStored
from kv_listener.core.records import Record
from kv_listener.core.salt import issue_cache_salt
from kv_listener.router.bus_server import (
    BrokerEntry,
    BusStream,
    EventBusServer,
    NoSession,
    SecurityFailure,
    StreamEndReason,
    TlsFiles,
)
from kv_listener.router.config import EventSourceConfig, Transport
from kv_listener.router.consumer import KvEventConsumerManager
from kv_listener.router.index import Holder, IndexEvent, InMemoryKvIndex, PrefixEventType
from kv_listener.sim.encode import encode_vllm_batch
from tests.support.bus import brokers
from tests.support.tls import CertFiles, TlsMaterial

BACKEND = "vllm-1"
MODEL = "tiny-chat"
BLOCK = 16
SALT_SECRET = b"s3cret"


# --- engine side ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Chain:
    """A salted vLLM chain of `blocks` full blocks whose key is that of system prompt `system`."""

    system: str
    blocks: int = 4

    @property
    def key(self) -> bytes:  # SPEC §2, written out independently of kv_listener.core.prefix
        return hashlib.sha256(MODEL.encode() + b"\x00S" + self.system.encode()).digest()

    @property
    def prefix_hash(self) -> str:
        return self.key.hex()

    @property
    def token_count(self) -> int:
        return self.blocks * BLOCK

    @property
    def hashes(self) -> tuple[int, ...]:
        out, parent = [], self.system.encode()
        for i in range(self.blocks):
            parent = hashlib.sha256(parent + i.to_bytes(4, "big")).digest()
            out.append(int.from_bytes(parent[-8:], "big"))
        return tuple(out)

    def stored(self) -> bytes:
        """vLLM 0.33 map encoding; the salt sits in the root block's `extra_keys`."""
        salt = issue_cache_salt(SALT_SECRET, BACKEND, self.key)
        event = BlockStored(block_hashes=self.hashes, parent_hash=None,
                            token_ids=array("I", range(100, 100 + self.token_count)),
                            block_size=BLOCK, medium="GPU",
                            extra_keys=((salt,),) + (None,) * (self.blocks - 1))
        return encode_vllm_batch([event], ts=1.0)

    def removed(self) -> bytes:
        return encode_vllm_batch([BlockRemoved(block_hashes=self.hashes, medium="GPU")], ts=2.0)


A, B, C = (Chain(f"system prompt {n}", blocks) for n, blocks in
           (("alpha", 4), ("bravo", 2), ("charlie", 3)))


# --- router side ------------------------------------------------------------------------------


class Tap:
    """The consumer's view of one `BusStream`, recorded: every byte it read and how it ended."""

    def __init__(self, stream: BusStream, changed: Callable[[], None]) -> None:
        self.stream = stream
        self.data = bytearray()
        self.finished = False
        self._changed = changed

    @property
    def end_reason(self) -> StreamEndReason | None:
        return self.stream.end_reason

    def __aiter__(self) -> Tap:
        return self

    async def __anext__(self) -> bytes:
        try:
            chunk = await anext(self.stream)
        except StopAsyncIteration:
            self._finish()
            raise
        self.data += chunk
        self._changed()
        return chunk

    async def aclose(self) -> None:
        await self.stream.aclose()
        self._finish()

    def _finish(self) -> None:
        self.finished = True
        self._changed()


class Router:
    """The router in this test process: an `EventBusServer` that can be closed and started again
    on the same port, and a consumer manager (`transport: event_bus`) that applies every record to
    an `InMemoryKvIndex` and keeps it. `hold` keeps the consumer out (its stream requests get
    `NoSession`, as while no listener announces the backend)."""

    def __init__(self, tls: TlsMaterial) -> None:
        self.tls = tls
        self.failures: list[SecurityFailure] = []  # what the server counted, in order
        self.index = InMemoryKvIndex()
        self.records: list[Record] = []
        self.taps: list[Tap] = []
        self.hold = False
        self.server: EventBusServer | None = None
        self.port = 0
        self._changed = asyncio.Event()
        self.consumer = KvEventConsumerManager(
            [EventSourceConfig(BACKEND, Transport.EVENT_BUS, None, reconnect_interval_ms=20)],
            self._apply, open_announced_stream=self._open)

    async def start_server(self, broker_list: list[BrokerEntry] | None = None,
                           cert: CertFiles | None = None) -> EventBusServer:
        cert = cert or self.tls.server
        self.server = EventBusServer(
            TlsFiles(cert.cert, cert.key, self.tls.ca_file),
            brokers((BACKEND,)) if broker_list is None else broker_list,
            host="127.0.0.1", port=self.port, on_security_failure=self._failure,
            attach_timeout_s=5.0)
        await self.server.start()
        self.port = self.server.port
        return self.server

    async def close(self) -> None:
        await self.consumer.stop()
        if self.server is not None:
            await self.server.close()

    @property
    def state(self) -> Any:
        return self.consumer.state(BACKEND)

    def holders(self, chain: Chain) -> list[Holder]:
        return self.index.query_now(chain.prefix_hash)

    def notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait(self, predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
        """Return once `predicate()` holds; re-checked whenever the consumer applied a record,
        read bytes, ended a stream or asked for one (it asks every 20 ms while held off), and
        whenever the server counted a security failure."""
        async with asyncio.timeout(timeout_s):
            while not predicate():
                await self._changed.wait()

    def created(self, chain: Chain) -> bool:
        return any(r.event is RecordEvent.CACHE_CREATED and r.prefix_hash == chain.prefix_hash
                   for r in self.records)

    def failed(self, failure: SecurityFailure) -> int:
        return self.failures.count(failure)

    def _failure(self, failure: SecurityFailure) -> None:
        self.failures.append(failure)
        self.notify()

    async def _apply(self, record: Record) -> None:
        self.records.append(record)
        self.index.apply_now(IndexEvent(PrefixEventType(record.event.value), record.backend,
                                        record.prefix_hash, record.token_count or 0))
        self.notify()

    async def _open(self, backend: str, last_event_id: str | None) -> Tap:
        try:
            if self.hold or self.server is None:
                raise NoSession(backend)
            tap = Tap(await self.server.open_announced_stream(backend, last_event_id), self.notify)
            self.taps.append(tap)
            return tap
        finally:
            self.notify()


def triples(records: list[Record]) -> list[tuple[RecordEvent, str | None, str | None]]:
    return [(r.event, r.prefix_hash, r.id) for r in records]


def epoch_of(event_id: str | None) -> str:
    assert event_id is not None
    return event_id.rsplit("-", 1)[0]
