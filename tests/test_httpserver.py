"""The HTTP server under slow and hostile clients (issue #11, finding 5): a client that drips
its headers is disconnected after the header timeout, a kept-alive connection gets the same time
for its next request, and connections beyond the cap are closed at once. Real uvicorn on
127.0.0.1, raw sockets as the clients."""

from __future__ import annotations

import asyncio

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from kv_listener.httpserver import RunningServer, serve

pytestmark = pytest.mark.timeout(30)


async def ok(_: Request) -> PlainTextResponse:
    return PlainTextResponse("ok")


APP = Starlette(routes=[Route("/healthz", ok)])


async def closed_by_server(reader: asyncio.StreamReader, within_s: float) -> bool:
    """Does the server close the connection (EOF) within `within_s`?"""
    try:
        async with asyncio.timeout(within_s):
            while await reader.read(4096):
                pass
        return True
    except TimeoutError:
        return False


async def started(**kw: float) -> RunningServer:
    return await serve(APP, "127.0.0.1", 0, **kw)  # type: ignore[arg-type]


async def test_dripped_headers_are_cut_off_after_the_header_timeout() -> None:
    server = await started(header_timeout_s=0.5)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHo")  # and never the rest
        await writer.drain()
        assert await closed_by_server(reader, 5.0)
        writer.close()
        assert server.protocol.timed_out == 1
    finally:
        await server.stop()


async def test_a_complete_request_is_served_and_keep_alive_gets_the_same_limit() -> None:
    server = await started(header_timeout_s=0.5)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200")
        await asyncio.wait_for(reader.readexactly(2), 5)  # "ok"
        writer.write(b"GET /hea")  # the next request on the same connection, dripped
        await writer.drain()
        assert await closed_by_server(reader, 5.0)
        writer.close()
    finally:
        await server.stop()


async def test_connections_beyond_the_cap_are_closed_at_once() -> None:
    server = await started(max_connections=3, header_timeout_s=30.0)
    conns = []
    try:
        for _ in range(3):
            conns.append(await asyncio.open_connection("127.0.0.1", server.port))
        # the server has seen all three once one request round-trips on the third
        r3, w3 = conns[2]
        w3.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        await w3.drain()
        assert (await asyncio.wait_for(r3.readuntil(b"\r\n\r\n"), 5)).startswith(b"HTTP/1.1 200")
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        assert await closed_by_server(reader, 5.0)
        writer.close()
        assert server.protocol.refused == 1
        # the first three are still served
        r1, w1 = conns[0]
        w1.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        await w1.drain()
        assert (await asyncio.wait_for(r1.readuntil(b"\r\n\r\n"), 5)).startswith(b"HTTP/1.1 200")
    finally:
        for _, w in conns:
            w.close()
        await server.stop()
