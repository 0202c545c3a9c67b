"""What both sources share: the queue feeder and the publisher allow-list.

`QueueFeeder` is the only way a source puts items on its bounded queue: a live item never waits
for the consumer (`put_nowait`); when the queue is full (in batches, in the token IDs its batches
hold: `MAX_QUEUED_TOKENS`, counted in `stats.queued_tokens`, or in their block hashes:
`MAX_QUEUED_HASHES`, `stats.queued_hashes`; the runtime's pump lowers both with
`QueueFeeder.taken` as it takes them) the item is dropped and counted, and once there is room again a
`SourceCleared(OVERFLOW)` goes in before anything else, so a loss is never silent: the pump makes
the room and calls `QueueFeeder.flush`, so the clear goes in even when no item follows. Batches a
source already holds and nothing else waits on (a replay's answer, the live batches kept during
it) go in with `put_waiting` instead, which waits for room: a replay of the engine's whole buffer
(vLLM: 10,000 batches) would otherwise overflow the queue and clear what it was rebuilding.

`PublisherAllowList` answers "may this peer address publish to this source?" for the entries of
`allowed_publishers`: IP addresses, CIDR networks, and host names (resolved with the event loop's
resolver, refreshed at most every `refresh_s` when an unknown address shows up).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from collections.abc import Iterable

import structlog

from kv_listener.core.limits import batch_weight
from kv_listener.core.model import ClearReason, EventBatch, SourceCleared, SourceItem
from kv_listener.core.sequence import SourceDropReason
from kv_listener.stats import SourceStats

log = structlog.get_logger(__name__)

#: Token IDs that the batches waiting in one source's queue may hold together (4 bytes each:
#: 16 MiB), whatever the number of batches.
MAX_QUEUED_TOKENS = 1 << 22
#: Block hashes, stored or removed, that they may hold together (a tuple slot and a 64-bit int
#: each, about 48 bytes decoded: 12 MiB). A removal carries no token IDs: before this bound a
#: queue of 10,000 batches of 8 MiB removal frames was bounded by nothing else.
MAX_QUEUED_HASHES = 1 << 18


IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class QueueFeeder:
    """Puts a source's items on its bounded queue: live ones without ever blocking, those it
    holds already waiting for room (see module doc).

    One per source runtime, shared by the source (and the sources that replace it after a
    crash) and the runtime's own clears; the pump calls `flush` each time it takes items, so a
    clear the full queue could not take goes in as soon as there is room, even when nothing is
    put after it (an engine that went quiet or died right after the loss)."""

    __slots__ = ("_backend", "_max_hashes", "_max_tokens", "_pending", "_pending_counted",
                 "_queue", "_room", "_stats")

    def __init__(self, queue: asyncio.Queue[SourceItem], stats: SourceStats, backend: str,
                 max_tokens: int = MAX_QUEUED_TOKENS, max_hashes: int = MAX_QUEUED_HASHES) -> None:
        self._queue = queue
        self._stats = stats
        self._backend = backend
        self._max_tokens = max_tokens
        self._max_hashes = max_hashes
        #: the clear the queue owes the tracker (None: none); a later loss is covered by it
        self._pending: ClearReason | None = None
        self._pending_counted = False  # its reason is already in stats.clears
        self._room = asyncio.Event()  # set when the pump takes an item (`taken`)

    @property
    def overflowed(self) -> bool:
        """True while a clear is owed: items are being dropped until it is queued."""
        return self._pending is not None

    def put(self, item: SourceItem) -> bool:
        """Queue `item` (after the pending clear, if any). False when it was dropped."""
        stats = self._stats
        if not self.flush():
            self._drop(item)
            return False
        n, h = batch_weight(item)
        try:
            if self._over(n, h):
                raise asyncio.QueueFull
            self._queue.put_nowait(item)
        except asyncio.QueueFull:
            self._owe(ClearReason.OVERFLOW, counted=False)
            log.warning("source_queue_full", backend=self._backend, maxsize=self._queue.maxsize,
                        queued_tokens=stats.queued_tokens, queued_hashes=stats.queued_hashes)
            self._drop(item)
            return False
        stats.queued(n, h)
        if isinstance(item, SourceCleared):
            stats.cleared(item.reason.value)
        return True

    async def put_waiting(self, item: SourceItem) -> None:
        """Queue `item`, waiting for room instead of dropping it (after the clear owed, if any):
        for batches the source holds in memory already, bounded by its receive budget, while
        the engine keeps the ones behind them. Room in token IDs and hashes is made by the pump
        (`taken`), room in count by any `get`."""
        n, h = batch_weight(item)
        while self._over(n, h):
            self._room.clear()
            await self._room.wait()
        reason = self._pending
        if reason is not None:
            counted = self._pending_counted
            self._pending = None  # claimed: `flush` must not queue it a second time meanwhile
            try:
                await self._queue.put(SourceCleared(reason))
            except BaseException:
                self._owe(reason, counted=counted)  # cancelled before it went in: still owed
                raise
            self._owed_clear_queued(reason, counted=counted)
        await self._queue.put(item)
        self._stats.queued(n, h)

    def taken(self, item: SourceItem) -> None:
        """The pump took `item` off the queue: its token IDs and hashes no longer count, and a
        `put_waiting` may go on."""
        n, h = batch_weight(item)
        self._stats.queued(-n, -h)
        self._room.set()

    def _over(self, n: int, h: int) -> bool:
        # Past a bound of tokens or hashes; an item alone in the queue is always taken (the
        # per-frame caps bound it).
        stats = self._stats
        return bool((n and stats.queued_tokens and stats.queued_tokens + n > self._max_tokens)
                    or (h and stats.queued_hashes and stats.queued_hashes + h > self._max_hashes))

    def put_clear(self, reason: ClearReason) -> None:
        """A clear decided outside the source (its engine down, the source restarted): counted
        now; queued now, or by `flush` as soon as the queue has room."""
        self._stats.cleared(reason.value)
        if self._pending is None:
            try:
                self._queue.put_nowait(SourceCleared(reason))
                return
            except asyncio.QueueFull:
                pass
        self._owe(reason, counted=True)

    def flush(self) -> bool:
        """Queue the clear owed, if there is room. True when no clear is owed any more."""
        reason = self._pending
        if reason is None:
            return True
        try:
            self._queue.put_nowait(SourceCleared(reason))
        except asyncio.QueueFull:
            return False
        self._pending = None
        self._owed_clear_queued(reason, counted=self._pending_counted)
        return True

    def _owed_clear_queued(self, reason: ClearReason, *, counted: bool) -> None:
        if not counted:
            self._stats.cleared(reason.value)
        if reason is ClearReason.OVERFLOW:
            log.warning("source_overflow_cleared", backend=self._backend)

    def _owe(self, reason: ClearReason, *, counted: bool) -> None:
        # One clear covers every loss before it: the first reason owed is the one queued.
        if self._pending is None:
            self._pending, self._pending_counted = reason, counted

    def _drop(self, item: SourceItem) -> None:
        # A dropped SourceCleared needs no count of its own: the clear owed supersedes it.
        if isinstance(item, EventBatch):
            self._stats.dropped(SourceDropReason.QUEUE_OVERFLOW.value, max(1, len(item.events)))


def parse_address(text: str) -> IPAddress | None:
    """A peer address as ZMQ/asyncio report it -> an IP (IPv4-mapped IPv6 unwrapped), or None."""
    text = text.strip().strip("[]")
    text = text.split("%", 1)[0]  # IPv6 zone id
    try:
        addr = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


class PublisherAllowList:
    """`allowed_publishers` as a matcher of peer IP addresses."""

    def __init__(self, entries: Iterable[str], *, refresh_s: float = 30.0) -> None:
        self.networks: list[IPNetwork] = []
        self.names: list[str] = []
        for entry in entries:
            try:
                self.networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                self.names.append(entry.lower())
        self._resolved: frozenset[IPAddress] = frozenset()
        self._resolved_at: float | None = None
        self._refresh_s = refresh_s

    def allows(self, address: str) -> bool:
        addr = parse_address(address)
        if addr is None:
            return False
        if any(addr in net for net in self.networks):
            return True
        return addr in self._resolved

    def stale(self) -> bool:
        """Host names are listed and were not resolved within `refresh_s`."""
        if not self.names:
            return False
        return self._resolved_at is None or time.monotonic() - self._resolved_at >= self._refresh_s

    async def refresh(self, timeout_s: float = 5.0) -> None:
        """Resolve the host names (failures are logged and leave that name matching nothing)."""
        if not self.names:
            return
        loop = asyncio.get_running_loop()
        resolved: set[IPAddress] = set()
        for name in self.names:
            try:
                async with asyncio.timeout(timeout_s):
                    infos = await loop.getaddrinfo(name, None, type=socket.SOCK_STREAM)
            except (OSError, TimeoutError) as exc:
                log.warning("publisher_name_unresolved", host=name, error=type(exc).__name__)
                continue
            for info in infos:
                addr = parse_address(str(info[4][0]))
                if addr is not None:
                    resolved.add(addr)
        self._resolved = frozenset(resolved)
        self._resolved_at = time.monotonic()

    async def check(self, address: str) -> bool:
        """`allows`, re-resolving the host names first when they are stale and the address is
        not (yet) known."""
        if self.allows(address):
            return True
        if self.stale():
            await self.refresh()
            return self.allows(address)
        return False
