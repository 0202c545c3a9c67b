"""The router's event bus under abuse while the listener pushes every backend to it (TLS
HTTP/2, bearer token), each ending with the convergence check over all three routers (the bus
router's index included): no credentials, a wrong token, too many concurrent streams, huge
headers, PING and SETTINGS floods, half-open TCP and TLS connections."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import h2.config
import h2.connection
import h2.settings
import hpack
import hyperframe.frame
import pytest
import pytest_asyncio

from tests.reliability.conftest import running_stack
from tests.reliability.harness import BUS_TOKEN, Stack
from tests.support.bus import client_context, h2_connection, hello, post
from tests.support.tls import TlsMaterial

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]

SESSION = "/bus/v1/session"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def bus_stack(tmp_path_factory: pytest.TempPathFactory
                    ) -> AsyncIterator[tuple[Stack, TlsMaterial]]:
    tmp: Path = tmp_path_factory.mktemp("bus")
    tls = TlsMaterial.create(tmp / "tls")
    async with running_stack(tmp, bus=tls) as (st, _):
        await st.converge()
        yield st, tls


def bus_router_pid(stack: Stack) -> int:
    proc = next(r for r in stack.routers if r.name == "bus").daemon.proc
    assert proc is not None
    return proc.pid


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@contextlib.asynccontextmanager
async def raw_h2(port: int, tls: TlsMaterial) -> AsyncIterator[
        tuple[h2.connection.H2Connection, asyncio.StreamReader, asyncio.StreamWriter]]:
    """A bare h2 client connection (frames written by hand), for what no honest client sends."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client_context(tls),
                                                   server_hostname="localhost")
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True,
                                                                header_encoding=None))
    conn.initiate_connection()
    writer.write(conn.data_to_send())
    try:
        yield conn, reader, writer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError, ssl.SSLError, TimeoutError):
            async with asyncio.timeout(2):
                await writer.wait_closed()


def request_headers(port: int, token: bytes | None = BUS_TOKEN) -> list[tuple[bytes, bytes]]:
    out = [(b":method", b"POST"), (b":scheme", b"https"), (b":path", SESSION.encode()),
           (b":authority", f"127.0.0.1:{port}".encode())]
    if token is not None:
        out.append((b"authorization", b"Bearer " + token))
    return out


async def drained(reader: asyncio.StreamReader, limit: int = 1 << 22) -> int:
    """Read what the server sends until it closes or goes quiet; bytes read (bounded)."""
    total = 0
    with contextlib.suppress(ConnectionError, ssl.SSLError, TimeoutError):
        while total < limit:
            async with asyncio.timeout(2):
                chunk = await reader.read(65536)
            if not chunk:
                break
            total += len(chunk)
    return total


async def test_no_credentials_and_wrong_tokens_are_refused(
        bus_stack: tuple[Stack, TlsMaterial]) -> None:
    stack, tls = bus_stack
    assert stack.bus_port is not None
    async with h2_connection(stack.bus_port, tls) as conn:
        for token in (None, b"wrong-token", BUS_TOKEN + b"x") * 10:
            answer = await post(conn, stack.bus_port, SESSION, hello(sources=("vllm-1",)),
                                token=token)
            assert answer.status == 401, answer
    for e in stack.engines.values():
        e.traffic(10, seed=80)
    await stack.converge()


async def test_too_many_concurrent_streams(bus_stack: tuple[Stack, TlsMaterial]) -> None:
    stack, tls = bus_stack
    assert stack.bus_port is not None
    async with raw_h2(stack.bus_port, tls) as (_conn, reader, writer):
        # 600 streams opened and never ended (frames written by hand: h2 itself would refuse to
        # open more than the server's limit of 256); the server refuses the ones over it.
        encoder = hpack.Encoder()
        writer.write(b"".join(
            hyperframe.frame.HeadersFrame(
                sid, encoder.encode(request_headers(stack.bus_port, token=None)),
                flags=["END_HEADERS"]).serialize()
            for sid in range(1, 1200, 2)))
        await writer.drain()
        for e in stack.engines.values():
            e.traffic(10, seed=81)
        await drained(reader)
    await stack.converge()


def huge_header_frames(port: int, size: int) -> bytes:
    """HEADERS + CONTINUATION frames carrying a `size`-byte header value (HPACK literal, no
    Huffman coding: h2 would spend minutes compressing it)."""
    block = hpack.Encoder().encode([*request_headers(port), (b"x-padding", b"a" * size)],
                                   huffman=False)
    chunks = [block[i:i + 16384] for i in range(0, len(block), 16384)]
    frames = [hyperframe.frame.HeadersFrame(1, chunks[0], flags=["END_STREAM"])]
    frames += [hyperframe.frame.ContinuationFrame(1, c) for c in chunks[1:]]
    frames[-1].flags.add("END_HEADERS")
    return b"".join(f.serialize() for f in frames)


async def test_huge_headers(bus_stack: tuple[Stack, TlsMaterial]) -> None:
    stack, tls = bus_stack
    assert stack.bus_port is not None
    for size in (64 << 10, 1 << 20, 16 << 20):
        async with raw_h2(stack.bus_port, tls) as (_conn, reader, writer):
            writer.write(huge_header_frames(stack.bus_port, size))
            with contextlib.suppress(ConnectionError, ssl.SSLError, TimeoutError):
                async with asyncio.timeout(10):
                    await writer.drain()
            await drained(reader)
    for e in stack.engines.values():
        e.traffic(10, seed=82)
    await stack.converge()


@pytest.mark.parametrize("flood", ["ping", "settings"])
async def test_control_frame_floods(bus_stack: tuple[Stack, TlsMaterial], flood: str) -> None:
    stack, tls = bus_stack
    assert stack.bus_port is not None
    pid = bus_router_pid(stack)
    before = rss_kib(pid)
    async with raw_h2(stack.bus_port, tls) as (conn, _reader, writer):
        with contextlib.suppress(ConnectionError, ssl.SSLError):
            for i in range(100):  # 100,000 frames, never reading the server's ACKs
                for j in range(1000):
                    if flood == "ping":
                        conn.ping((i * 1000 + j).to_bytes(8, "big"))
                    else:
                        conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE:
                                              65535 + j})
                writer.write(conn.data_to_send())
                async with asyncio.timeout(10):
                    await writer.drain()
                if i == 50:
                    for e in stack.engines.values():
                        e.traffic(10, seed=83)
        grown = rss_kib(pid) - before
    await stack.converge()
    assert grown < 64 * 1024, f"the bus router grew by {grown} KiB under a {flood} flood"


async def test_half_open_connections(bus_stack: tuple[Stack, TlsMaterial]) -> None:
    stack, tls = bus_stack
    assert stack.bus_port is not None
    idle: list[asyncio.StreamWriter] = []
    for _ in range(60):  # TCP only: no TLS ClientHello ever
        _, w = await asyncio.open_connection("127.0.0.1", stack.bus_port)
        idle.append(w)
    for _ in range(20):  # TLS done, no HTTP/2 preface ever
        _, w = await asyncio.open_connection("127.0.0.1", stack.bus_port, ssl=client_context(tls),
                                             server_hostname="localhost")
        idle.append(w)
    try:
        for e in stack.engines.values():
            e.traffic(10, seed=84)
        await stack.converge()
        # and a new honest connection still gets its answer
        async with h2_connection(stack.bus_port, tls) as conn:
            answer = await post(conn, stack.bus_port, SESSION, hello(sources=("vllm-1",)),
                                token=b"wrong")
            assert answer.status == 401
    finally:
        for w in idle:
            w.close()
