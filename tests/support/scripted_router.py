"""A scripted HTTP/2 router for the push client's tests: a real h2 server state machine (server
side) over real TLS on 127.0.0.1 whose every event is handed to the test, which decides what to
answer: flow-control windows granted by hand, PINGs, GOAWAY, RST_STREAM, refusals, odd session
lines; `scripted()` starts one with a `BusClient` dialling it. Also `Chunks`, an `open_stream` for
the client that yields given chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.settings

from kv_listener.core import bus_protocol as bp
from kv_listener.core.bus_protocol import Subscribe, Welcome
from kv_listener.outputs.bus_client import BusClient
from tests.support.bus import listener_config
from tests.support.tasks import running_task
from tests.support.tls import TlsMaterial

#: How long a scripted router waits for what the client under test must send.
WAIT_S = 10.0


class RouterConn:
    """One accepted connection of `ScriptedRouter`: a real h2 server state machine whose every
    event is handed to the test, which decides what to answer."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 initial_window: int, auto_ack: bool) -> None:
        self.reader = reader
        self.writer = writer
        self.h2 = h2.connection.H2Connection(
            config=h2.config.H2Configuration(client_side=False, header_encoding=None))
        self.h2.local_settings = h2.settings.Settings(client=False, initial_values={
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: initial_window,
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 100,
        })
        self.auto_ack = auto_ack
        self.silent = False  # stop processing input (no PING ACKs any more)
        self.events: asyncio.Queue[h2.events.Event] = asyncio.Queue()
        self.received: dict[int, bytearray] = {}
        self.paths: dict[int, str] = {}
        self.error: BaseException | None = None
        self.closed = asyncio.Event()

    def flush(self) -> None:
        data = self.h2.data_to_send()
        if data:
            self.writer.write(data)

    async def run(self) -> None:
        self.h2.initiate_connection()
        self.flush()
        try:
            while data := await self.reader.read(65536):
                if self.silent:
                    continue
                for ev in self.h2.receive_data(data):
                    if isinstance(ev, h2.events.RequestReceived):
                        hdrs = dict(ev.headers or [])
                        self.paths[ev.stream_id] = bytes(hdrs[b":path"]).decode()
                    if isinstance(ev, h2.events.DataReceived):
                        self.received.setdefault(ev.stream_id, bytearray()).extend(ev.data or b"")
                        if self.auto_ack and ev.flow_controlled_length:
                            self.h2.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                    await self.events.put(ev)
                self.flush()
        except (OSError, ssl.SSLError):
            pass
        except Exception as exc:  # an h2 ProtocolError: the client broke the protocol
            self.error = exc
        finally:
            self.closed.set()
            await self.events.put(h2.events.ConnectionTerminated())
            self.writer.close()
            with contextlib.suppress(OSError, ssl.SSLError):
                await self.writer.wait_closed()

    async def next(self, kind: type, stream_id: int | None = None,
                   timeout_s: float = WAIT_S) -> Any:
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    ev = await self.events.get()
                    if isinstance(ev, h2.events.ConnectionTerminated) and \
                            kind is not h2.events.ConnectionTerminated:
                        raise AssertionError(f"connection ended while waiting for {kind.__name__}")
                    if isinstance(ev, kind) and (stream_id is None
                                                 or getattr(ev, "stream_id", None) == stream_id):
                        return ev
        except TimeoutError:
            raise AssertionError(f"no {kind.__name__} (stream {stream_id}) from the client "
                                 f"within {timeout_s} s") from None

    async def request(self, path_prefix: str) -> int:
        while True:
            ev = await self.next(h2.events.RequestReceived)
            if self.paths[ev.stream_id].startswith(path_prefix):
                return int(ev.stream_id)

    async def body(self, stream_id: int) -> bytes:
        await self.next(h2.events.StreamEnded, stream_id)
        return bytes(self.received.get(stream_id, b""))

    def respond(self, stream_id: int, status: int = 200, body: bytes = b"", end: bool = False) -> None:
        self.h2.send_headers(stream_id, [(b":status", str(status).encode()),
                                         (b"content-type", b"application/x-ndjson")])
        if body or end:
            self.h2.send_data(stream_id, body, end_stream=end)
        self.flush()

    def send(self, stream_id: int, data: bytes) -> None:
        self.h2.send_data(stream_id, data)
        self.flush()

    async def welcome(self) -> int:
        """Accept the session: returns its stream id."""
        sid = await self.request(bp.SESSION_PATH)
        hello = bp.decode_hello_body(await self.body(sid))
        assert hello.client_id == "kv-listener-a"
        self.respond(sid, 200, bp.encode_message(Welcome("s-1")))
        return sid

    async def subscribe(self, session: int, stream_id: str, last_event_id: str | None = None, *,
                        before: bytes = b"") -> int:
        """Send `subscribe` for vllm-1 on the session (after the lines `before`), wait for the
        client's POST of that stream and answer it 200: returns the POST's stream id."""
        self.send(session, before + bp.encode_message(Subscribe(stream_id, "vllm-1", last_event_id)))
        sid = await self.request(bp.stream_path(stream_id))
        self.respond(sid, 200)
        return sid


class ScriptedRouter:
    def __init__(self, tls: TlsMaterial, *, initial_window: int = 65535, auto_ack: bool = True) -> None:
        self.tls = tls
        self.initial_window = initial_window
        self.auto_ack = auto_ack
        self.connections: asyncio.Queue[RouterConn] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self.server: asyncio.Server | None = None
        self.port = 0

    async def __aenter__(self) -> ScriptedRouter:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(self.tls.server.cert, self.tls.server.key)
        ctx.set_alpn_protocols(["h2"])
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0, ssl=ctx)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = RouterConn(reader, writer, self.initial_window, self.auto_ack)
        await self.connections.put(conn)
        await conn.run()

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


@contextlib.asynccontextmanager
async def scripted(tls: TlsMaterial, token_file: Path,
                   open_stream: Callable[[str, str | None], AsyncIterator[bytes]], *,
                   initial_window: int = 65535, auto_ack: bool = True, **client_kwargs: Any
                   ) -> AsyncIterator[tuple[ScriptedRouter, BusClient, RouterConn]]:
    """A `ScriptedRouter`, a `BusClient` for vllm-1 dialling it (running for the block), and the
    client's first connection as the router accepted it (nothing answered yet)."""
    async with ScriptedRouter(tls, initial_window=initial_window, auto_ack=auto_ack) as router:
        client = BusClient(listener_config(router.port, tls, token_file), lambda: ["vllm-1"],
                           open_stream, **client_kwargs)
        async with running_task(client.run()):
            try:
                async with asyncio.timeout(WAIT_S):
                    conn = await router.connections.get()
            except TimeoutError:
                raise AssertionError(f"the client did not connect within {WAIT_S} s") from None
            yield router, client, conn


class Chunks:
    """`open_stream` yielding given chunks, then waiting until closed; records the close."""

    def __init__(self, *chunks: bytes, end: bool = False) -> None:
        self.chunks = chunks
        self.end = end
        self.closed = asyncio.Event()
        self.opened: list[tuple[str, str | None]] = []

    def __call__(self, backend: str, last_event_id: str | None) -> AsyncIterator[bytes]:
        self.opened.append((backend, last_event_id))
        return self._gen()

    async def _gen(self) -> AsyncIterator[bytes]:
        try:
            for c in self.chunks:
                yield c
            if not self.end:
                await asyncio.Event().wait()
        finally:
            self.closed.set()
