"""The writer lease: one writer per backend among the routers sharing one Redis index (issue 16).

Owns: the lease in Redis (`WriterLease`), the per-backend lease states and their one transition
table (`LeaseState`, `LeaseEvent`, `TRANSITIONS`, `step`), and the per-backend loop that takes,
keeps and gives back the lease (`LeaseKeeper`). What "writing" means (running the backend's
consumer) is the caller's: the keeper calls `on_acquired()` and `on_lost()`
(`router.consumer.KvEventConsumerManager` starts and stops the source's runner).

The lease is the key `<key_prefix>lease:<backend>` holding the holder id
(`kv_cache_index.writer_lease.holder_id`, default host:pid:random). Single-key commands and
single-key scripts only, so it works the same on one `redis-server` and on a Redis Cluster
(`redis.asyncio.Redis` or `redis.asyncio.cluster.RedisCluster`):
- acquire: `SET key holder NX PX ttl_ms`; refused, it renews instead (already ours: still ours);
- renew: a script, compare-and-`PEXPIRE`; a key that is gone (a clear of the key prefix, a Redis
  restarted empty) is set again, since nobody else holds it; another holder is reported;
- release: a script, compare-and-`DEL` (only the holder's own key goes);
- holder: `GET`.

Timing (`ttl_ms`, `renew_interval_ms` <= ttl_ms / 2): a writer renews every renew interval. A
renewal that finds another holder stops writing at once (`lost`, reason `taken`). A renewal that
fails (a Redis error, or no answer within what is left of the lease) keeps writing until the
lease's validity since the last good renewal has passed (`ttl` minus a drift margin, timed from
when that renewal was *sent*, so it ends before the key can expire in Redis), then stops
(`lost`, reason `expired`). A standby tries to acquire every renew interval, so a dead writer's
backend moves within ttl + renew interval (+ one round trip).

Push mode (SPEC §7): a backend whose source is `transport: event_bus` can only be read by the
router that holds a listener session announcing it, so a router contends for that backend's
lease only while one of its live sessions announces it (`gate.wait_eligible()`, the event bus's
`wait_announced`), and a writer whose session goes away gives the lease back at once (checked
every `GATE_POLL_S`), so that the router the listener reconnected to takes over without waiting
for the ttl. The writer is therefore always a router that can open the stream. The same gate
closes while the router's index is in its in-memory fallback (`index_fallback`): such a router
cannot write the shared index, so it neither contends nor keeps a lease.

Logs (`backend`, `holder_id`, never a secret): `kv_writer_lease_acquired` (`previous_holder`
when one was seen), `kv_writer_lease_lost` (`reason` taken | expired, `holder` when known),
`kv_writer_lease_released` (`reason` shutdown | source_removed | no_session | index_fallback),
and, throttled, `kv_writer_lease_redis_error`.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import structlog

from kv_listener.router.config_redis import WriterLeaseConfig, default_holder_id
from kv_listener.router.oplog import LOG_REPEAT_INTERVAL_S, LogThrottle, error_fields
from kv_listener.router.redis_store import LEASE_KEYS, REDIS_ERRORS

log = structlog.get_logger(__name__)

#: How often a writer checks its gate (a session still announces the backend, the index is not in
#: its fallback).
GATE_POLL_S = 0.1
#: The part of the ttl a writer does not rely on (clock drift between it and Redis), plus 2 ms
#: (the round trip's own share), as Redlock reckons it.
DRIFT_FACTOR = 0.01

_RENEW = """
local cur = redis.call('GET', KEYS[1])
if cur == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {1, cur}
end
if not cur then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return {1, ARGV[1]}
end
return {0, cur}
"""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


def _str(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


@dataclass(frozen=True, slots=True)
class LeaseResult:
    held: bool  # this router holds the lease now
    holder: str | None  # who holds it (this router's id when held; None: nobody)


class WriterLease:
    """The backends' leases in Redis for one holder (see the module docstring)."""

    def __init__(self, client: Any, *, key_prefix: str, holder_id: str, ttl_ms: int,
                 renew_interval_ms: int) -> None:
        self.client = client  # redis.asyncio.Redis or redis.asyncio.cluster.RedisCluster
        self.key_prefix = key_prefix
        self.holder_id = holder_id
        self.ttl_ms = ttl_ms
        self.renew_interval_ms = renew_interval_ms

    @classmethod
    def from_config(cls, client: Any, key_prefix: str, config: WriterLeaseConfig) -> WriterLease:
        return cls(client, key_prefix=key_prefix,
                   holder_id=config.holder_id or default_holder_id(), ttl_ms=config.ttl_ms,
                   renew_interval_ms=config.renew_interval_ms)

    @property
    def ttl_s(self) -> float:
        return self.ttl_ms / 1000.0

    @property
    def renew_interval_s(self) -> float:
        return self.renew_interval_ms / 1000.0

    @property
    def validity_s(self) -> float:
        """How long after sending a good renewal this holder may rely on the lease."""
        return self.ttl_s * (1 - DRIFT_FACTOR) - 0.002

    def key(self, backend: str) -> str:
        return f"{self.key_prefix}{LEASE_KEYS}{backend}"

    async def acquire(self, backend: str) -> LeaseResult:
        """Take the lease when nobody holds it (or renew it when this holder does). Raises the
        Redis error."""
        if await self.client.set(self.key(backend), self.holder_id, nx=True, px=self.ttl_ms):
            return LeaseResult(True, self.holder_id)
        return await self.renew(backend)

    async def renew(self, backend: str) -> LeaseResult:
        """Extend this holder's lease by the ttl; not held: who holds it. Raises."""
        held, holder = await self.client.eval(_RENEW, 1, self.key(backend), self.holder_id,
                                              self.ttl_ms)
        return LeaseResult(int(held) == 1, _str(holder))

    async def release(self, backend: str) -> bool:
        """Delete the lease if this holder holds it; True when it did. Raises."""
        return int(await self.client.eval(_RELEASE, 1, self.key(backend), self.holder_id)) == 1

    async def holder(self, backend: str) -> str | None:
        value = await self.client.get(self.key(backend))
        return None if value is None else _str(value)


# --- the state machine ---------------------------------------------------------------------


class LeaseState(enum.StrEnum):
    STANDBY = "standby"  # not the writer: contending when eligible
    ACQUIRING = "acquiring"  # an acquire is in flight
    WRITER = "writer"  # holds the lease: the backend's consumer runs here


class LeaseEvent(enum.StrEnum):
    ATTEMPT = "attempt"  # a standby asks for the lease
    GRANTED = "granted"  # it is ours
    REFUSED = "refused"  # another router holds it
    FAILED = "failed"  # Redis failed the acquire
    RENEWED = "renewed"
    RENEW_FAILED = "renew_failed"  # Redis failed a renewal; the lease is still valid
    TAKEN = "taken"  # a renewal found another holder
    EXPIRED = "expired"  # no good renewal for the lease's validity
    RELEASED = "released"  # given back: shutdown, source removed, bus session gone


S, E = LeaseState, LeaseEvent
#: Every legal (state, event) -> state; anything else is a bug (`step` raises).
TRANSITIONS: dict[tuple[LeaseState, LeaseEvent], LeaseState] = {
    (S.STANDBY, E.ATTEMPT): S.ACQUIRING,
    (S.ACQUIRING, E.GRANTED): S.WRITER,
    (S.ACQUIRING, E.REFUSED): S.STANDBY,
    (S.ACQUIRING, E.FAILED): S.STANDBY,
    (S.ACQUIRING, E.RELEASED): S.STANDBY,  # cancelled mid-acquire: the SET may have landed
    (S.WRITER, E.RENEWED): S.WRITER,
    (S.WRITER, E.RENEW_FAILED): S.WRITER,
    (S.WRITER, E.TAKEN): S.STANDBY,
    (S.WRITER, E.EXPIRED): S.STANDBY,
    (S.WRITER, E.RELEASED): S.STANDBY,
}
del S, E


class LeaseStateError(RuntimeError):
    """A (state, event) pair `TRANSITIONS` does not list."""


def step(state: LeaseState, event: LeaseEvent) -> LeaseState:
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise LeaseStateError(f"no transition from {state.value} on {event.value}") from None


# --- the keeper ------------------------------------------------------------------------------


class WriterGate(Protocol):
    """Whether this router may contend for a backend's lease (push mode: a session announces it)."""

    def eligible(self) -> bool: ...

    def closed_reason(self) -> str | None:
        """Why the gate is closed (logged as the release's `reason`); None: it is open."""
        ...

    async def wait_eligible(self) -> None: ...


class AlwaysEligible:
    """The gate of a backend this router reads itself (sse, ws): always open."""

    def eligible(self) -> bool:
        return True

    def closed_reason(self) -> str | None:
        return None

    async def wait_eligible(self) -> None:
        return None


Callback = Callable[[], Awaitable[None]]
Sleep = Callable[[float], Awaitable[None]]


class LeaseKeeper:
    """One backend's lease loop: standby -> acquiring -> writer -> standby (`TRANSITIONS`).

    `on_acquired()` is awaited when this router becomes the writer, `on_lost()` when it stops
    being one (taken, expired, released: before the key is deleted, so nothing is written after
    the release). `gate` says when to contend. `monotonic` and `sleep` are injectable.
    """

    def __init__(self, lease: WriterLease, backend: str, *, on_acquired: Callback,
                 on_lost: Callback, gate: WriterGate | None = None,
                 monotonic: Callable[[], float] = time.monotonic, sleep: Sleep = asyncio.sleep,
                 log_repeat_interval_s: float = LOG_REPEAT_INTERVAL_S) -> None:
        self.lease = lease
        self.backend = backend
        self.on_acquired = on_acquired
        self.on_lost = on_lost
        self.gate: WriterGate = gate if gate is not None else AlwaysEligible()
        self.monotonic = monotonic
        self.sleep = sleep
        self.state = LeaseState.STANDBY
        self.holder: str | None = None  # the holder last seen (this router's id while writer)
        self.task: asyncio.Task[None] | None = None
        self._last_good: float = 0.0  # when the last good acquire/renewal was sent
        self._next_renew: float = 0.0
        self._errors = LogThrottle(log_repeat_interval_s, monotonic)
        self.log = log.bind(backend=backend, holder_id=lease.holder_id)

    @property
    def is_writer(self) -> bool:
        return self.state is LeaseState.WRITER

    def _step(self, event: LeaseEvent) -> None:
        self.state = step(self.state, event)

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(
            self.run(), name=f"kv-writer-lease-{self.backend}")

    async def close(self, reason: str) -> None:
        """Stop the loop and give the lease back (`reason` is logged)."""
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
            self.task = None
        await self.release(reason)

    async def run(self) -> None:
        task = asyncio.current_task()
        while True:
            if task is not None and task.cancelling():
                # A cancellation an await swallowed (CPython 3.11's asyncio.wait_for does when
                # the renewal completes as the cancel arrives) ends the loop here, at the latest
                # one renew interval later: close() waits for this task.
                raise asyncio.CancelledError
            if self.state is LeaseState.WRITER:
                await self._hold()
            else:
                await self._contend()

    async def _contend(self) -> None:
        await self.gate.wait_eligible()
        self._step(LeaseEvent.ATTEMPT)
        sent = self.monotonic()
        try:
            result = await self.lease.acquire(self.backend)
        except REDIS_ERRORS as exc:
            self._step(LeaseEvent.FAILED)
            self._redis_error("acquire", exc)
            await self.sleep(self.lease.renew_interval_s)
            return
        if not result.held:
            self._step(LeaseEvent.REFUSED)
            self.holder = result.holder
            await self.sleep(self.lease.renew_interval_s)
            return
        previous = self.holder if self.holder != self.lease.holder_id else None
        self._step(LeaseEvent.GRANTED)
        self.holder = self.lease.holder_id
        self._last_good = sent
        self._next_renew = sent + self.lease.renew_interval_s
        self._errors.reset()
        self.log.info("kv_writer_lease_acquired", previous_holder=previous,
                      ttl_ms=self.lease.ttl_ms)
        await self.on_acquired()

    async def _hold(self) -> None:
        valid_until = self._last_good + self.lease.validity_s
        now = self.monotonic()
        if now >= valid_until:
            self._step(LeaseEvent.EXPIRED)
            self.log.warning("kv_writer_lease_lost", reason="expired",
                             since_last_renewal_s=round(now - self._last_good, 3))
            await self.on_lost()
            return
        wake = min(self._next_renew, valid_until)
        if wake > now:
            if (closed := await self._closed_within(wake - now)) is not None:
                await self.release(closed)
            return
        try:
            result = await asyncio.wait_for(self.lease.renew(self.backend), valid_until - now)
        except REDIS_ERRORS as exc:  # TimeoutError is an OSError
            self._step(LeaseEvent.RENEW_FAILED)
            self._redis_error("renew", exc)
            self._next_renew = min(self.monotonic() + self.lease.renew_interval_s, valid_until)
            return
        if result.held:
            self._step(LeaseEvent.RENEWED)
            self._last_good = now
            self._next_renew = now + self.lease.renew_interval_s
            return
        self._step(LeaseEvent.TAKEN)
        self.holder = result.holder
        self.log.warning("kv_writer_lease_lost", reason="taken", holder=result.holder)
        await self.on_lost()

    async def _closed_within(self, delay_s: float) -> str | None:
        """Wait `delay_s`; the gate's reason as soon as it closes meanwhile (None: it did not)."""
        if isinstance(self.gate, AlwaysEligible):
            await self.sleep(delay_s)
            return None
        deadline = self.monotonic() + delay_s
        while (left := deadline - self.monotonic()) > 0:
            if (reason := self.gate.closed_reason()) is not None:
                return reason
            await self.sleep(min(GATE_POLL_S, left))
        return self.gate.closed_reason()

    async def release(self, reason: str) -> None:
        """Stop writing, then delete the lease if it is ours. A no-op for a standby."""
        if self.state is LeaseState.STANDBY:
            return
        await self.on_lost()
        try:
            await self.lease.release(self.backend)
        except REDIS_ERRORS as exc:  # it expires by itself after the ttl
            self.log.warning("kv_writer_lease_release_failed", reason=reason, **error_fields(exc))
        self._step(LeaseEvent.RELEASED)
        self.holder = None
        self.log.info("kv_writer_lease_released", reason=reason)

    def _redis_error(self, op: str, exc: BaseException) -> None:
        fields = error_fields(exc)
        held = self._errors.check((op, fields["error"], fields.get("errno")))
        if held is not None:
            self.log.warning("kv_writer_lease_redis_error", op=op, state=self.state.value,
                             suppressed=held, **fields)
