"""The listener's HTTP/2 connection (outputs/bus_h2.py) over an in-memory stream, as httpcore
tests its own: a real h2 server state machine produces the serialized frames fed in, and reads
what the client wrote. No sockets; the real-TLS tests are in test_bus_client.py."""

from __future__ import annotations

import asyncio

import h2.config
import h2.connection
import h2.events
import h2.settings
import pytest
from hpack import HeaderTuple

from kv_listener.core.push_session import BusFailure
from kv_listener.outputs.bus_h2 import BusError, H2Connection, StreamReset


class MemoryStream:
    """A `NetworkStream` whose peer is a server-side h2 connection driven by the test."""

    def __init__(self) -> None:
        self.server = h2.connection.H2Connection(
            config=h2.config.H2Configuration(client_side=False, header_encoding=None))
        self.server.initiate_connection()
        self.inbound: asyncio.Queue[bytes] = asyncio.Queue()
        self.events: list[h2.events.Event] = []
        self.closed = False
        self.fail_drain: BusError | None = None
        self.silent = False  # drop what the client writes (a network gone quiet)
        self.pump()

    def pump(self) -> None:
        data = self.server.data_to_send()
        if data:
            self.inbound.put_nowait(data)

    async def read(self, n: int) -> bytes:
        return await self.inbound.get()

    def write(self, data: bytes) -> None:
        if self.silent:
            return
        self.events.extend(self.server.receive_data(data))
        self.pump()

    async def drain(self) -> None:
        if self.fail_drain is not None:
            raise self.fail_drain

    def alpn_protocol(self) -> str | None:
        return "h2"

    async def aclose(self) -> None:
        self.closed = True


HEADERS = [HeaderTuple(b":method", b"POST"), HeaderTuple(b":scheme", b"https"),
           HeaderTuple(b":authority", b"router")]


async def connect(net: MemoryStream, **kwargs: float) -> H2Connection:
    conn = H2Connection(net, ping_interval_s=kwargs.get("ping_interval_s", 30.0),
                        ping_timeout_s=kwargs.get("ping_timeout_s", 30.0))
    await conn.start()
    return conn


async def test_request_response_and_body_over_memory() -> None:
    net = MemoryStream()
    conn = await connect(net)
    sid = await conn.open_request("/bus/v1/session", HEADERS)
    await conn.send_data(sid, b"hello\n", end_stream=True)
    received = [e for e in net.events if isinstance(e, h2.events.DataReceived)]
    assert b"".join(bytes(e.data) for e in received) == b"hello\n"
    assert any(isinstance(e, h2.events.StreamEnded) for e in net.events)
    net.server.send_headers(sid, [(b":status", b"200")])
    net.server.send_data(sid, b"line-1\n")
    net.server.send_data(sid, b"line-2\n", end_stream=True)
    net.pump()
    status, _ = await conn.response(sid)
    assert status == 200
    assert await conn.read_all(sid, 1 << 10) == b"line-1\nline-2\n"
    assert await conn.read(sid) is None
    await conn.close()
    assert net.closed


async def test_data_is_split_to_the_flow_control_window() -> None:
    net = MemoryStream()
    net.server.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 100})
    net.pump()
    conn = await connect(net)
    await asyncio.sleep(0)  # the reader applies the router's SETTINGS
    sid = await conn.open_request("/bus/v1/streams/s", HEADERS)
    send = asyncio.create_task(conn.send_data(sid, b"x" * 250))
    while sum(len(e.data or b"") for e in net.events if isinstance(e, h2.events.DataReceived)) < 100:
        await asyncio.sleep(0)
    assert not send.done()  # window used up: it waits for WINDOW_UPDATE
    net.server.increment_flow_control_window(1000, sid)
    net.server.increment_flow_control_window(1000)
    net.pump()
    await asyncio.wait_for(send, 5)
    sizes = [len(e.data or b"") for e in net.events if isinstance(e, h2.events.DataReceived)]
    assert sum(sizes) == 250 and max(sizes) <= 150 and sizes[0] == 100
    await conn.close()


async def test_reset_goaway_eof_and_garbage_become_typed_errors() -> None:
    net = MemoryStream()
    conn = await connect(net)
    sid = await conn.open_request("/bus/v1/streams/s", HEADERS)
    net.server.reset_stream(sid, 8)
    net.pump()
    with pytest.raises(StreamReset):
        await conn.response(sid)
    net.server.close_connection()
    net.pump()
    await asyncio.wait_for(conn.failed.wait(), 5)
    assert conn.error is not None and conn.error.reason is BusFailure.GOAWAY
    await conn.close()

    for fed, reason in [(b"", BusFailure.CONNECTION_LOST), (b"\x00" * 64, BusFailure.PROTOCOL)]:
        net = MemoryStream()
        conn = await connect(net)
        net.inbound.put_nowait(fed)
        await asyncio.wait_for(conn.failed.wait(), 5)
        assert conn.error is not None and conn.error.reason is reason
        with pytest.raises(BusError):
            await conn.open_request("/x", HEADERS)
        await conn.close()


async def test_a_failing_seam_fails_the_connection_once() -> None:
    net = MemoryStream()
    conn = await connect(net)
    net.fail_drain = BusError(BusFailure.CONNECTION_LOST, "gone")
    with pytest.raises(BusError) as info:
        await conn.open_request("/x", HEADERS)
    assert info.value.reason is BusFailure.CONNECTION_LOST
    assert conn.error is info.value
    await conn.close()


async def test_ping_is_answered_and_a_missing_ack_is_a_ping_timeout() -> None:
    net = MemoryStream()
    conn = await connect(net, ping_interval_s=0.01, ping_timeout_s=0.05)
    net.server.ping(b"router!!")
    net.pump()
    while not any(isinstance(e, h2.events.PingAckReceived) for e in net.events):
        await asyncio.sleep(0.005)
    net.silent = True  # the client's next PINGs get no ACK
    await asyncio.wait_for(conn.failed.wait(), 5)
    assert conn.error is not None and conn.error.reason is BusFailure.PING_TIMEOUT
    await conn.close()
