"""Push mode through the real daemon process (SPEC §7), over real TLS sockets on 127.0.0.1.

Engine-like ZMQ publisher -> `python -m kv_listener --config FILE` (its `BusClient` dials out) ->
this process's `EventBusServer` (trustme certificates, token hashes in its brokers) -> the router's
`KvEventConsumerManager` with `transport: event_bus` -> `InMemoryKvIndex`. Chains carry a verified
cache salt, so no detokenize server is needed; prefix hashes are computed with hashlib (SPEC §2),
not with the listener's code (the engine and router sides live in `tests/support/push.py`).

What is proved: the index gets what the daemon's own `GET /events` serves; a router restart is
resumed with the last event ID (no resync, no duplicate, no gap); a listener restart drains the
consumer and resyncs it from the new epoch; a reload that shrinks the credential's backends ends
the session with `forbidden`; every security failure is refused by the router, logged by the
daemon and retried with backoff; SIGTERM sends `draining` on the pushed stream and exits 0.

Nothing here sleeps to wait: tests await the daemon's JSON log lines (`Daemon.wait_log`), the
records the consumer applies and the bytes it reads (`Router.wait`), and the router's failure log.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kv_listener.core.eventlog import RecordEvent
from kv_listener.core.model import Tier
from kv_listener.core.records import Record
from kv_listener.core.sse import SseEvent
from kv_listener.router.bus_server import (
    SecurityFailure,
    StreamEndReason,
)
from kv_listener.router.consumer import decode_record
from kv_listener.router.index import Holder
from kv_listener.sim.publisher import SimPublisher
from tests.support.bus import TOKEN_A, TOKEN_B, TOKEN_BROKER, brokers, write_token
from tests.support.daemon import Daemon, SseClient, sse
from tests.support.ports import free_port
from tests.support.push import (
    BACKEND,
    MODEL,
    SALT_SECRET,
    A,
    B,
    C,
    Chain,
    Router,
    epoch_of,
    triples,
)
from tests.support.tls import CertFiles, TlsMaterial

pytestmark = [pytest.mark.timeout(60)]

DRAINING = b'event: draining\ndata: {"event":"draining","backend":"vllm-1"}\n\n'
F = SecurityFailure


# --- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsMaterial:
    return TlsMaterial.create(tmp_path_factory.mktemp("push-daemon-tls"))


@pytest.fixture
async def router(tls: TlsMaterial) -> AsyncIterator[Router]:
    r = Router(tls)
    try:
        yield r
    finally:
        await r.close()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


def daemon_config(tmp_path: Path, tls: TlsMaterial, bus_port: int, zmq_port: int, *,
                  token: bytes | None = TOKEN_A, **bus: Any) -> dict[str, Any]:
    """The listener's YAML: one salted vLLM source and push mode to the router on `bus_port`
    (fast backoff for the tests: 20 ms doubling to 200 ms)."""
    secret = tmp_path / "salt.secret"
    secret.write_bytes(SALT_SECRET + b"\n")
    event_bus: dict[str, Any] = {
        "url": f"https://127.0.0.1:{bus_port}", "ca_file": tls.ca_file,
        "client_id": "kv-listener-a",
        "reconnect_backoff": {"initial": "20ms", "max": "200ms"},
        "connect_timeout": "2s", "drain_deadline": "3s",
    }
    if token is not None:
        event_bus["credential_file"] = str(write_token(tmp_path, token, "bus.token"))
    event_bus.update(bus)
    return {
        "listen": f"127.0.0.1:{free_port()}",
        "cache_salt": {"secret_file": str(secret)},
        "event_bus": event_bus,
        "sources": [{"backend_name": BACKEND, "engine": "vllm", "model": MODEL,
                     "zmq_endpoint": f"tcp://127.0.0.1:{zmq_port}"}],
    }


@contextlib.asynccontextmanager
async def running_daemon(config: dict[str, Any], workdir: Path) -> AsyncIterator[Daemon]:
    """`Daemon` as a context that also reaps a process whose start failed (its `__aexit__` would
    not run)."""
    daemon = Daemon(config, workdir)
    try:
        yield await daemon.start()
    finally:
        await daemon.stop()


@contextlib.asynccontextmanager
async def pushing(tmp_path: Path, tls: TlsMaterial, router: Router, http: aiohttp.ClientSession
                  ) -> AsyncIterator[tuple[Daemon, SimPublisher, SseClient]]:
    """The daemon pushing to `router`'s server, the engine publishing to the daemon, and the
    daemon's own `GET /events` for the backend; nothing awaited yet."""
    zport = free_port()
    async with running_daemon(daemon_config(tmp_path, tls, router.port, zport), tmp_path) as daemon, \
            SimPublisher(f"tcp://127.0.0.1:{zport}", mode="connect") as pub, \
            sse(http, f"{daemon.base}/events/{BACKEND}") as local:
        yield daemon, pub, local


async def welcomed_and_created(daemon: Daemon, pub: SimPublisher, local: SseClient,
                               router: Router, chain: Chain) -> None:
    """The daemon's session is welcomed, the consumer started, the local stream's resync read;
    then the engine publishes `chain` and the consumer applies its `cache_created`."""
    await daemon.wait_log("bus_session_welcome")
    router.consumer.start()
    await local.next()
    await pub.wait_for_subscriber()
    pub.publish(chain.stored())
    await router.wait(lambda: router.created(chain))


def sse_records(events: list[SseEvent]) -> list[Record]:
    out = []
    for ev in events:
        rec = decode_record(BACKEND, ev)
        assert isinstance(rec, Record), ev
        out.append(rec)
    return out


async def bus_stats(http: aiohttp.ClientSession, daemon: Daemon) -> dict[str, Any]:
    """The daemon's push-client block of `GET /stats`."""
    async with http.get(f"{daemon.base}/stats") as resp:
        assert resp.status == 200
        body = await resp.json()
    return dict(body["event_bus"])


async def sse_until_created(client: SseClient, chain: Chain) -> SseEvent:
    return await client.until(lambda e: e.event == "cache_created"
                              and json.loads(e.data)["prefix_hash"] == chain.prefix_hash)


# --- the tests --------------------------------------------------------------------------------


async def test_daemon_pushes_to_the_router_index_the_records_its_sse_serves(
        tmp_path: Path, tls: TlsMaterial, router: Router, http: aiohttp.ClientSession) -> None:
    await router.start_server()
    async with pushing(tmp_path, tls, router, http) as (daemon, pub, local):
        welcome = await daemon.wait_log("bus_session_welcome")
        assert welcome["sources"] == [BACKEND]
        router.consumer.start()
        await daemon.wait_log("bus_push_started", backend=BACKEND, resume=False)
        await router.wait(lambda: len(router.records) >= 1)  # a new consumer: the empty resync
        await local.next()
        await pub.wait_for_subscriber()
        pub.publish(A.stored())
        pub.publish(B.stored())
        pub.publish(A.removed())
        await router.wait(lambda: len(router.records) >= 4)
        for _ in range(3):
            await local.next()
        assert router.holders(A) == []
        assert router.holders(B) == [Holder(BACKEND, B.token_count, Tier.GPU_HOT)]
        assert [(r.event, r.prefix_hash, r.token_count, r.tier) for r in router.records] == [
            (RecordEvent.CACHE_CLEARED, None, None, None),
            (RecordEvent.CACHE_CREATED, A.prefix_hash, A.token_count, Tier.GPU_HOT),
            (RecordEvent.CACHE_CREATED, B.prefix_hash, B.token_count, Tier.GPU_HOT),
            (RecordEvent.CACHE_EVICTED, A.prefix_hash, None, None),
        ]
        # The same records as the daemon's own GET /events: live records field by field (`ts`
        # and `id` included); the two resyncs' `cache_cleared` were made at different moments.
        pulled = sse_records(local.events)
        assert [r.as_dict() for r in router.records[1:]] == [r.as_dict() for r in pulled[1:]]
        assert (router.records[0].event, router.records[0].id) == (pulled[0].event, pulled[0].id)
        epoch = epoch_of(pulled[0].id)
        assert [r.id for r in router.records] == [f"{epoch}-0", f"{epoch}-1", f"{epoch}-2",
                                                  f"{epoch}-3"]
        st = await bus_stats(http, daemon)
        assert (st["connected"], st["sessions"], st["streams_opened"]) == (True, 1, 1)
        assert st["failures"] == {} and st["bytes_pushed"] == len(router.taps[0].data)
    assert router.server is not None and router.server.stats.security_failures.total() == 0


async def test_router_restart_is_resumed_with_the_last_event_id(
        tmp_path: Path, tls: TlsMaterial, router: Router, http: aiohttp.ClientSession) -> None:
    server = await router.start_server()
    async with pushing(tmp_path, tls, router, http) as (daemon, pub, local):
        await welcomed_and_created(daemon, pub, local, router, A)
        last_id = router.state.last_event_id
        assert last_id is not None and last_id.endswith("-1")

        await server.close()
        assert router.taps[-1].end_reason is StreamEndReason.SERVER_CLOSED
        await daemon.wait_log("bus_session_lost")
        # The router is away: the daemon keeps tracking (its own SSE shows B) and its reconnects
        # are refused and backed off.
        pub.publish(B.stored())
        await sse_until_created(local, B)
        await daemon.wait_log("bus_session_lost", reason="connect")
        before = len(router.records)

        await router.start_server()  # same port
        await daemon.wait_log("bus_session_welcome")
        await daemon.wait_log("bus_push_started", backend=BACKEND, resume=False)  # the first
        await daemon.wait_log("bus_push_started", backend=BACKEND, resume=True)
        await router.wait(lambda: router.created(B))
        pub.publish(C.stored())
        await router.wait(lambda: router.created(C))
        await sse_until_created(local, C)
        epoch = epoch_of(last_id)
        # Replayed from the history (B), then live (C): no cache_cleared, no duplicate, no gap.
        assert triples(router.records[before:]) == [
            (RecordEvent.CACHE_CREATED, B.prefix_hash, f"{epoch}-2"),
            (RecordEvent.CACHE_CREATED, C.prefix_hash, f"{epoch}-3"),
        ]
        assert router.taps[-1].stream.last_event_id == last_id
        assert router.state.applied_by_event[RecordEvent.CACHE_CLEARED.value] == 1  # the first
        for chain in (A, B, C):
            assert router.holders(chain) == [Holder(BACKEND, chain.token_count, Tier.GPU_HOT)]
        # The local SSE consumer saw the very same records.
        assert [r.as_dict() for r in sse_records(local.events)[1:]] == \
            [r.as_dict() for r in router.records[1:]]


async def test_listener_restart_drains_then_the_new_epoch_resyncs_the_consumer(
        tmp_path: Path, tls: TlsMaterial, router: Router, http: aiohttp.ClientSession) -> None:
    await router.start_server()
    zport = free_port()
    cfg = daemon_config(tmp_path, tls, router.port, zport)
    async with SimPublisher(f"tcp://127.0.0.1:{zport}", mode="connect") as pub:
        first = Daemon(cfg, tmp_path)
        try:
            await first.start()
            await first.wait_log("bus_session_welcome")
            router.consumer.start()
            await pub.wait_for_subscriber()
            pub.publish(A.stored())
            pub.publish(B.stored())
            await router.wait(lambda: router.created(B))
            old_id = router.state.last_event_id
            first.signal(signal.SIGTERM)
            await router.wait(lambda: router.taps[0].finished)
            assert router.taps[0].end_reason in (StreamEndReason.DRAINING, StreamEndReason.CLOSED)
            assert bytes(router.taps[0].data).endswith(DRAINING)
            assert await first.wait_exit() == 0
        finally:
            await first.stop()
        # Until the new listener has its state, the router keeps the consumer out, so that the
        # resync below carries a non-empty snapshot.
        router.hold = True
        before = len(router.records)
        assert router.holders(A) and router.holders(B)  # the old state stays until the resync

        async with running_daemon(cfg, tmp_path) as second, \
                sse(http, f"{second.base}/events/{BACKEND}") as local:
            await pub.wait_for_subscriber(count=2)  # the new daemon's SUB socket
            pub.publish(C.stored())
            await sse_until_created(local, C)
            await second.wait_log("bus_session_welcome")
            router.hold = False
            await router.wait(lambda: router.created(C))
            await second.wait_log("bus_push_started", backend=BACKEND, resume=True)
            assert router.state.ended["draining"] == 1
            assert router.taps[-1].stream.last_event_id == old_id  # asked with the old epoch's ID
            new_epoch = epoch_of(local.events[-1].id)
            assert new_epoch != epoch_of(old_id)
            # A resync: cache_cleared, then the snapshot (its last record carries the newest ID).
            assert triples(router.records[before:]) == [
                (RecordEvent.CACHE_CLEARED, None, None),
                (RecordEvent.CACHE_CREATED, C.prefix_hash, f"{new_epoch}-1"),
            ]
            assert router.holders(A) == router.holders(B) == []
            assert router.holders(C) == [Holder(BACKEND, C.token_count, Tier.GPU_HOT)]
            assert len(router.index) == 1
            # Live records of the new epoch follow.
            pub.publish(C.removed())
            await router.wait(lambda: router.records[-1].event is RecordEvent.CACHE_EVICTED)
            assert router.records[-1].id == f"{new_epoch}-2"
            assert len(router.index) == 0


async def test_forbidden_after_a_reload_ends_the_session_and_the_records(
        tmp_path: Path, tls: TlsMaterial, router: Router, http: aiohttp.ClientSession) -> None:
    server = await router.start_server()
    async with pushing(tmp_path, tls, router, http) as (daemon, pub, local):
        await welcomed_and_created(daemon, pub, local, router, A)

        server.update_brokers(brokers(("vllm-2",)))  # the credential no longer covers vllm-1
        forbidden = await daemon.wait_log("bus_forbidden")
        assert forbidden["reason"] == "backend_not_allowed"
        await router.wait(lambda: router.taps[0].finished)
        assert router.taps[0].end_reason is StreamEndReason.FORBIDDEN
        # The new hello is refused too (403), and the daemon backs off.
        await router.wait(lambda: router.failed(F.BACKEND_NOT_ALLOWED) >= 1)
        lost = [await daemon.wait_log("bus_session_lost", reason="forbidden") for _ in range(2)]
        assert lost[1]["retry_in_s"] > lost[0]["retry_in_s"]
        pub.publish(B.stored())
        await sse_until_created(local, B)  # the daemon has B ...
        await router.wait(lambda: router.failed(F.BACKEND_NOT_ALLOWED) >= 2)  # ... still refused
        await router.wait(lambda: router.state.ended["no_session"] >= 2)
        assert server.sessions() == []
        assert not router.created(B)
        assert server.stats.security_failures[F.REVOKED.value] == 1

        # Allowed again: the next retry is welcome, and the consumer resumes where it stopped.
        server.update_brokers(brokers((BACKEND,)))
        await router.wait(lambda: router.created(B))
        assert triples(router.records[-1:]) == [
            (RecordEvent.CACHE_CREATED, B.prefix_hash, f"{epoch_of(local.events[0].id)}-2")]
        assert router.state.applied_by_event[RecordEvent.CACHE_CLEARED.value] == 1


@dataclass(frozen=True)
class Refusal:
    """A security failure seen through the daemon: what the router counts (None: nothing reaches
    its HTTP layer), and the `reason` of the daemon's `bus_session_lost` lines."""

    failure: F | None
    daemon_reason: str
    also: str | None = None  # another reason the daemon may log (see client_cert_untrusted)


REFUSALS = {
    "wrong_token": Refusal(F.BAD_TOKEN, "unauthorized"),
    "backend_not_allowed": Refusal(F.BACKEND_NOT_ALLOWED, "forbidden"),
    "client_id_of_another_credential": Refusal(F.CLIENT_ID_MISMATCH, "forbidden"),
    "broker_credential": Refusal(F.ROLE_MISMATCH, "forbidden"),
    "client_cert_of_no_broker": Refusal(F.UNKNOWN_CLIENT_CERT, "unauthorized"),
    # TLS 1.3: the listener's handshake is done before the router checks its certificate, and
    # the router closes the connection without an alert the client reads: what the listener sees
    # is the connection closed under its first request.
    "client_cert_untrusted": Refusal(F.BAD_CLIENT_CERT, "connection_lost", also="tls"),
    "router_cert_untrusted": Refusal(None, "tls"),
    "router_cert_other_name": Refusal(None, "tls"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
async def test_security_failures_are_refused_logged_and_backed_off(
        tmp_path: Path, tls: TlsMaterial, router: Router, http: aiohttp.ClientSession,
        case: str) -> None:
    want = REFUSALS[case]
    bus: dict[str, Any] = {}
    token: bytes | None = TOKEN_A
    server_cert: CertFiles | None = None
    if case == "wrong_token":
        token = b"not-the-listener-token"
    elif case == "backend_not_allowed":
        token, bus["client_id"] = TOKEN_B, "kv-listener-b"  # its backends: vllm-3 only
    elif case == "client_id_of_another_credential":
        bus["client_id"] = "kv-listener-b"  # with kv-listener-a's token
    elif case == "broker_credential":
        token, bus["client_id"] = TOKEN_BROKER, "broker-1"  # role broker; a listener says kv_listener
    elif case == "client_cert_of_no_broker":
        cert = tls.client_cert("intruder.example")
        token, bus["client_cert_file"], bus["client_key_file"] = None, cert.cert, cert.key
    elif case == "client_cert_untrusted":
        cert = tls.untrusted_client_cert("kv-listener-c")
        token, bus["client_id"] = None, "kv-listener-c"
        bus["client_cert_file"], bus["client_key_file"] = cert.cert, cert.key
    elif case == "router_cert_untrusted":
        server_cert = tls.untrusted_server()
    elif case == "router_cert_other_name":
        bus["tls_server_name"] = "other.test"
    server = await router.start_server(cert=server_cert)
    cfg = daemon_config(tmp_path, tls, router.port, free_port(), token=token, **bus)
    async with running_daemon(cfg, tmp_path) as daemon:
        lost = [await daemon.wait_log("bus_session_lost") for _ in range(3)]
        assert {rec["reason"] for rec in lost} <= {want.daemon_reason, want.also}, lost
        # Exponential backoff: 20 ms doubling, each delay shortened by up to 20 % jitter.
        delays = [rec["retry_in_s"] for rec in lost]
        assert delays[0] < delays[1] < delays[2] <= 0.2
        failure = want.failure
        if failure is not None:
            await router.wait(lambda: router.failed(failure) >= 3)
        assert server.stats.sessions_opened == 0
        assert "bus_session_welcome" not in {rec.get("event") for rec in daemon.logs}
        st = await bus_stats(http, daemon)
        assert (st["connected"], st["sessions"], st["streams_opened"]) == (False, 0, 0)
        assert sum(st["failures"].values()) >= 3
        assert set(st["failures"]) <= {want.daemon_reason, want.also}
        if case == "wrong_token":
            # The token file is re-read at every connect: rotating it lets the next retry in.
            write_token(tmp_path, TOKEN_A, "bus.token")
            await daemon.wait_log("bus_session_welcome")
            async with asyncio.timeout(10):
                await server.wait_announced(BACKEND)


async def test_sigterm_ends_the_pushed_stream_with_draining_and_exits_0(
        tmp_path: Path, tls: TlsMaterial, router: Router, http: aiohttp.ClientSession) -> None:
    server = await router.start_server()
    zport = free_port()
    cfg = daemon_config(tmp_path, tls, router.port, zport)
    daemon = Daemon(cfg, tmp_path)
    try:
        await daemon.start()
        async with SimPublisher(f"tcp://127.0.0.1:{zport}", mode="connect") as pub:
            await daemon.wait_log("bus_session_welcome")
            router.consumer.start()
            local = await SseClient(http, f"{daemon.base}/events/{BACKEND}").connect()
            try:
                await pub.wait_for_subscriber()
                pub.publish(A.stored())
                await router.wait(lambda: router.created(A))
                await sse_until_created(local, A)
                daemon.signal(signal.SIGTERM)
                # Both streams, pushed and pulled, end with `draining` (no `id:`).
                await router.wait(lambda: router.taps[0].finished)
                pulled = await local.until(lambda e: e.event == "draining")
                assert pulled.id is None
            finally:
                local.close()
            tap = router.taps[0]
            # The consumer lets the body end after `draining`: the router sees a drained stream.
            assert tap.end_reason is StreamEndReason.DRAINING
            assert bytes(tap.data).endswith(DRAINING)
            assert A.prefix_hash.encode() in tap.data
            # Within the drain deadline (3 s) plus the process's own teardown.
            assert await daemon.wait_exit(timeout_s=3.0 + 2.0) == 0
        await daemon.wait_log("listener_stopped")  # the last line: every line is read now
        events = [rec.get("event") for rec in daemon.logs]
        assert "bus_drain_deadline" not in events and "drain_deadline_passed" not in events
        await daemon.wait_log("bus_drained")
        # The body was ended by the listener and taken whole (no early unsubscribe).
        ended = await daemon.wait_log("bus_push_ended", backend=BACKEND)
        assert ended["end"] == "completed"
        await router.wait(lambda: router.state.ended["draining"] == 1)
        assert server.sessions() == []
        assert server.stats.security_failures.total() == 0
    finally:
        await daemon.stop()
