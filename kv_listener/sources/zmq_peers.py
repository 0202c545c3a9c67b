"""ZMQ peers: who may publish to a source and whether an engine is connected (SPEC §5).

The batches themselves are `sources.zmq`'s; this module is the connection around them.

- `AllowListAuthenticator`: ZAP (`zmq.auth`, asyncio) checks every TCP peer of the SUB socket
  against `allowed_publishers` (IPs, CIDR networks, host names); refused peers are counted in
  `refused_publishers` and logged once per address. The authenticator is per zmq Context, so each
  source has its own Context: many sources run in one process. The replay DEALER connects to an
  endpoint the operator configured and is not ZAP-checked; ipc:// and inproc:// peers are local
  processes (protected by file permissions) and have no address to check.
- `watch_connection`: the SUB socket's monitor, counting handshakes done and lost
  (`publishers_connected`) and connecting a connecting SUB again after libzmq dropped it.
- `wants_ipv6`: which endpoints need libzmq's IPv6 option.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import operator
from collections.abc import Callable
from typing import Any

import structlog
import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.utils.monitor import parse_monitor_message

from kv_listener.sources.common import PublisherAllowList, parse_address
from kv_listener.stats import SourceStats

log = structlog.get_logger(__name__)

#: ZAP domain set on the SUB socket: libzmq >= 4.3 runs ZAP for the NULL mechanism only on
#: sockets that have a domain.
ZAP_DOMAIN = b"continuum-kv-listener"
_MAX_LOGGED_PEERS = 1024
#: Pause before a connecting SUB connects again after libzmq dropped its connection.
_RECONNECT_DELAY_S = 0.1
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                     zmq.EVENT_HANDSHAKE_FAILED_AUTH)
#: The monitor events `watch_connection` reads.
MONITORED = (zmq.EVENT_ACCEPTED | zmq.EVENT_CONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
             | zmq.EVENT_DISCONNECTED | functools.reduce(operator.or_, _HANDSHAKE_FAILED))


class AllowListAuthenticator(AsyncioAuthenticator):
    """ZAP handler that checks the peer address against `PublisherAllowList` (IPs, CIDR
    networks, host names); zmq.auth's own allow-list is exact IP strings only."""

    def __init__(self, context: zmq.asyncio.Context, allow: PublisherAllowList, stats: SourceStats,
                 backend: str, on_refused: asyncio.Event) -> None:
        super().__init__(context)
        self._allow = allow
        self._stats = stats
        self._backend = backend
        self._on_refused = on_refused
        self._logged: set[str] = set()

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        if len(msg) < 6:
            if len(msg) >= 2:
                self._send_zap_reply(msg[1], b"400", b"Not enough frames")
            return
        version, request_id, _domain, address_b, _identity, _mechanism = msg[:6]
        if version != b"1.0":
            self._send_zap_reply(request_id, b"400", b"Invalid version")
            return
        raw = address_b.decode("utf-8", "replace")
        parsed = parse_address(raw)
        address = str(parsed) if parsed is not None else raw
        if await self._allow.check(address):
            self._send_zap_reply(request_id, b"200", b"OK", "anonymous")
            return
        self._stats.publisher_refused()
        if address not in self._logged and len(self._logged) < _MAX_LOGGED_PEERS:
            self._logged.add(address)
            log.warning("zmq_publisher_refused", backend=self._backend, peer=address)
        self._send_zap_reply(request_id, b"400", b"Address not allowed")
        self._on_refused.set()


async def watch_connection(sub: zmq.asyncio.Socket, mon: zmq.asyncio.Socket, *,
                           stats: SourceStats, log: Any, mode: str,
                           endpoint: Callable[[], str | None], max_frame_bytes: int) -> None:
    """Counts the engine's connections (`publishers_connected`: handshakes done and not
    lost yet: what per-source readiness asks for) and lost ones, and, for a connecting SUB
    (`mode`), connects again to `endpoint()` (the endpoint once attached, else None).

    libzmq reconnects by itself after a network error, but not after a protocol error, and a
    frame over ZMQ_MAXMSGSIZE (`max_frame_bytes`) is one (libzmq 4.3
    `session_base_t::engine_error` terminates the session): without this one hostile frame would
    silence the source for good. The batches lost meanwhile show as a sequence gap, filled from
    the replay buffer or cleared. A bound SUB needs nothing: the engine's PUB connects again
    itself. Runs until cancelled; `log` is the source's bound logger."""
    # libzmq names a connection by its file descriptor on ACCEPTED / CONNECTED and
    # DISCONNECTED, but HANDSHAKE_* events carry no descriptor: a handshake's outcome is
    # taken as that of the oldest connection still shaking hands. Handshakes finishing out
    # of order can only mislabel which of two connections got through, for as long as both
    # are up; the counts of handshakes and disconnects stay right.
    shaking: list[int] = []
    peers: set[int] = set()
    try:
        while True:
            frames = await mon.recv_multipart()
            event = parse_monitor_message(frames)
            kind, fd = event["event"], int(event["value"])
            if kind in (zmq.EVENT_ACCEPTED, zmq.EVENT_CONNECTED):
                shaking.append(fd)
                continue
            if kind in _HANDSHAKE_FAILED:
                if shaking:
                    shaking.pop(0)
                continue
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                if shaking:
                    peers.add(shaking.pop(0))
                stats.publishers_now(len(peers))
                log.info("zmq_publisher_connected", endpoint=endpoint(), mode=mode,
                         publishers=len(peers))
                continue
            if kind != zmq.EVENT_DISCONNECTED:
                continue
            if fd in shaking:
                shaking.remove(fd)  # refused by allowed_publishers, or never finished
            else:
                peers.discard(fd)
                stats.publishers_now(len(peers), lost=True)
                log.warning("zmq_disconnected", endpoint=endpoint(), mode=mode,
                            publishers=len(peers), max_frame_bytes=max_frame_bytes)
            attached = endpoint()
            if mode == "connect" and attached is not None:
                await asyncio.sleep(_RECONNECT_DELAY_S)
                # ENOENT when the session is already gone (the protocol-error case)
                with contextlib.suppress(zmq.ZMQError):
                    sub.disconnect(attached)
                sub.connect(attached)
    finally:
        stats.publishers_now(0)
        sub.disable_monitor()
        mon.close(linger=0)


def wants_ipv6(endpoint: str) -> bool:
    """IPv6 literals, wildcards and host names need libzmq's IPv6 option; an IPv4 literal must
    not get it (it would be reported as ::ffff:a.b.c.d). Peers of a dual-stack bind show up as
    IPv4-mapped addresses, which the allow-list unwraps."""
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://"):].rsplit(";", maxsplit=1)[-1].rpartition(":")[0]
    return parse_address(host) is None or ":" in host
