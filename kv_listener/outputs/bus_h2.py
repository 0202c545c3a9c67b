"""The listener's HTTP/2 connection to the event bus (SPEC §7), behind a thin network seam.

Owns: the byte stream under the connection (`NetworkStream`; `open_tls` opens the real one: TCP
+ TLS with ALPN, within a timeout) and the client side of HTTP/2 on top of the sans-IO `h2`
library (`H2Connection`: flow-control windows honoured on every DATA frame, PINGs answered and
sent as keep-alive, GOAWAY and RST_STREAM handled, SETTINGS_MAX_CONCURRENT_STREAMS respected).

Shape (after httpcore): every library error is translated once, where it is raised, into a
`BusError` whose `reason` is a `BusFailure` (the metric label): `OSError`, `ssl.SSLError` and
timeouts by the stream (`open_tls`, `_AsyncioTlsStream`), h2's `ProtocolError` by the connection
at each h2 call. Above this module nothing catches a library error. A stream the router reset
raises `StreamReset`. Tested over an in-memory `NetworkStream` fed serialized frames
(tests/test_bus_h2.py) and over real TLS (tests/test_bus_client.py, tests/test_bus_server.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import ssl
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Protocol

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
from hpack import HeaderTuple

from kv_listener.core.push_session import BusFailure

_READ_SIZE = 65536
#: A peer that never answers the TLS close_notify must not hold shutdown up.
_CLOSE_TIMEOUT_S = 1.0


class BusError(Exception):
    def __init__(self, reason: BusFailure, detail: str = "") -> None:
        super().__init__(f"{reason.value}: {detail}" if detail else reason.value)
        self.reason = reason
        self.detail = detail


class StreamReset(Exception):
    """The router reset one stream (RST_STREAM)."""

    def __init__(self, error_code: int) -> None:
        super().__init__(f"stream reset by the router (error code {error_code})")
        self.error_code = error_code




# --- the network seam -----------------------------------------------------------------------


class NetworkStream(Protocol):
    """The byte stream under one HTTP/2 connection (TLS already negotiated). `read` and `drain`
    raise only `BusError` (the seam translated the rest)."""

    async def read(self, n: int) -> bytes: ...  # b"" at EOF
    def write(self, data: bytes) -> None: ...
    async def drain(self) -> None: ...
    def alpn_protocol(self) -> str | None: ...
    async def aclose(self) -> None: ...


Connect = Callable[[str, int, ssl.SSLContext, str, float], Awaitable[NetworkStream]]


class _AsyncioTlsStream:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    async def read(self, n: int) -> bytes:
        try:
            return await self._reader.read(n)
        except (OSError, ssl.SSLError) as exc:
            raise BusError(BusFailure.CONNECTION_LOST, str(exc)) from None

    def write(self, data: bytes) -> None:
        self._writer.write(data)

    async def drain(self) -> None:
        try:
            await self._writer.drain()
        except (OSError, ssl.SSLError, RuntimeError) as exc:  # RuntimeError: transport closed
            raise BusError(BusFailure.CONNECTION_LOST, str(exc)) from None

    def alpn_protocol(self) -> str | None:
        sslobj = self._writer.get_extra_info("ssl_object")
        return sslobj.selected_alpn_protocol() if sslobj is not None else None

    async def aclose(self) -> None:
        self._writer.close()
        try:
            async with asyncio.timeout(_CLOSE_TIMEOUT_S):
                await self._writer.wait_closed()
        except (TimeoutError, OSError, ssl.SSLError):
            self._writer.transport.abort()


async def open_tls(host: str, port: int, context: ssl.SSLContext, server_hostname: str,
                   timeout_s: float) -> NetworkStream:
    """TCP connect + TLS handshake within `timeout_s`; errors become `BusError`."""
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(
                host, port, ssl=context, server_hostname=server_hostname,
                ssl_handshake_timeout=timeout_s)
    except TimeoutError:
        raise BusError(BusFailure.TIMEOUT, f"connect to {host}:{port}") from None
    except ssl.SSLError as exc:
        raise BusError(BusFailure.TLS, str(exc)) from None
    except OSError as exc:
        raise BusError(BusFailure.CONNECT, f"{host}:{port}: {exc.strerror or exc}") from None
    return _AsyncioTlsStream(reader, writer)


# --- HTTP/2 connection ----------------------------------------------------------------------


class _Stream:
    __slots__ = ("ended", "inbound", "reset", "response", "wake")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.response: asyncio.Future[tuple[int, list[tuple[bytes, bytes]]]] = loop.create_future()
        self.inbound: deque[bytes] = deque()
        self.ended = False  # the router's END_STREAM arrived
        self.reset: int | None = None  # RST_STREAM error code
        self.wake = asyncio.Event()


class H2Connection:
    """Client side of one HTTP/2 connection: h2's state machine plus the I/O it asks for.

    h2 calls are synchronous, so each one and the `data_to_send()` that follows it run without
    an await in between: no other task can interleave with a half-done operation.
    """

    def __init__(self, net: NetworkStream, *, ping_interval_s: float, ping_timeout_s: float) -> None:
        self._net = net
        self._h2 = h2.connection.H2Connection(
            config=h2.config.H2Configuration(client_side=True, header_encoding=None))
        self._loop = asyncio.get_running_loop()
        self._streams: dict[int, _Stream] = {}
        self._progress = asyncio.Event()  # replaced on every set: "something changed"
        self._ping_interval_s = ping_interval_s
        self._ping_timeout_s = ping_timeout_s
        self._pings: dict[bytes, asyncio.Future[None]] = {}
        self._ping_ids = itertools.count(1)
        self._tasks: list[asyncio.Task[None]] = []
        self.error: BusError | None = None
        self.failed = asyncio.Event()

    async def start(self) -> None:
        self._h2.local_settings = h2.settings.Settings(client=True, initial_values={
            h2.settings.SettingCodes.ENABLE_PUSH: 0,
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 0,  # the router opens no streams
            h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: 65536,
        })
        self._h2.initiate_connection()
        await self._flush_and_drain()
        self._tasks.append(asyncio.create_task(self._reader(), name="bus-h2-reader"))
        self._tasks.append(asyncio.create_task(self._pinger(), name="bus-h2-ping"))

    # --- I/O ---

    def _flush(self) -> None:
        data = self._h2.data_to_send()
        if data:
            self._net.write(data)

    async def _flush_and_drain(self) -> None:
        self._flush()
        try:
            await self._net.drain()
        except BusError as exc:
            self._fail(exc)
            raise self.error or exc from None

    def _signal(self) -> None:
        self._progress.set()
        self._progress = asyncio.Event()

    def _fail(self, error: BusError) -> None:
        if self.error is not None:
            return
        self.error = error
        self.failed.set()
        for st in self._streams.values():
            st.wake.set()
            if not st.response.done():
                st.response.set_exception(error)
                st.response.exception()  # retrieved: nobody may be waiting for it
        for fut in self._pings.values():
            if not fut.done():
                fut.set_exception(error)
                fut.exception()
        self._signal()

    def _check(self) -> None:
        if self.error is not None:
            raise self.error

    async def _reader(self) -> None:
        try:
            while True:
                data = await self._net.read(_READ_SIZE)
                if not data:
                    raise BusError(BusFailure.CONNECTION_LOST, "the router closed the connection")
                try:
                    events = self._h2.receive_data(data)
                except h2.exceptions.ProtocolError as exc:
                    self._flush()  # h2 queued a GOAWAY for the router
                    raise BusError(BusFailure.PROTOCOL, f"HTTP/2: {exc}") from None
                for event in events:
                    self._on_event(event)
                self._flush()  # PING and SETTINGS acks, WINDOW_UPDATEs
                self._signal()
        except BusError as exc:
            self._fail(exc)

    def _on_event(self, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.ResponseReceived):
            st = self._streams.get(event.stream_id)
            if st is not None and not st.response.done():
                status = 0
                headers: list[tuple[bytes, bytes]] = []
                for name, value in event.headers or ():
                    n, v = bytes(name), bytes(value)
                    if n == b":status":
                        status = int(v) if v.isdigit() else 0
                    else:
                        headers.append((n, v))
                st.response.set_result((status, headers))
        elif isinstance(event, h2.events.DataReceived):
            sid = event.stream_id
            assert sid is not None
            # Acknowledge at once: what we keep is bounded by the consumers (session lines are
            # capped at 64 KiB; stream responses carry no body and are discarded).
            if event.flow_controlled_length:
                self._h2.acknowledge_received_data(event.flow_controlled_length, sid)
            st = self._streams.get(sid)
            if st is not None and event.data:
                st.inbound.append(bytes(event.data))
                st.wake.set()
        elif isinstance(event, h2.events.StreamEnded):
            st = self._streams.get(event.stream_id)
            if st is not None:
                st.ended = True
                st.wake.set()
                if not st.response.done():
                    st.response.set_exception(
                        BusError(BusFailure.PROTOCOL, "stream ended without a response"))
                    st.response.exception()
        elif isinstance(event, h2.events.StreamReset):
            st = self._streams.get(event.stream_id)
            if st is not None:
                st.reset = int(event.error_code or 0)
                st.wake.set()
                if not st.response.done():
                    st.response.set_exception(StreamReset(st.reset))
                    st.response.exception()
        elif isinstance(event, h2.events.PingAckReceived):
            fut = self._pings.pop(bytes(event.ping_data or b""), None)
            if fut is not None and not fut.done():
                fut.set_result(None)
        elif isinstance(event, h2.events.ConnectionTerminated):
            code = event.error_code
            raise BusError(BusFailure.GOAWAY, f"GOAWAY from the router (error code {code})")
        # PingReceived: h2 queued the ACK itself. WindowUpdated / RemoteSettingsChanged: the
        # `_signal()` after this batch wakes every sender waiting for a window.

    async def _pinger(self) -> None:
        """Keep-alive: a PING every `ping_interval_s`; no ACK within `ping_timeout_s` means the
        connection is dead (a silent network drop would otherwise go unnoticed)."""
        while self.error is None:
            await asyncio.sleep(self._ping_interval_s)
            if self.error is not None:
                return
            payload = next(self._ping_ids).to_bytes(8, "big")
            fut: asyncio.Future[None] = self._loop.create_future()
            self._pings[payload] = fut
            try:
                self._h2.ping(payload)
                await self._flush_and_drain()
                async with asyncio.timeout(self._ping_timeout_s):
                    await fut
            except TimeoutError:
                self._fail(BusError(BusFailure.PING_TIMEOUT,
                                    f"no PING ACK within {self._ping_timeout_s:g} s"))
                return
            except BusError:
                return

    # --- streams ---

    async def open_request(self, path: str, headers: list[HeaderTuple]) -> int:
        """Send a request's HEADERS (body to follow); waits for a free stream slot."""
        while True:
            self._check()
            # Respect the router's SETTINGS_MAX_CONCURRENT_STREAMS.
            if self._h2.open_outbound_streams < self._h2.remote_settings.max_concurrent_streams:
                break
            await self._progress.wait()
        stream_id = self._h2.get_next_available_stream_id()
        self._streams[stream_id] = _Stream(self._loop)
        try:
            self._h2.send_headers(stream_id, [HeaderTuple(b":path", path.encode()), *headers])
        except h2.exceptions.ProtocolError as exc:
            self._streams.pop(stream_id, None)
            raise BusError(BusFailure.PROTOCOL, f"cannot open a stream: {exc}") from None
        await self._flush_and_drain()
        return stream_id

    async def send_data(self, stream_id: int, data: bytes, *, end_stream: bool = False) -> None:
        """Send `data`, frame by frame, each no larger than the flow-control window allows;
        waits for WINDOW_UPDATE when the window is empty. Raises StreamReset or BusError."""
        st = self._streams[stream_id]
        view = memoryview(data)
        while view:
            self._check()
            if st.reset is not None:
                raise StreamReset(st.reset)
            try:
                window = self._h2.local_flow_control_window(stream_id)
            except h2.exceptions.StreamClosedError:
                raise StreamReset(st.reset or 0) from None
            size = min(window, self._h2.max_outbound_frame_size, len(view))
            if size <= 0:
                await self._progress.wait()
                continue
            self._h2.send_data(stream_id, view[:size].tobytes())
            view = view[size:]
            await self._flush_and_drain()
        if end_stream:
            await self.end_stream(stream_id)

    async def end_stream(self, stream_id: int) -> None:
        """End the request body (an empty DATA frame with END_STREAM needs no window)."""
        self._check()
        try:
            self._h2.end_stream(stream_id)
        except h2.exceptions.ProtocolError:
            return  # already closed (reset by the router)
        await self._flush_and_drain()

    def reset_stream(self, stream_id: int, code: int = h2.errors.ErrorCodes.CANCEL) -> None:
        if self.error is not None:
            return
        with contextlib.suppress(h2.exceptions.ProtocolError):
            self._h2.reset_stream(stream_id, code)
            self._flush()

    async def response(self, stream_id: int) -> tuple[int, list[tuple[bytes, bytes]]]:
        return await self._streams[stream_id].response

    async def read(self, stream_id: int) -> bytes | None:
        """Next chunk of the response body; None once the router ended it."""
        st = self._streams[stream_id]
        while True:
            if st.inbound:
                return b"".join(st.inbound.popleft() for _ in range(len(st.inbound)))
            if st.reset is not None:
                raise StreamReset(st.reset)
            if st.ended:
                return None
            self._check()
            st.wake.clear()
            await st.wake.wait()

    async def read_all(self, stream_id: int, cap: int) -> bytes:
        out = bytearray()
        while len(out) <= cap:
            chunk = await self.read(stream_id)
            if chunk is None:
                break
            out += chunk
        return bytes(out[:cap])

    async def remote_done(self, stream_id: int) -> None:
        """Return once the router ended or reset its side of the stream (or the connection
        failed)."""
        st = self._streams[stream_id]
        while st.reset is None and not st.ended and self.error is None:
            st.wake.clear()
            await st.wake.wait()

    def forget(self, stream_id: int) -> None:
        self._streams.pop(stream_id, None)

    async def close(self) -> None:
        """GOAWAY (when still healthy), stop the tasks, close the TLS stream."""
        if self.error is None:
            with contextlib.suppress(h2.exceptions.ProtocolError):
                self._h2.close_connection()
                self._flush()
            self._fail(BusError(BusFailure.DRAINED, "closed"))
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._net.aclose()

