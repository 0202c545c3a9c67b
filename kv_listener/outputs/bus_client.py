"""Listener side of push mode (SPEC §7): the asyncio shell around the session's state table.

Owns: `BusClient`, the policy of one push-mode client: read the credential (`credential_file` /
`credential_env`, at every connect and for every stream) and the TLS files, open the connection
(`outputs/bus_h2.py`: ALPN `h2`, https only, `tls_server_name` for both SNI and the verified
name, optional mTLS client certificate), send the session (`POST /bus/v1/session`: one hello
line), feed its NDJSON response to the listener's state table (`core/push_session.py`) and carry
out what it answers: one pushed stream per `subscribe` (`POST /bus/v1/streams/{id}` whose body is
exactly the bytes of `open_stream(source, last_event_id)`, the same iterator `GET
/events/{backend}` serves; `outputs/bus_push.py`), reconnect with jittered exponential backoff
(`kv_listener.backoff`), reload, drain on shutdown, and the counters (`BusClientStats`).

Every library error reaches this module already translated by the seam into a `BusError`
whose `reason` is a `BusFailure` (a metric label).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import ssl
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import structlog
from hpack import HeaderTuple, NeverIndexedHeaderTuple

from kv_listener import __version__
from kv_listener.backoff import Backoff
from kv_listener.config import ConfigError, EventBusConfig, read_secret
from kv_listener.core import bus_protocol as bp
from kv_listener.core.bus_protocol import BusProtocolError, BusProtocolErrorReason, Hello, Role
from kv_listener.core.push_session import (
    BusFailure,
    LineRefused,
    ListenerAction,
    ListenerSession,
    SessionFailed,
    StartPush,
    StopPush,
    Welcomed,
)
from kv_listener.outputs.bus_h2 import BusError, Connect, H2Connection, StreamReset, open_tls
from kv_listener.outputs.bus_push import (
    BusClientStats,
    OpenStream,
    Push,
    PushContext,
    PushEnd,
    run_push,
)

__all__ = ["BACKOFF_JITTER", "BusClient", "BusClientStats", "BusError", "BusFailure", "PushEnd"]

log = structlog.get_logger(__name__)

#: A session welcome this long resets the reconnect backoff (SPEC §7).
BACKOFF_RESET_AFTER_S = 30.0
#: Jitter: each backoff delay is shortened by up to this fraction (never beyond `max`).
BACKOFF_JITTER = 0.2
_ERROR_BODY_CAP = 64 * 1024


@dataclass(frozen=True, slots=True)
class _Target:
    host: str
    port: int
    authority: str
    base_path: str
    server_hostname: str


def _target(config: EventBusConfig) -> _Target:
    parts = urlsplit(config.url)
    if parts.scheme != "https" or not parts.hostname:
        raise ValueError(f"event_bus.url must be an https URL with a host, got {config.url!r}")
    port = parts.port or 443
    host = parts.hostname
    authority = f"[{host}]" if ":" in host else host
    if parts.port is not None:
        authority += f":{port}"
    return _Target(host, port, authority, parts.path.rstrip("/"), config.tls_server_name or host)


class _Attempt:
    """The I/O side of one connection attempt: its connection and the tasks pushing streams."""

    __slots__ = ("conn", "pushes", "welcomed_at")

    def __init__(self, conn: H2Connection) -> None:
        self.conn = conn
        self.welcomed_at: float | None = None
        self.pushes: dict[str, Push] = {}


class BusClient:
    """Push mode, listener side. `await run()` (until cancelled, or until `drain()` finished);
    `await drain()` on shutdown; `sources_changed()` after a reload.

    `sources()` returns the backends to announce (read at every connect). `open_stream(backend,
    last_event_id)` returns the async iterator of that backend's SSE bytes from that ID, the
    exact bytes `GET /events/{backend}` would send (the stream hub's `open`); it ends after a
    `draining` or `buffer_overflow` record, and is closed (`aclose()`) when the push ends early.

    What the session may do when is `core/push_session.ListenerSession`'s table; this class
    only carries out its actions.
    """

    def __init__(
        self,
        config: EventBusConfig,
        sources: Callable[[], Sequence[str]],
        open_stream: OpenStream,
        *,
        stats: BusClientStats | None = None,
        connect: Connect = open_tls,
        ping_interval_s: float = 10.0,
        ping_timeout_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        rng: Callable[[], float] = random.random,
    ) -> None:
        self.config = config
        self._target = _target(config)
        self._sources = sources
        self._open_stream = open_stream
        self.stats = stats if stats is not None else BusClientStats()
        self._connect = connect
        self._ping_interval_s = ping_interval_s
        self._ping_timeout_s = ping_timeout_s
        self._clock = clock
        self._backoff = Backoff(config.reconnect_backoff.initial_s, config.reconnect_backoff.max_s,
                                jitter=BACKOFF_JITTER, rng=rng)
        self._core = ListenerSession()
        self._attempt: _Attempt | None = None
        self._wakeup = asyncio.Event()  # reload or drain: stop waiting / end the session
        self._running = False
        self._stopped = asyncio.Event()
        self._stopped.set()
        self.welcomed = asyncio.Event()  # set while a session is welcome (tests, readiness)
        self._changed = asyncio.Event()  # replaced on every set: "stats changed"

    # --- public ---

    async def wait_stats(self, predicate: Callable[[BusClientStats], bool]) -> None:
        """Return once `predicate(stats)` holds (checked after every change of the counters)."""
        while not predicate(self.stats):
            await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    @property
    def announced(self) -> tuple[str, ...] | None:
        """Sources the current session announced (None: no session)."""
        return self._core.sources if self._attempt is not None else None

    def sources_changed(self) -> None:
        """Call after a reload: when the sources to announce differ from the current session's,
        the session ends and a new one announces the new list at once (no backoff). Pushed
        streams end; the router's consumers resume them from their last IDs."""
        current = self.announced
        if current is not None and tuple(self._sources()) == current:
            return
        self._core.reload()
        self._wakeup.set()

    async def run(self) -> None:
        """Connect, keep a session, push what the router subscribes; reconnect with backoff.
        Returns after `drain()`; otherwise runs until cancelled."""
        if self._running:
            raise RuntimeError("BusClient.run() is already running")
        self._running = True
        self._stopped.clear()
        try:
            while not self._core.closed:
                self._wakeup.clear()
                failure, welcomed_for, detail = await self._attempt_once()
                if self._core.closed:
                    break
                if failure is BusFailure.RELOAD:
                    log.info("bus_reconnect_for_reload")
                    self._notify()
                    continue
                await self._back_off(failure, welcomed_for, detail)
        finally:
            self._running = False
            self._stopped.set()

    async def _attempt_once(self) -> tuple[BusFailure, float, str]:
        """One connection attempt, to its end: the reason it is counted under, how long its
        session was welcome, and the detail to log."""
        self._core.connect()
        welcomed_for = 0.0
        error: BusFailure | None = None
        detail = ""
        crashed = False
        try:
            welcomed_for = await self._run_session()
        except BusError as exc:
            error = exc.reason
            detail = exc.detail  # router's refusal reason, TLS error text: no secrets
            attempt = self._attempt
            if attempt is not None and attempt.welcomed_at is not None:
                welcomed_for = self._clock() - attempt.welcomed_at
        except asyncio.CancelledError:
            self._core.attempt_over(None)  # run() may be started again
            raise
        except Exception as exc:  # never let a bug end push mode: log, back off, retry
            log.error("bus_session_crashed", error=repr(exc))
            crashed = True
        finally:
            self._attempt = None
            self.stats.connected = False
            self.stats.session_id = None
            self.welcomed.clear()
        failure = self._core.attempt_over(error, crashed=crashed)
        if crashed or (error is not None
                       and failure not in (BusFailure.RELOAD, BusFailure.DRAINED)):
            self.stats.failures[failure.value] += 1
        return failure, welcomed_for, detail

    async def _back_off(self, failure: BusFailure, welcomed_for: float, detail: str) -> None:
        if welcomed_for >= BACKOFF_RESET_AFTER_S:
            self._backoff.reset()
        delay = self._backoff.next_delay()
        self.stats.next_retry_in_s = delay
        self._notify()
        log.warning("bus_session_lost", reason=failure.value, detail=detail[:300],
                    retry_in_s=round(delay, 3))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay):
                await self._wakeup.wait()
        self.stats.next_retry_in_s = None

    async def drain(self) -> None:
        """Shutdown: accept no new subscription; every pushed stream carries on until its
        iterator ends (the hub sends `draining` to each when it drains) and the router has the
        whole body; then close. Waits at most `drain_deadline`; streams still open then are
        reset. `run()` returns."""
        self._core.drain()
        deadline = self.config.drain_deadline_s
        attempt = self._attempt
        if attempt is not None:
            pushes = [p.task for p in attempt.pushes.values() if p.task is not None]
            if pushes:
                _done, pending = await asyncio.wait(pushes, timeout=deadline)
                if pending:
                    log.warning("bus_drain_deadline", streams_left=len(pending))
        self._wakeup.set()
        if self._running:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(deadline + 1.0):
                    await self._stopped.wait()
        log.info("bus_drained")

    # --- session ---

    def _headers(self, token: bytes | None, content_type: bytes) -> list[HeaderTuple]:
        headers = [
            HeaderTuple(b":method", b"POST"),
            HeaderTuple(b":scheme", b"https"),
            HeaderTuple(b":authority", self._target.authority.encode()),
            HeaderTuple(b"content-type", content_type),
            HeaderTuple(b"user-agent", f"continuum-kv-listener/{__version__}".encode()),
        ]
        if token is not None:
            # Never indexed: keeps the token out of HPACK tables (compression side channels).
            headers.append(NeverIndexedHeaderTuple(b"authorization", b"Bearer " + token))
        return headers

    def _token(self) -> bytes | None:
        # Re-read at every connect and for each stream: a rotated token file applies to new
        # streams too. Unreadable for a stream, it ends only that push.
        try:
            return read_secret(self.config.credential_file, self.config.credential_env)
        except ConfigError as exc:
            raise BusError(BusFailure.CONFIG, str(exc)) from None

    def _credentials(self) -> tuple[bytes | None, ssl.SSLContext]:
        cfg = self.config
        token = self._token()
        if token is not None and not bp.valid_token(token):
            raise BusError(BusFailure.CONFIG, "the bus credential has characters a header cannot carry")
        try:
            ctx = ssl.create_default_context(cafile=cfg.ca_file)  # None: the system roots
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2
            ctx.set_alpn_protocols(["h2"])
            if cfg.client_cert_file is not None:
                ctx.load_cert_chain(cfg.client_cert_file, cfg.client_key_file)
        except (OSError, ssl.SSLError) as exc:
            raise BusError(BusFailure.CONFIG, f"TLS files: {exc}") from None
        return token, ctx

    async def _run_session(self) -> float:
        """One connection and its session. Returns (after a reload or drain request) how long the
        session was welcome; raises BusError when it failed."""
        token, ctx = self._credentials()
        sources = tuple(self._sources())
        try:
            hello = bp.encode_hello(Hello(Role.KV_LISTENER, self.config.client_id, sources))
        except BusProtocolError as exc:
            raise BusError(BusFailure.CONFIG, f"hello: {exc}") from None
        t = self._target
        self.stats.connects += 1
        timeout_s = self.config.connect_timeout_s
        net = await self._connect(t.host, t.port, ctx, t.server_hostname, timeout_s)
        if net.alpn_protocol() != "h2":
            await net.aclose()
            raise BusError(BusFailure.ALPN, "the router did not negotiate h2")
        conn = H2Connection(net, ping_interval_s=self._ping_interval_s,
                            ping_timeout_s=self._ping_timeout_s)
        attempt = _Attempt(conn)
        self._core.sources = sources
        self._attempt = attempt
        try:
            await conn.start()
            sid = await conn.open_request(t.base_path + bp.SESSION_PATH,
                                          self._headers(token, bp.NDJSON_CONTENT_TYPE.encode()))
            await conn.send_data(sid, hello, end_stream=True)
            try:
                async with asyncio.timeout(timeout_s):
                    await self._until_welcome(attempt, sid)
            except TimeoutError:
                raise BusError(BusFailure.TIMEOUT, "no welcome within connect_timeout") from None
            except StreamReset as exc:
                raise BusError(BusFailure.REJECTED, str(exc)) from None
            await self._session_loop(attempt, sid)
            assert attempt.welcomed_at is not None
            return self._clock() - attempt.welcomed_at
        finally:
            await self._end_attempt(attempt)

    async def _until_welcome(self, attempt: _Attempt, sid: int) -> None:
        """The session's answer: its status, then lines until the state table has the welcome
        (the lines after it in the same chunk are carried out too)."""
        status, _headers = await attempt.conn.response(sid)
        if status != 200:
            body = await attempt.conn.read_all(sid, _ERROR_BODY_CAP)
            raise _refusal(status, body)
        while self._core.session_id is None:
            chunk = await attempt.conn.read(sid)
            if chunk is None:
                self._carry_out(attempt, [self._core.router_ended()])
            else:
                self._carry_out(attempt, self._core.receive_data(chunk))

    async def _session_loop(self, attempt: _Attempt, sid: int) -> None:
        conn = attempt.conn
        wake = asyncio.create_task(self._wakeup.wait())
        read: asyncio.Task[bytes | None] | None = None
        try:
            while True:
                read = asyncio.create_task(conn.read(sid))
                await asyncio.wait({read, wake}, return_when=asyncio.FIRST_COMPLETED)
                if not read.done():
                    read.cancel()
                    with contextlib.suppress(asyncio.CancelledError, BusError, StreamReset):
                        await read
                    # Reload, or drain() has waited for the pushes already: end the session.
                    return
                try:
                    chunk = read.result()
                except StreamReset as exc:
                    raise BusError(BusFailure.SESSION_ENDED, str(exc)) from None
                if chunk is None:
                    self._carry_out(attempt, [self._core.router_ended()])
                else:
                    self._carry_out(attempt, self._core.receive_data(chunk))
        finally:
            wake.cancel()
            if read is not None:
                # Cancelled from outside mid-read: the read fails once the connection closes.
                read.cancel()
                read.add_done_callback(_retrieve)

    def _carry_out(self, attempt: _Attempt, actions: list[ListenerAction]) -> None:
        """Do what the state table answered; a `SessionFailed` (always last) raises."""
        for action in actions:
            if isinstance(action, StartPush):
                push = Push(action.subscribe)
                attempt.pushes[action.subscribe.stream_id] = push
                push.task = asyncio.create_task(
                    self._push(attempt, push), name=f"bus-push-{action.subscribe.announced_source}")
            elif isinstance(action, StopPush):
                attempt.pushes[action.stream_id].stop.set()
            elif isinstance(action, LineRefused):
                self._line_refused(action)
            elif isinstance(action, Welcomed):
                self._welcomed(attempt, action.session_id)
            else:
                self._session_failed(action)

    def _welcomed(self, attempt: _Attempt, session_id: str) -> None:
        attempt.welcomed_at = self._clock()
        self.stats.sessions += 1
        self.stats.connected = True
        self.stats.session_id = session_id
        self.stats.last_welcome_at = attempt.welcomed_at
        self.welcomed.set()
        self._notify()
        log.info("bus_session_welcome", session_id=session_id, sources=list(self._core.sources))

    def _line_refused(self, refused: LineRefused) -> None:
        self.stats.protocol_errors[refused.label] += 1
        if refused.reason is not None:
            self._notify()
            if refused.reason is not BusProtocolErrorReason.UNKNOWN_TYPE:
                log.warning("bus_bad_session_line", reason=refused.reason.value)
        if refused.backend is not None:
            log.warning("bus_subscribe_unannounced", backend=refused.backend)

    def _session_failed(self, failed: SessionFailed) -> None:
        if failed.failure is BusFailure.FORBIDDEN and self._core.session_id is not None:
            log.error("bus_forbidden", reason=failed.detail, session_id=self._core.session_id)
        raise BusError(failed.failure, failed.detail)

    async def _end_attempt(self, attempt: _Attempt) -> None:
        # A list: each push removes itself from `attempt.pushes` when it ends.
        tasks = [p.task for p in list(attempt.pushes.values()) if p.task is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        await attempt.conn.close()

    # --- one pushed stream ---

    async def _push(self, attempt: _Attempt, push: Push) -> None:
        ctx = PushContext(
            path_prefix=self._target.base_path,
            headers=lambda: self._headers(self._token(), b"text/event-stream"),
            draining=lambda: self._core.draining, open_stream=self._open_stream,
            drain_deadline_s=self.config.drain_deadline_s, stats=self.stats, notify=self._notify)
        try:
            await run_push(ctx, attempt.conn, push)
        finally:
            attempt.pushes.pop(push.sub.stream_id, None)
            self._core.push_ended(push.sub.stream_id)


def _retrieve(task: asyncio.Task[bytes | None]) -> None:
    if not task.cancelled():
        task.exception()  # marks it retrieved: its failure is the session's, already handled


def _refusal(status: int, body: bytes) -> BusError:
    reason = ""
    try:
        obj = json.loads(body.decode("utf-8").splitlines()[0]) if body.strip() else {}
        if isinstance(obj, dict) and isinstance(obj.get("reason"), str):
            reason = obj["reason"][:256]
    except (ValueError, UnicodeDecodeError, IndexError, RecursionError):
        pass
    if status == 401:
        return BusError(BusFailure.UNAUTHORIZED, reason or "401")
    if status == 403:
        return BusError(BusFailure.FORBIDDEN, reason or "403")
    return BusError(BusFailure.REJECTED, f"HTTP {status}" + (f" ({reason})" if reason else ""))
