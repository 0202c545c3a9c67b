"""CHWBL (`router/chwbl.py`, the seed's Tier 1): placement, the load bound, overflow clockwise,
the owner kept when everyone is full, the model-name fallback, and an even spread."""

from __future__ import annotations

import hashlib
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kv_listener.router.chwbl import HashRing, RingDecision

B = ["vllm-1", "vllm-2", "vllm-3", "vllm-4"]


def key(i: int) -> bytes:
    return hashlib.sha256(f"prefix {i}".encode()).digest()


def test_placement_is_deterministic_and_independent_of_backend_order() -> None:
    a, b = HashRing(B), HashRing(list(reversed(B)))
    assert [a.owner(key(i)) for i in range(200)] == [b.owner(key(i)) for i in range(200)]


def test_150_virtual_nodes_spread_keys_evenly() -> None:
    ring = HashRing(B)
    counts = Counter(ring.owner(key(i)) for i in range(20_000))
    assert set(counts) == set(B)
    assert max(counts.values()) / min(counts.values()) < 1.25, counts


def test_the_bound_is_one_plus_epsilon_times_the_average_with_the_new_request() -> None:
    ring = HashRing(B, epsilon=0.25)
    assert ring.bound({}) == 1  # ceil(1.25 * 1 / 4)
    assert ring.bound(dict.fromkeys(B, 3)) == 5  # ceil(1.25 * 13 / 4) = ceil(4.06)
    assert ring.bound({"vllm-1": 7}) == 3  # ceil(1.25 * 8 / 4) = ceil(2.5)


def test_owner_under_its_bound_takes_the_request() -> None:
    ring = HashRing(B)
    k = key(1)
    choice = ring.select(k, {})
    assert (choice.backend, choice.decision) == (ring.owner(k), RingDecision.PREFIX_HASH)


def test_an_owner_at_its_bound_overflows_clockwise() -> None:
    ring = HashRing(B)
    k = key(2)
    owner = ring.owner(k)
    load = dict.fromkeys(B, 1)
    load[owner] = 3  # bound = ceil(1.25 * 7 / 4) = 3: the owner is full
    choice = ring.select(k, load)
    assert choice.decision is RingDecision.OVERFLOW and choice.backend != owner
    # the next distinct backend clockwise, as the ring orders them
    assert choice.backend == ring._clockwise(int.from_bytes(k[:8], "big"))[1]


@given(loads=st.lists(st.integers(0, 50), min_size=4, max_size=4),
       eps=st.sampled_from([0.0, 0.1, 0.25, 1.0]), i=st.integers(0, 1000))
def test_a_choice_never_exceeds_the_bound(loads: list[int], eps: float, i: int) -> None:
    # With the new request counted, some backend is always under the bound (n * bound >=
    # (1 + eps) * (total + 1) > total), so the owner-when-everyone-is-full case never arises
    # and the chosen backend ends at most at the bound.
    ring = HashRing(B, epsilon=eps)
    load = dict(zip(B, loads, strict=True))
    choice = ring.select(key(i), load)
    assert load[choice.backend] + 1 <= ring.bound(load)


def test_no_prefix_key_hashes_the_model_without_a_bound() -> None:
    ring = HashRing(B)
    first = ring.select(None, {}, model="llama")
    busy = ring.select(None, {first.backend: 1000}, model="llama")
    assert first.decision is RingDecision.FALLBACK and busy.backend == first.backend


def test_rejects_bad_rings() -> None:
    with pytest.raises(ValueError):
        HashRing([])
    with pytest.raises(ValueError):
        HashRing(["a", "a"])
    with pytest.raises(ValueError):
        HashRing(["a"], virtual_nodes=0)
    with pytest.raises(ValueError):
        HashRing(["a"], epsilon=-1)
