"""End to end, push mode next to pull mode (SPEC §7 "transport parity"): the listener's stream hub
feeds both its SSE endpoint (uvicorn, pulled by the router's consumer over aiohttp) and the
`BusClient` (pushed over TLS HTTP/2 into the router's `EventBusServer`, consumed through
`open_announced_stream`). The router's own consumer manager applies both; the records it applies
are the same. Then the listener restarts (drain, a new epoch): the push consumer is told
`draining`, waits out `no_session`, and resyncs from the new listener by itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from kv_listener.core.eventlog import RecordEvent
from kv_listener.core.model import PrefixTransition, Tier, TransitionKind
from kv_listener.core.records import Record
from kv_listener.outputs.bus_client import BusClient
from kv_listener.outputs.sse_server import NoSources, create_app, serve
from kv_listener.outputs.streams import StreamHub
from kv_listener.router.bus_server import EventBusServer
from kv_listener.router.config import EventSourceConfig, Transport
from kv_listener.router.consumer import KvEventConsumerManager
from tests.support.bus import TOKEN_A, listener_config, running_server, write_token
from tests.support.tasks import running_task
from tests.support.tls import TlsMaterial

BACKEND = "vllm-1"
P = [f"{i:064x}" for i in range(1, 6)]


class Recorder:
    """`apply_record` for a consumer manager: keeps what was applied, awaitable."""

    def __init__(self) -> None:
        self.records: list[Record] = []
        self._changed = asyncio.Event()

    async def __call__(self, record: Record) -> None:
        self.records.append(record)
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait(self, predicate: Callable[[list[Record]], bool],
                   timeout_s: float = 20.0) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                while not predicate(self.records):
                    await self._changed.wait()
        except TimeoutError:
            raise AssertionError(f"not within {timeout_s} s: {len(self.records)} records "
                                 f"applied") from None


def new_hub(epoch: str) -> StreamHub:
    # A fixed clock: the two consumers' resyncs happen at different moments, and their records
    # must still compare equal field by field (`ts` included).
    hub = StreamHub(history_size=1000, max_lag=1000, update_interval_s=0.0, max_sse_clients=16,
                    ping_interval_s=None, new_epoch=lambda: epoch, clock=lambda: 1764412345.5)
    hub.add_backend(BACKEND)
    return hub


SCRIPT: list[list[PrefixTransition]] = [
    [PrefixTransition(TransitionKind.CREATED, P[0], 1024, Tier.GPU_HOT),
     PrefixTransition(TransitionKind.CREATED, P[1], 256, Tier.GPU_HOT)],
    [PrefixTransition(TransitionKind.TOKEN_COUNT, P[0], 2048, Tier.GPU_HOT)],
    [PrefixTransition(TransitionKind.TIER, P[1], 256, Tier.STORAGE_WARM)],
    [PrefixTransition(TransitionKind.EVICTED, P[0])],
    [PrefixTransition(TransitionKind.CREATED, P[2], 64, Tier.GPU_HOT)],
]


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsMaterial:
    return TlsMaterial.create(tmp_path_factory.mktemp("e2e-tls"))


async def test_push_and_pull_apply_the_same_records_and_push_survives_a_listener_restart(
        tls: TlsMaterial, tmp_path: Path) -> None:
    token_file = write_token(tmp_path, TOKEN_A)
    hub = new_hub("aaaa0001")
    pushed, pulled = Recorder(), Recorder()
    async with running_server(tls) as bus:
        http = await serve(create_app(hub, NoSources()), "127.0.0.1", 0)
        push_mgr = KvEventConsumerManager(
            [EventSourceConfig(BACKEND, Transport.EVENT_BUS, None, reconnect_interval_ms=20)],
            pushed, open_announced_stream=bus.open_announced_stream)
        pull_mgr = KvEventConsumerManager(
            [EventSourceConfig(BACKEND, Transport.SSE, f"http://127.0.0.1:{http.port}/events/{BACKEND}",
                               reconnect_interval_ms=20)], pulled)
        client = BusClient(listener_config(bus.port, tls, token_file), lambda: [BACKEND], hub.open)
        try:
            async with push_mgr, pull_mgr, running_task(client.run()):
                # Both consumers are connected (each got the empty log's resync: cache_cleared).
                await hub.wait_clients(lambda n: n == 2)
                for batch in SCRIPT:
                    hub.publish(BACKEND, batch)
                n = 1 + 6  # the resync's cache_cleared, then six live records
                await pushed.wait(lambda r: len(r) >= n)
                await pulled.wait(lambda r: len(r) >= n)
                assert [r.as_dict() for r in pushed.records] == [r.as_dict() for r in pulled.records]
                assert [r.event for r in pushed.records] == [
                    RecordEvent.CACHE_CLEARED, RecordEvent.CACHE_CREATED, RecordEvent.CACHE_CREATED,
                    RecordEvent.CACHE_CREATED, RecordEvent.CACHE_OFFLOADED, RecordEvent.CACHE_EVICTED,
                    RecordEvent.CACHE_CREATED]
                assert push_mgr.state(BACKEND).last_event_id == "aaaa0001-6"
                await pull_mgr.stop()  # the pull side's part ends here

                # The listener restarts: drain, then a new process (new epoch, new state).
                drained, _ = await asyncio.gather(hub.drain(timeout_s=5.0), client.drain())
                assert drained
                hub2 = new_hub("bbbb0002")
                hub2.publish(BACKEND, [PrefixTransition(TransitionKind.CREATED, P[3], 512, Tier.GPU_HOT)])
                client2 = BusClient(listener_config(bus.port, tls, token_file), lambda: [BACKEND],
                                    hub2.open)
                before = len(pushed.records)
                async with running_task(client2.run()):
                    # The consumer's old ID names another epoch: the new listener resyncs it.
                    await pushed.wait(lambda r: len(r) >= before + 2)
                    after = pushed.records[before:]
                    assert [(r.event, r.prefix_hash, r.id) for r in after] == [
                        (RecordEvent.CACHE_CLEARED, None, None),
                        (RecordEvent.CACHE_CREATED, P[3], "bbbb0002-1"),
                    ]
                    hub2.publish(BACKEND, [PrefixTransition(TransitionKind.EVICTED, P[3])])
                    await pushed.wait(lambda r: len(r) >= before + 3)
                    assert pushed.records[-1].id == "bbbb0002-2"
                    stats = push_mgr.stats()[BACKEND]
                    assert stats["ended"].get("draining") == 1
                    await asyncio.gather(hub2.drain(timeout_s=5.0), client2.drain())
        finally:
            await http.stop()
    assert isinstance(bus, EventBusServer) and bus.stats.security_failures.total() == 0
