"""Router side of push mode (SPEC §7) over real TLS sockets on 127.0.0.1: sessions, subscribe /
unsubscribe, pushed bytes handed to the consumer unchanged (the golden file parsed by the SSE
parser), and every refusal: 401 / 403 / 400 / 404, plaintext and HTTP/1.1 refused, untrusted or
unknown client certificates, hot-reload revocation. Requests are made with a low-level HTTP/2
client so that the tests can send what a well-behaved listener never would."""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest
from hpack import HeaderTuple

from kv_listener.core import bus_protocol as bp
from kv_listener.core.bus_protocol import Forbidden, Role, Subscribe, Unsubscribe, Welcome
from kv_listener.core.sse import SseParser
from kv_listener.outputs.bus_h2 import BusError, open_tls
from kv_listener.outputs.bus_h2 import H2Connection as _H2Connection
from kv_listener.router.bus_server import (
    EventBusServer,
    NoSession,
    SecurityFailure,
    StreamEndReason,
    TlsFiles,
)
from kv_listener.router.bus_sessions import BusStream
from kv_listener.router.config import parse_router_config
from kv_listener.router.consumer import NoSessionError
from tests.support.bus import (
    TOKEN_A,
    TOKEN_B,
    TOKEN_BROKER,
    FailureLog,
    brokers,
    client_context,
    h2_connection,
    headers,
    hello,
    post,
    read_line,
    running_server,
)
from tests.support.golden import golden
from tests.support.tls import TlsMaterial

F = SecurityFailure


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsMaterial:
    return TlsMaterial.create(tmp_path_factory.mktemp("bus-tls"))


@pytest.fixture
async def failures() -> FailureLog:
    return FailureLog()


@pytest.fixture
async def server(tls: TlsMaterial, failures: FailureLog) -> AsyncIterator[EventBusServer]:
    async with running_server(tls, on_security_failure=failures, attach_timeout_s=5.0) as s:
        yield s


class Session:
    """An open session made by hand: its stream id on the connection and its line reader."""

    def __init__(self, conn: _H2Connection, port: int, sid: int) -> None:
        self.conn = conn
        self.port = port
        self.sid = sid
        self.splitter = bp.LineSplitter()
        self.pending: list[bytes] = []

    async def line(self) -> bp.RouterMessage | None:
        raw = await read_line(self.conn, self.sid, self.splitter, self.pending)
        return None if raw is None else bp.decode_message(raw)


async def open_session(conn: _H2Connection, port: int, body: bytes,
                       token: bytes | None = TOKEN_A) -> Session:
    answer = await post(conn, port, bp.SESSION_PATH, body, token=token, read_body=False)
    assert answer.status == 200
    session = Session(conn, port, answer.stream_id)
    assert isinstance(await session.line(), Welcome)
    return session


async def subscribed(server: EventBusServer, session: Session,
                     backend: str = "vllm-1") -> tuple[BusStream, Subscribe]:
    """The consumer asks for `backend`: its stream, and the `subscribe` the session was sent."""
    stream = await server.open_announced_stream(backend, None)
    sub = await session.line()
    assert isinstance(sub, Subscribe)
    return stream, sub


async def attached(server: EventBusServer, session: Session,
                   backend: str = "vllm-1") -> tuple[BusStream, Subscribe, int]:
    """`subscribed`, then the listener's POST of that stream, answered 200: also its stream id."""
    stream, sub = await subscribed(server, session, backend)
    conn = session.conn
    sid = await conn.open_request(bp.stream_path(sub.stream_id), headers(server.port, TOKEN_A))
    assert (await conn.response(sid))[0] == 200
    return stream, sub, sid


# --- sessions and streams ---------------------------------------------------------------------


async def test_session_subscribe_and_pushed_bytes_reach_the_consumer_unchanged(
        server: EventBusServer, tls: TlsMaterial) -> None:
    """The golden bytes, pushed in odd-sized DATA frames, come out of the consumer's iterator
    unchanged and parse (core/sse.py) into exactly the expected records."""
    data = golden.GOLDEN.read_bytes()
    async with h2_connection(server.port, tls) as conn:
        with pytest.raises(NoSession):
            await server.open_announced_stream("vllm-1", None)
        session = await open_session(conn, server.port, hello(sources=("vllm-1", "vllm-2")))
        assert server.announced_backends() == {"vllm-1", "vllm-2"}
        [info] = server.sessions()
        assert (info.client_id, info.sources) == ("kv-listener-a", ("vllm-1", "vllm-2"))

        stream = await server.open_announced_stream("vllm-1", golden.RESUME_FROM)
        sub = await session.line()
        assert sub == Subscribe(stream.stream_id, "vllm-1", golden.RESUME_FROM)

        sid = await conn.open_request(bp.stream_path(stream.stream_id),
                                      headers(server.port, TOKEN_A))
        status, _ = await conn.response(sid)  # 200 as soon as the headers are accepted
        assert status == 200
        await stream.attached.wait()
        for i in range(0, len(data), 7):
            await conn.send_data(sid, data[i:i + 7])
        await conn.end_stream(sid)

        received = bytearray()
        parser = SseParser()
        events = []
        async for chunk in stream:
            received += chunk
            events.extend(parser.feed(chunk))
        assert bytes(received) == data
        assert [(e.event, e.id, json.loads(e.data)) for e in events] == golden.EXPECTED
        assert stream.end_reason is StreamEndReason.DRAINING
        assert await conn.read(sid) is None  # the router ended its response with the body
        # The session drained: it is asked for nothing more.
        with pytest.raises(NoSession):
            await server.open_announced_stream("vllm-2", None)
        assert server.stats.bytes_received == len(data)
        assert server.stats.streams_ended["draining"] == 1


async def test_no_session_is_the_consumer_managers_error(server: EventBusServer) -> None:
    with pytest.raises(NoSessionError):
        await server.open_announced_stream("vllm-9", "x-1")
    assert server.stats.no_session == 1


async def test_wait_announced_and_newest_session_wins(server: EventBusServer, tls: TlsMaterial) -> None:
    waiter = asyncio.create_task(server.wait_announced("vllm-1"))
    async with h2_connection(server.port, tls) as c1, h2_connection(server.port, tls) as c2:
        s1 = await open_session(c1, server.port, hello())
        await asyncio.wait_for(waiter, 5)
        s2 = await open_session(c2, server.port, hello())
        stream = await server.open_announced_stream("vllm-1", None)
        assert isinstance(await s2.line(), Subscribe)  # the newer session is asked
        assert stream.session_id == server.sessions()[-1].session_id
        assert s1.pending == []


async def test_consumer_close_sends_unsubscribe_and_stream_id_is_gone(
        server: EventBusServer, tls: TlsMaterial) -> None:
    async with h2_connection(server.port, tls) as conn:
        session = await open_session(conn, server.port, hello())
        stream, sub, sid = await attached(server, session)
        await conn.send_data(sid, b": ping\n\n")
        assert await anext(stream) == b": ping\n\n"
        await stream.aclose()
        assert await session.line() == Unsubscribe(sub.stream_id)
        # Bytes after the unsubscribe are discarded; ending the body ends the router's response.
        await conn.send_data(sid, b"id: x-1\nevent: cache_cleared\ndata: {}\n\n", end_stream=True)
        assert await conn.read(sid) is None
        assert stream.end_reason is StreamEndReason.CLOSED
        with pytest.raises(StopAsyncIteration):
            await anext(stream)
        assert server.stats.streams_ended["closed"] == 1


async def test_attach_timeout_ends_the_stream_and_unsubscribes(tls: TlsMaterial) -> None:
    async with running_server(tls, attach_timeout_s=0.05) as server, \
            h2_connection(server.port, tls) as conn:
        session = await open_session(conn, server.port, hello())
        stream, sub = await subscribed(server, session)
        assert [c async for c in stream] == []
        assert stream.end_reason is StreamEndReason.ATTACH_TIMEOUT
        assert await session.line() == Unsubscribe(sub.stream_id)
        # Too late now: the stream is unknown.
        answer = await post(conn, server.port, bp.stream_path(sub.stream_id), b"", token=TOKEN_A)
        assert answer.status == 404


async def test_slow_consumer_loses_its_stream_not_the_connection(tls: TlsMaterial) -> None:
    async with running_server(tls, max_stream_buffer_bytes=1000) as server, \
            h2_connection(server.port, tls) as conn:
        session = await open_session(conn, server.port, hello(sources=("vllm-1", "vllm-2")))
        slow, sub, sid = await attached(server, session)
        record = b"id: e-1\nevent: cache_cleared\ndata: {}\n\n"
        for _ in range(40):  # 1.6 KB, never read by the consumer
            await conn.send_data(sid, record)
        assert await session.line() == Unsubscribe(sub.stream_id)
        assert slow.end_reason is StreamEndReason.CONSUMER_OVERFLOW
        got = b"".join([c async for c in slow])  # what it had is still handed out, whole
        assert got and got == record * (len(got) // len(record))
        # The session and the connection carry on.
        other = await server.open_announced_stream("vllm-2", None)
        assert isinstance(await session.line(), Subscribe)
        assert other.end_reason is None
        await conn.end_stream(sid)


async def test_disconnect_ends_session_and_its_streams(server: EventBusServer, tls: TlsMaterial) -> None:
    async with h2_connection(server.port, tls) as conn:
        session = await open_session(conn, server.port, hello())
        stream, _, sid = await attached(server, session)
        await conn.send_data(sid, b": ping\n\n")
        assert await anext(stream) == b": ping\n\n"
    # Connection closed without ending anything.
    assert [c async for c in stream] == []
    assert stream.end_reason in (StreamEndReason.RESET, StreamEndReason.SESSION_ENDED)
    await asyncio.wait_for(_until(lambda: not server.sessions(), server), 5)
    with pytest.raises(NoSession):
        await server.open_announced_stream("vllm-1", None)


async def _until(predicate: Callable[[], bool], server: EventBusServer) -> None:
    while not predicate():
        await server._changed.wait()


# --- hot reload -------------------------------------------------------------------------------


async def test_reload_that_shrinks_backends_sends_forbidden(
        server: EventBusServer, tls: TlsMaterial, failures: FailureLog) -> None:
    async with h2_connection(server.port, tls) as conn:
        session = await open_session(conn, server.port, hello(sources=("vllm-1", "vllm-2")))
        stream, _, sid = await attached(server, session, "vllm-2")

        server.update_brokers(brokers(("vllm-1", "vllm-2", "vllm-4")))  # grows: nothing happens
        assert server.sessions() and stream.end_reason is None

        server.update_brokers(brokers(("vllm-1",)))
        assert await session.line() == Forbidden("backend_not_allowed")
        assert await session.line() is None  # the session's response ended
        assert stream.end_reason is StreamEndReason.FORBIDDEN
        assert [c async for c in stream] == []
        assert server.sessions() == []
        await failures.wait(F.REVOKED)
        with pytest.raises(NoSession):
            await server.open_announced_stream("vllm-1", None)
        # A new hello with the old list is now refused; the allowed list is welcome.
        refused = await post(conn, server.port, bp.SESSION_PATH, hello(sources=("vllm-1", "vllm-2")),
                             token=TOKEN_A)
        assert (refused.status, json.loads(refused.body)) == (
            403, {"type": "forbidden", "reason": "backend_not_allowed"})
        await open_session(conn, server.port, hello(sources=("vllm-1",)))
        conn.reset_stream(sid)


async def test_reload_that_revokes_the_token_ends_the_session(
        server: EventBusServer, tls: TlsMaterial) -> None:
    async with h2_connection(server.port, tls) as conn:
        session = await open_session(conn, server.port, hello())
        new = [b for b in brokers() if b.id != "kv-listener-a"]
        server.update_brokers(new)
        msg = await session.line()
        assert isinstance(msg, Forbidden)
        assert await session.line() is None
        assert server.stats.sessions_ended["forbidden"] == 1


# --- refusals ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("token", "authorization", "failure"),
    [
        (None, None, F.MISSING_CREDENTIAL),
        (b"not-the-token", None, F.BAD_TOKEN),
        (None, b"Basic a2V5OnZhbHVl", F.MALFORMED_AUTHORIZATION),
        (None, b"Bearer", F.MALFORMED_AUTHORIZATION),
    ],
)
@pytest.mark.parametrize("path", [bp.SESSION_PATH, "/bus/v1/streams/abc"])
async def test_missing_or_wrong_credential_is_401(
        server: EventBusServer, tls: TlsMaterial, failures: FailureLog, path: str,
        token: bytes | None, authorization: bytes | None, failure: SecurityFailure) -> None:
    async with h2_connection(server.port, tls) as conn:
        answer = await post(conn, server.port, path, hello(), token=token,
                            authorization=authorization)
    assert answer.status == 401
    assert json.loads(answer.body) == {"type": "unauthorized", "reason": failure.value}
    assert failures.seen == [failure]
    assert server.stats.security_failures[failure.value] == 1
    assert server.sessions() == []


@pytest.mark.parametrize(
    ("token", "body", "reason"),
    [
        (TOKEN_A, hello(sources=("vllm-1", "vllm-3")), F.BACKEND_NOT_ALLOWED),
        (TOKEN_B, hello("kv-listener-b", ("vllm-1",)), F.BACKEND_NOT_ALLOWED),
        (TOKEN_BROKER, hello("broker-1"), F.ROLE_MISMATCH),  # broker credential, listener role
        (TOKEN_A, hello(role=Role.BROKER), F.ROLE_MISMATCH),  # listener credential, broker role
        (TOKEN_BROKER, hello("broker-1", role=Role.BROKER), F.ROLE_NOT_SERVED),
        (TOKEN_A, hello("kv-listener-b", ("vllm-3",)), F.CLIENT_ID_MISMATCH),
        (TOKEN_A, hello("kv-listener-z"), F.CLIENT_ID_MISMATCH),
    ],
)
async def test_forbidden_hellos_are_403_and_create_no_session(
        server: EventBusServer, tls: TlsMaterial, failures: FailureLog, token: bytes, body: bytes,
        reason: SecurityFailure) -> None:
    async with h2_connection(server.port, tls) as conn:
        answer = await post(conn, server.port, bp.SESSION_PATH, body, token=token)
    assert answer.status == 403
    assert json.loads(answer.body) == {"type": "forbidden", "reason": reason.value}
    assert failures.seen == [reason]
    assert server.sessions() == [] and server.stats.sessions_opened == 0


@pytest.mark.parametrize(
    ("body", "failure", "detail"),
    [
        (b"", F.MALFORMED_HELLO, "not_one_line"),
        (b"{not json}\n", F.MALFORMED_HELLO, "not_json"),
        (hello() + hello(), F.MALFORMED_HELLO, "not_one_line"),
        (b'{"type":"hello","role":"kv_listener","client_id":"kv-listener-a","sources":["vllm-1"],'
         b'"version":7}\n', F.MALFORMED_HELLO, "unsupported_version"),
        (b'{"type":"hello","pad":"' + b"x" * (70 * 1024) + b'"}\n', F.LINE_TOO_LONG, "line_too_long"),
        (b"x" * (200 * 1024), F.LINE_TOO_LONG, "line_too_long"),  # no newline at all
    ],
)
async def test_bad_hellos_are_400(server: EventBusServer, tls: TlsMaterial, failures: FailureLog,
                                  body: bytes, failure: SecurityFailure, detail: str) -> None:
    async with h2_connection(server.port, tls) as conn:
        answer = await post(conn, server.port, bp.SESSION_PATH, body, token=TOKEN_A)
        assert answer.status == 400
        assert json.loads(answer.body) == {"type": "bad_request", "reason": detail}
        # The connection is still usable after the refusal.
        await open_session(conn, server.port, hello())
    assert failures.seen == [failure]


async def test_stream_posts_that_match_no_live_stream_are_404(
        server: EventBusServer, tls: TlsMaterial, failures: FailureLog) -> None:
    async with h2_connection(server.port, tls) as conn_a, h2_connection(server.port, tls) as conn_b:
        for path in ("/bus/v1/streams/0123456789abcdef01234567", "/bus/v1/streams/a.b"):
            answer = await post(conn_a, server.port, path, b"data: x\n\n", token=TOKEN_A)
            assert answer.status == 404
        assert failures.seen == [F.UNKNOWN_STREAM, F.UNKNOWN_STREAM]

        session = await open_session(conn_a, server.port, hello())
        stream, sub = await subscribed(server, session)
        path = bp.stream_path(sub.stream_id)
        # Another client (valid credential of its own) cannot push into A's stream.
        other = await post(conn_b, server.port, path, b"data: forged\n\n", token=TOKEN_B)
        assert other.status == 404
        await failures.wait(F.STREAM_OF_OTHER_CLIENT)
        assert stream.attached.is_set() is False
        # A can; a second POST for the same stream is refused.
        sid = await conn_a.open_request(path, headers(server.port, TOKEN_A))
        assert (await conn_a.response(sid))[0] == 200
        again = await post(conn_b, server.port, path, b"", token=TOKEN_A)
        assert again.status == 404
        await conn_a.send_data(sid, b"data: real\n\n", end_stream=True)
        assert b"".join([c async for c in stream]) == b"data: real\n\n"


async def test_unknown_path_and_method(server: EventBusServer, tls: TlsMaterial,
                                       failures: FailureLog) -> None:
    async with h2_connection(server.port, tls) as conn:
        answer = await post(conn, server.port, "/admin", b"", token=TOKEN_A)
        assert answer.status == 404
        sid = await conn.open_request(bp.SESSION_PATH, [
            HeaderTuple(b":method", b"GET"), HeaderTuple(b":scheme", b"https"),
            HeaderTuple(b":authority", b"x")])
        await conn.end_stream(sid)
        assert (await conn.response(sid))[0] == 405
    assert failures.seen == [F.UNKNOWN_PATH, F.METHOD_NOT_ALLOWED]


# --- TLS-level refusals and mTLS identities ---------------------------------------------------


async def test_mtls_identity_is_per_connection(tls: TlsMaterial, failures: FailureLog) -> None:
    """A certificate whose DNS SAN is a broker id authenticates without a token, on its own
    connection only: a concurrent connection without a certificate is not authenticated by it."""
    good = tls.client_cert("kv-listener-c")
    wrong = tls.client_cert("intruder.example")
    async with running_server(tls, on_security_failure=failures) as server:
        async with h2_connection(server.port, tls, cert=good) as with_cert, \
                h2_connection(server.port, tls) as without:
            session = await open_session(with_cert, server.port, hello("kv-listener-c"), token=None)
            anonymous = await post(without, server.port, bp.SESSION_PATH, hello("kv-listener-c"))
            assert anonymous.status == 401
            # The certificate's client may not claim another id, or a backend it lacks.
            claim = await post(with_cert, server.port, bp.SESSION_PATH, hello("kv-listener-a"))
            assert (claim.status, json.loads(claim.body)["reason"]) == (403, "client_id_mismatch")
            stream = await server.open_announced_stream("vllm-1", None)
            sub = await session.line()
            assert isinstance(sub, Subscribe) and stream.client_id == "kv-listener-c"
            # The stream POST is authenticated by the same certificate.
            answer = await post(with_cert, server.port, bp.stream_path(sub.stream_id), b"data: x\n\n")
            assert answer.status == 200
            assert b"".join([c async for c in stream]) == b"data: x\n\n"
        async with h2_connection(server.port, tls, cert=wrong) as conn:
            unknown = await post(conn, server.port, bp.SESSION_PATH, hello("kv-listener-c"))
            assert (unknown.status, json.loads(unknown.body)["reason"]) == (401, "unknown_client_cert")
    assert failures.seen == [F.MISSING_CREDENTIAL, F.CLIENT_ID_MISMATCH, F.UNKNOWN_CLIENT_CERT]


async def test_untrusted_client_certificate_is_refused_in_the_handshake(
        tls: TlsMaterial, failures: FailureLog) -> None:
    rogue = tls.untrusted_client_cert("kv-listener-c")
    async with running_server(tls, on_security_failure=failures) as server:
        with pytest.raises(BusError):
            # TLS 1.3: the client may finish its side before the server refuses the certificate,
            # so the refusal shows up at the handshake or at the first exchange.
            async with h2_connection(server.port, tls, cert=rogue) as conn:
                await post(conn, server.port, bp.SESSION_PATH, hello("kv-listener-c"))
        await failures.wait(F.BAD_CLIENT_CERT)
        assert server.stats.sessions_opened == 0


async def test_without_client_ca_certificates_are_not_identities(tls: TlsMaterial) -> None:
    good = tls.client_cert("kv-listener-c")
    async with running_server(tls, mtls=False) as server, \
            h2_connection(server.port, tls, cert=good) as conn:
        answer = await post(conn, server.port, bp.SESSION_PATH, hello("kv-listener-c"))
        assert answer.status == 401


@pytest.mark.parametrize("payload", [
    b"POST /bus/v1/session HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\n\r\n{}",
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",  # h2 prior knowledge, cleartext
])
async def test_plaintext_is_refused(server: EventBusServer, failures: FailureLog, payload: bytes) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        writer.write(payload)
        await writer.drain()
        try:
            answer = await asyncio.wait_for(reader.read(), 5)
        except ConnectionResetError:
            answer = b""
        assert b"HTTP/" not in answer and b"200" not in answer
        await failures.wait(F.PLAINTEXT)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def test_http11_is_refused(server: EventBusServer, tls: TlsMaterial, failures: FailureLog) -> None:
    """aiohttp speaks HTTP/1.1 (no h2 in ALPN): the TLS connection is dropped after the
    handshake, before any request is read."""
    ctx = client_context(tls, alpn=("http/1.1",))
    async with aiohttp.ClientSession() as http:
        with pytest.raises(aiohttp.ClientError):
            async with http.post(f"https://127.0.0.1:{server.port}{bp.SESSION_PATH}", ssl=ctx,
                                 data=hello(), headers={"authorization": "Bearer " + TOKEN_A.decode()},
                                 server_hostname="localhost") as resp:
                await resp.read()
    await failures.wait(F.ALPN_NOT_H2)
    # A TLS client offering no ALPN at all is refused the same way.
    plain = ssl.create_default_context(cafile=tls.ca_file)
    net = await open_tls("127.0.0.1", server.port, plain, "localhost", 5.0)
    try:
        assert net.alpn_protocol() is None
        net.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        with contextlib.suppress(ConnectionResetError, ssl.SSLError):
            assert await asyncio.wait_for(net.read(1024), 5) == b""
    finally:
        await net.aclose()
    await failures.wait(F.ALPN_NOT_H2, 2)
    assert server.stats.sessions_opened == 0


async def test_server_refuses_to_start_without_its_key(tmp_path: Path, tls: TlsMaterial) -> None:
    server = EventBusServer(TlsFiles(tls.server.cert, str(tmp_path / "missing.key")), brokers(),
                            host="127.0.0.1", port=0)
    with pytest.raises(OSError):
        await server.start()


async def test_close_ends_sessions_and_streams(tls: TlsMaterial) -> None:
    async with running_server(tls) as server, h2_connection(server.port, tls) as conn:
        session = await open_session(conn, server.port, hello())
        stream = await server.open_announced_stream("vllm-1", None)
        assert isinstance(await session.line(), Subscribe)
        await server.close()
        assert await session.line() is None
        assert stream.end_reason is StreamEndReason.SERVER_CLOSED
        assert server.stats.sessions_ended["server_closed"] == 1


async def test_a_draining_record_moves_re_requests_to_another_session_at_once(
        server: EventBusServer, tls: TlsMaterial) -> None:
    """The consumer reads `draining` and re-requests before the listener ended the body: the
    router already knows that session drains and asks another one."""
    async with h2_connection(server.port, tls) as c1, h2_connection(server.port, tls) as c2:
        older = await open_session(c1, server.port, hello())
        newer = await open_session(c2, server.port, hello())
        stream, _, sid = await attached(server, newer)
        await c2.send_data(sid, b'event: draining\ndata: {"event":"draining","backend":"vllm-1"}\n\n')
        assert b"draining" in await anext(stream)
        again = await server.open_announced_stream("vllm-1", None)
        assert isinstance(await older.line(), Subscribe)
        assert again.session_id != stream.session_id
        await c2.end_stream(sid)


async def test_built_from_the_router_config_file(tls: TlsMaterial) -> None:
    """`EventBusServer.from_config` takes router/config.py's parsed `dynamo.event_bus` block as
    is (the seed's shape), including roles as enums and mTLS via `tls.client_ca`."""
    cfg = parse_router_config({
        "kv_cache_index": {"event_sources": [{"backend_name": "vllm-1", "transport": "event_bus"}]},
        "dynamo": {"event_bus": {
            "enabled": True, "listen": "127.0.0.1:9443",
            "tls": {"cert": tls.server.cert, "key": tls.server.key, "client_ca": tls.ca_file},
            "brokers": [{"id": "kv-listener-a", "role": "kv_listener",
                         "token_hash": bp.token_hash(TOKEN_A), "backends": ["vllm-1"]}],
        }},
    })
    server = EventBusServer.from_config(cfg.event_bus, port=0)  # any free port in tests
    async with server, h2_connection(server.port, tls) as conn:
        await open_session(conn, server.port, hello())
        refused = await post(conn, server.port, bp.SESSION_PATH, hello(role=Role.BROKER), token=TOKEN_A)
        assert refused.status == 403
