"""Consistent hashing with bounded loads (CHWBL): the seed's Tier 1, `PrefixAwareHash`.

A prefix key is hashed onto a ring holding `virtual_nodes` points per backend (150 by default,
for an even spread); the request goes to the first backend clockwise whose in-flight load is
under the bound `ceil((1 + epsilon) * (total_in_flight + 1) / backends)` (epsilon 0.25: a
backend may carry at most 25% over the average, the new request counted). When the owner is at
its bound the request overflows to the next backend clockwise (`overflow`). The seed lets the owner
take it when every backend is at its bound; with the new request counted in the average that
cannot happen (n x bound >= (1 + epsilon) x (total + 1) > total), the rule is kept all the same.
A request without a prefix key hashes the model name and takes the first backend clockwise, no
bound applied (`fallback`): every request of that model lands on one backend.

Ring points are the first 8 bytes of SHA-256 over `"<backend>#<i>"`; keys are placed with the
first 8 bytes of their 32-byte prefix key (already a SHA-256 digest) or of SHA-256 over the model
name. The placement is deterministic across processes and restarts. Pure: no I/O, no clock.
"""

from __future__ import annotations

import bisect
import enum
import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

DEFAULT_VIRTUAL_NODES = 150
DEFAULT_EPSILON = 0.25


class RingDecision(enum.StrEnum):
    """`continuum_prefix_routing_requests_total{strategy}` of the seed."""

    PREFIX_HASH = "prefix_hash"  # the key's owner took it (under its bound, or everyone full)
    OVERFLOW = "overflow"  # the owner was at its bound: the next one clockwise took it
    FALLBACK = "fallback"  # no prefix key: the model name's point, no bound


@dataclass(frozen=True, slots=True)
class RingChoice:
    backend: str
    decision: RingDecision


def _point(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")


class HashRing:
    """The ring over `backends` (order does not matter; names must be unique)."""

    def __init__(self, backends: Sequence[str], *, virtual_nodes: int = DEFAULT_VIRTUAL_NODES,
                 epsilon: float = DEFAULT_EPSILON) -> None:
        if not backends:
            raise ValueError("a ring needs at least one backend")
        if len(set(backends)) != len(backends):
            raise ValueError("backend names must be unique")
        if virtual_nodes < 1:
            raise ValueError("virtual_nodes must be at least 1")
        if epsilon < 0:
            raise ValueError("epsilon must not be negative")
        self.backends = tuple(backends)
        self.virtual_nodes = virtual_nodes
        self.epsilon = epsilon
        points = sorted((_point(f"{b}#{i}".encode()), b)
                        for b in self.backends for i in range(virtual_nodes))
        self._points = [p for p, _ in points]
        self._owners = [b for _, b in points]

    def _clockwise(self, position: int) -> list[str]:
        """Distinct backends in ring order from `position` (the owner first)."""
        start = bisect.bisect_left(self._points, position) % len(self._points)
        seen: list[str] = []
        n = len(self._owners)
        for i in range(n):
            b = self._owners[(start + i) % n]
            if b not in seen:
                seen.append(b)
                if len(seen) == len(self.backends):
                    break
        return seen

    def bound(self, in_flight: Mapping[str, int]) -> int:
        """The most requests one backend may hold, the new request counted."""
        total = sum(in_flight.get(b, 0) for b in self.backends) + 1
        return max(1, math.ceil((1 + self.epsilon) * total / len(self.backends)))

    def owner(self, prefix_key: bytes) -> str:
        return self._clockwise(int.from_bytes(prefix_key[:8], "big"))[0]

    def select(self, prefix_key: bytes | None, in_flight: Mapping[str, int],
               model: str = "") -> RingChoice:
        """The backend for a request with `prefix_key` (None: hash `model`, no bound), given
        each backend's requests in flight now."""
        if prefix_key is None:
            return RingChoice(self._clockwise(_point(model.encode()))[0], RingDecision.FALLBACK)
        order = self._clockwise(int.from_bytes(prefix_key[:8], "big"))
        cap = self.bound(in_flight)
        for i, b in enumerate(order):
            if in_flight.get(b, 0) < cap:
                return RingChoice(b, RingDecision.PREFIX_HASH if i == 0 else RingDecision.OVERFLOW)
        return RingChoice(order[0], RingDecision.PREFIX_HASH)
