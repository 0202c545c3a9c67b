"""Shared pieces of the event-bus tests: credentials, a server on 127.0.0.1:0 with trustme
certificates, the listener's config pointing at it, and a low-level HTTP/2 request helper (the
listener's own h2 connection class over a real TLS socket) for requests the `BusClient` would
never send (wrong tokens, oversized hellos, foreign stream IDs).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpack import HeaderTuple

from kv_listener.config import BackoffConfig, EventBusConfig
from kv_listener.core import bus_protocol as bp
from kv_listener.core.bus_protocol import Hello, Role
from kv_listener.outputs.bus_h2 import H2Connection as _H2Connection
from kv_listener.outputs.bus_h2 import open_tls
from kv_listener.router.bus_server import Broker, EventBusServer, SecurityFailure, TlsFiles
from tests.support.tls import CertFiles, TlsMaterial

TOKEN_A = b"listener-a-token-0123456789"
TOKEN_B = b"listener-b-token-9876543210"
TOKEN_BROKER = b"broker-token-abcdef"


def brokers(backends_a: Sequence[str] = ("vllm-1", "vllm-2")) -> list[Broker]:
    return [
        Broker("kv-listener-a", "kv_listener", bp.token_hash(TOKEN_A), tuple(backends_a)),
        Broker("kv-listener-b", "kv_listener", bp.token_hash(TOKEN_B), ("vllm-3",)),
        Broker("broker-1", "broker", bp.token_hash(TOKEN_BROKER), ("vllm-1",)),
        # mTLS only: no token hash; the client certificate's DNS SAN must be "kv-listener-c".
        Broker("kv-listener-c", "kv_listener", None, ("vllm-1",)),
    ]


class FailureLog:
    """Collects `on_security_failure` calls; `await wait(reason)` instead of sleeping."""

    def __init__(self) -> None:
        self.seen: list[SecurityFailure] = []
        self._changed = asyncio.Event()

    def __call__(self, failure: SecurityFailure) -> None:
        self.seen.append(failure)
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait(self, failure: SecurityFailure, count: int = 1, timeout_s: float = 10.0) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                while self.seen.count(failure) < count:
                    await self._changed.wait()
        except TimeoutError:
            raise AssertionError(f"{failure} counted {self.seen.count(failure)} times, not "
                                 f"{count}, within {timeout_s} s") from None


@asynccontextmanager
async def running_server(tls: TlsMaterial, broker_list: Sequence[Broker] | None = None, *,
                         port: int = 0, mtls: bool = True, **kwargs: Any
                         ) -> AsyncIterator[EventBusServer]:
    server = EventBusServer(
        TlsFiles(tls.server.cert, tls.server.key, tls.ca_file if mtls else None),
        brokers() if broker_list is None else broker_list, host="127.0.0.1", port=port, **kwargs)
    await server.start()
    try:
        yield server
    finally:
        await server.close()


def listener_config(port: int, tls: TlsMaterial, token_file: Path | None, *,
                    client_id: str = "kv-listener-a", cert: CertFiles | None = None,
                    server_name: str | None = None, host: str = "127.0.0.1",
                    initial_s: float = 0.02, max_s: float = 0.2, **kwargs: Any) -> EventBusConfig:
    return EventBusConfig(
        url=f"https://{host}:{port}", client_id=client_id, ca_file=tls.ca_file,
        tls_server_name=server_name,
        credential_file=str(token_file) if token_file is not None else None,
        client_cert_file=cert.cert if cert else None, client_key_file=cert.key if cert else None,
        reconnect_backoff=BackoffConfig(initial_s, max_s), **kwargs)


def write_token(directory: Path, token: bytes, name: str = "token") -> Path:
    path = directory / name
    path.write_bytes(token + b"\n")  # a trailing newline, as `echo` writes it; stripped on read
    return path


def client_context(tls: TlsMaterial, cert: CertFiles | None = None,
                   alpn: Sequence[str] = ("h2",)) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=tls.ca_file)
    ctx.set_alpn_protocols(list(alpn))
    if cert is not None:
        ctx.load_cert_chain(cert.cert, cert.key)
    return ctx


@asynccontextmanager
async def h2_connection(port: int, tls: TlsMaterial, cert: CertFiles | None = None
                        ) -> AsyncIterator[_H2Connection]:
    net = await open_tls("127.0.0.1", port, client_context(tls, cert), "localhost", 5.0)
    conn = _H2Connection(net, ping_interval_s=30.0, ping_timeout_s=30.0)
    await conn.start()
    try:
        yield conn
    finally:
        await conn.close()


@dataclass
class Answer:
    status: int
    body: bytes
    stream_id: int


def headers(port: int, token: bytes | None, *, authorization: bytes | None = None
            ) -> list[HeaderTuple]:
    out = [HeaderTuple(b":method", b"POST"), HeaderTuple(b":scheme", b"https"),
           HeaderTuple(b":authority", f"127.0.0.1:{port}".encode())]
    if authorization is not None:
        out.append(HeaderTuple(b"authorization", authorization))
    elif token is not None:
        out.append(HeaderTuple(b"authorization", b"Bearer " + token))
    return out


async def post(conn: _H2Connection, port: int, path: str, body: bytes, *,
               token: bytes | None = None, authorization: bytes | None = None,
               read_body: bool = True) -> Answer:
    """POST `body` and end the request; read the status (and the whole body unless told not to:
    a session's body lasts as long as the session)."""
    sid = await conn.open_request(path, headers(port, token, authorization=authorization))
    await conn.send_data(sid, body, end_stream=True)
    status, _ = await conn.response(sid)
    data = await conn.read_all(sid, 1 << 20) if read_body else b""
    return Answer(status, data, sid)


def hello(client_id: str = "kv-listener-a", sources: Sequence[str] = ("vllm-1",),
          role: Role = Role.KV_LISTENER) -> bytes:
    return bp.encode_hello(Hello(role, client_id, tuple(sources)))


async def read_line(conn: _H2Connection, sid: int, splitter: bp.LineSplitter,
                    pending: list[bytes]) -> bytes | None:
    """Next NDJSON line of a session response (None when it ended)."""
    while not pending:
        chunk = await conn.read(sid)
        if chunk is None:
            return None
        pending.extend(splitter.feed(chunk))
    return pending.pop(0)
