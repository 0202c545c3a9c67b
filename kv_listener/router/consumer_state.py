"""What one event source's consumer reports, and how it waits between attempts (SPEC §8).

Owns the consumer's small shared types: why a connection attempt ended (`ConsumeEndReason`, the
keys of a source's `ended` stats), how it ended (`Attempt`), a source's counters
(`SourceState`), the admin API's per-source view of them (`SourceStatus`, which the admin app
imports from here, not the other way round), and the reconnect delays (`reconnect_backoff`).
No I/O.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kv_listener.backoff import Backoff

#: Backoff cap floor (seed: "max(reconnect_interval_ms, 60s)").
MAX_BACKOFF_FLOOR_S = 60.0


def reconnect_backoff(initial_s: float) -> Backoff:
    """Reconnect delays: `initial_s`, doubling, capped at max(initial_s, 60 s), no jitter."""
    return Backoff(initial_s, max(initial_s, MAX_BACKOFF_FLOOR_S))


class ConsumeEndReason(enum.StrEnum):
    """Why one connection attempt ended. Values are the keys of a source's `ended` stats."""

    DRAINING = "draining"  # the listener restarts: planned, reconnect at once
    BUFFER_OVERFLOW = "buffer_overflow"  # we lagged max_lag records: resume after backoff
    STREAM_ENDED = "stream_ended"  # the peer ended the stream without a control record
    OVERSIZED = "oversized"  # line or data over 1 MiB (or a WebSocket message over its cap)
    HTTP_404 = "http_404"  # the listener does not know this backend (yet)
    HTTP_STATUS = "http_status"  # any other non-200 answer (503 draining / too many clients, ...)
    BAD_CONTENT_TYPE = "bad_content_type"  # 200 but not text/event-stream (a proxy's page)
    CONNECT_ERROR = "connect_error"  # DNS, refused, TLS, reset
    TIMEOUT = "timeout"  # nothing (not even a keep-alive) for read_timeout_s
    NO_SESSION = "no_session"  # event bus: nobody announces the backend yet
    PROTOCOL_ERROR = "protocol_error"  # WebSocket error frame, ...
    ERROR = "error"  # anything else the transport raised


@dataclass(slots=True)
class SourceState:
    """Counters and connection state of one event source (what `stats()` shows)."""

    backend: str
    connected: bool = False
    received: int = 0  # prefix records dispatched by the stream (before validation)
    applied: int = 0  # records `apply_record` accepted
    applied_by_event: Counter[str] = field(default_factory=Counter)  # RecordEvent -> applied
    dropped: Counter[str] = field(default_factory=Counter)  # EventDropReason -> n
    ended: Counter[str] = field(default_factory=Counter)  # ConsumeEndReason -> connection attempts
    last_event_at: float | None = None  # wall clock of the last prefix record received
    reconnect_count: int = 0  # connection attempts after the first, no_session polls excluded
    connections: int = 0  # connections established (HTTP 200, WebSocket open, bus bytes)
    last_event_id: str | None = None  # sent as Last-Event-ID on the next connection
    last_error: str | None = None  # "<ConsumeEndReason>: <detail>" of the last failed attempt
    next_delay_s: float | None = None  # the wait before the next attempt (None: connecting)


@dataclass(frozen=True, slots=True)
class SourceStatus:
    """What the consumer manager reports per event source (the seed's per-source stats)."""

    backend_name: str
    connected: bool = False
    events_received: int = 0
    events_dropped: int = 0
    index_created: int = 0  # cache_created applied
    index_evicted: int = 0  # cache_evicted applied
    reconnect_count: int = 0
    last_event_at: float | None = None  # wall clock (epoch seconds) of the last event
    lease: str = "disabled"  # writer lease: "writer" | "standby" | "disabled" (no lease)
    lease_holder: str | None = None  # the lease's holder id last seen


@dataclass(slots=True)
class Attempt:
    """How one connection attempt ended (what the reconnect loop logs and waits on)."""

    reason: ConsumeEndReason
    detail: str = ""
    delivered: bool = False  # at least one record dispatched on this connection
    connected: bool = False  # the connection was established (HTTP 200, WebSocket open, bus bytes)
    # What the operator acts on (`error`, `errno`, `strerror`, `http_status`): logged as fields.
    error: dict[str, Any] = field(default_factory=dict)

    def error_key(self) -> tuple[Any, ...]:
        """What makes two failures "the same" for the log throttle."""
        e = self.error
        return (self.connected, self.reason, e.get("error"), e.get("errno"), e.get("http_status"))

