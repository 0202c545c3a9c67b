"""Prometheus metrics of the companion router, with the seed's names and labels.

Owns: the metric objects on a caller-given `CollectorRegistry` (tests and embedding routers use
their own registry, so two routers in one process do not collide) and the allow-lists their label
values come from. A label value outside its allow-list is folded into `other` (backend) or refused
(the enum-typed labels), so a hostile stream cannot grow the series count.

- `continuum_kv_index_routing_decisions_total{decision, tier}`: once per selection the scorer ran
  for (a request with a prefix key); decision `kv_aware` | `fallback`, tier `gpu_hot` |
  `storage_warm` | `none` (the chosen holder's tier; `none` for fallback).
- `continuum_kv_index_overlap_score`: histogram of the best composite score of `kv_aware` decisions.
- `continuum_kv_event_dropped_total{backend, reason}`: prefix events the consumer could not apply.
- `continuum_kv_consumer_connected{backend}`: 1 while the backend's event stream is connected.
- `continuum_cache_fallback_active`: 1 while the Redis index runs on its in-memory fallback.
- `continuum_kv_writer_lease_held{backend}`: 1 while this router holds the backend's writer lease
  (`kv_cache_index.writer_lease`, issue 16), so it consumes that stream and writes the shared
  index; 0 on a standby, and always 0 without the lease.
- `continuum_kv_admin_auth_failures_total{reason}`: admin requests refused with 401 (`admin.auth`
  set); reason `missing` (no authorization header) | `malformed` (not `Bearer <token>`) |
  `invalid` (a token no `admin.auth.tokens[]` entry has). Zero for ever without `admin.auth`.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

OTHER_BACKEND = "other"


class Decision(enum.StrEnum):
    KV_AWARE = "kv_aware"
    FALLBACK = "fallback"


class TierLabel(enum.StrEnum):
    """Tier label of a routing decision: the seed's `gpu_hot`, `storage_warm`, `none`."""

    GPU_HOT = "gpu_hot"
    STORAGE_WARM = "storage_warm"
    NONE = "none"


class EventDropReason(enum.StrEnum):
    """Why the consumer dropped one prefix event. Values are the `reason` label."""

    MALFORMED_JSON = "malformed_json"  # data: is not a JSON object
    UNKNOWN_EVENT = "unknown_event"  # event type not one of the four prefix events
    INVALID_FIELD = "invalid_field"  # prefix_hash / token_count / tier missing or malformed
    BACKEND_MISMATCH = "backend_mismatch"  # data.backend names another backend than the stream
    OVERSIZED = "oversized"  # line or record over 1 MiB: stream closed and resumed
    INDEX_ERROR = "index_error"  # the index could not apply it (Redis down without fallback)


class AuthFailure(enum.StrEnum):
    """Why an admin request was refused (401). Values are the `reason` label."""

    MISSING = "missing"  # no authorization header
    MALFORMED = "malformed"  # a header, but not `Bearer <token>`
    INVALID = "invalid"  # a bearer token that matches no admin.auth.tokens[] entry


# Composite scores live in [0, 1]; the interesting region is above the 0.3 pool threshold.
OVERLAP_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


def _backend_state(registry: CollectorRegistry, name: str, documentation: str) -> Gauge:
    """A 0/1 gauge by backend; `RouterMetrics` pre-creates each backend's series at 0 and
    removes it with the backend (`_backend_states`)."""
    return Gauge(name, documentation, ["backend"], registry=registry)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry, backends: Iterable[str] = ()) -> None:
        self.backends = frozenset(backends)
        self.routing_decisions = Counter(
            "continuum_kv_index_routing_decisions",
            "Selections the KV-index scorer ran for, by decision and tier of the chosen holder.",
            ["decision", "tier"], registry=registry,
        )
        self.overlap_score = Histogram(
            "continuum_kv_index_overlap_score",
            "Best composite score (overlap + load + health) of kv_aware decisions.",
            buckets=OVERLAP_BUCKETS, registry=registry,
        )
        self.event_dropped = Counter(
            "continuum_kv_event_dropped",
            "Prefix events dropped by the router's consumer, by backend and reason.",
            ["backend", "reason"], registry=registry,
        )
        self.consumer_connected = _backend_state(
            registry, "continuum_kv_consumer_connected",
            "1 while the backend's prefix event stream is connected.")
        self.lease_held = _backend_state(
            registry, "continuum_kv_writer_lease_held",
            "1 while this router holds the backend's writer lease (it writes the shared index).")
        self._backend_states = (self.consumer_connected, self.lease_held)
        self.fallback_active = Gauge(
            "continuum_cache_fallback_active",
            "1 while the Redis KV index serves from its in-memory fallback.",
            registry=registry,
        )
        self.admin_auth_failures = Counter(
            "continuum_kv_admin_auth_failures",
            "Admin API requests refused with 401, by reason.",
            ["reason"], registry=registry,
        )
        for reason in AuthFailure:
            self.admin_auth_failures.labels(reason=reason.value)
        # Pre-create the series an alert looks at (`continuum_kv_consumer_connected == 0`
        # must fire for a consumer that never connected, not be absent).
        for b in sorted(self.backends):
            self._add_backend(b)
        for d in Decision:
            for t in TierLabel:
                if d is Decision.FALLBACK and t is not TierLabel.NONE:
                    continue
                self.routing_decisions.labels(decision=d.value, tier=t.value)
        self.fallback_active.set(0)

    def set_backends(self, backends: Iterable[str]) -> None:
        """Replace the backend allow-list (a config reload added or removed event sources): a new
        backend gets its `continuum_kv_consumer_connected` series at 0, a removed one loses it
        (an alert on `== 0` must not fire for a backend that is gone). Counters are kept."""
        new = frozenset(backends)
        for b in sorted(self.backends - new):
            for gauge in self._backend_states:
                with contextlib.suppress(KeyError):
                    gauge.remove(b)
        for b in sorted(new - self.backends):
            self._add_backend(b)
        self.backends = new

    def _add_backend(self, backend: str) -> None:
        for gauge in self._backend_states:
            gauge.labels(backend=backend).set(0)
        # Every drop series exists from the start at 0, so `increase()` sees the first drop
        # (a series born at 1 has no earlier sample to rise from).
        for reason in EventDropReason:
            self.event_dropped.labels(backend=backend, reason=reason.value)

    def _backend(self, backend: str) -> str:
        return backend if backend in self.backends else OTHER_BACKEND

    def record_decision(self, decision: Decision, tier: TierLabel, score: float) -> None:
        self.routing_decisions.labels(decision=Decision(decision).value,
                                      tier=TierLabel(tier).value).inc()
        if decision is Decision.KV_AWARE:
            self.overlap_score.observe(score)

    def event_dropped_inc(self, backend: str, reason: EventDropReason, n: int = 1) -> None:
        self.event_dropped.labels(backend=self._backend(backend),
                                  reason=EventDropReason(reason).value).inc(n)

    def set_connected(self, backend: str, connected: bool) -> None:
        self.consumer_connected.labels(backend=self._backend(backend)).set(1 if connected else 0)

    def set_lease_held(self, backend: str, held: bool) -> None:
        """Label values are configured backends only: a lease of another name is not shown."""
        if backend in self.backends:
            self.lease_held.labels(backend=backend).set(1 if held else 0)

    def set_fallback_active(self, active: bool) -> None:
        self.fallback_active.set(1 if active else 0)

    def admin_auth_failed(self, reason: AuthFailure) -> None:
        self.admin_auth_failures.labels(reason=AuthFailure(reason).value).inc()
