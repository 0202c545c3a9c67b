"""The one retry delay policy (kv_listener.backoff): doubling, cap, reset, jitter bounds."""

from __future__ import annotations

import pytest

from kv_listener.backoff import Backoff


def test_doubles_to_the_cap_and_resets() -> None:
    b = Backoff(0.5, 3.0)
    assert [b.next_delay() for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert b.failures == 5
    b.reset()
    assert (b.failures, b.peek_s, b.next_delay()) == (0, 0.5, 0.5)


def test_jitter_only_shortens_and_uses_the_injected_source() -> None:
    lo = Backoff(1.0, 8.0, jitter=0.25, rng=lambda: 1.0)
    hi = Backoff(1.0, 8.0, jitter=0.25, rng=lambda: 0.0)
    assert [lo.next_delay() for _ in range(5)] == [0.75, 1.5, 3.0, 6.0, 6.0]
    assert [hi.next_delay() for _ in range(5)] == [1.0, 2.0, 4.0, 8.0, 8.0]


@pytest.mark.parametrize(("initial", "cap", "jitter"), [(0.0, 1.0, 0.0), (2.0, 1.0, 0.0), (1.0, 2.0, 1.0)])
def test_nonsense_is_refused(initial: float, cap: float, jitter: float) -> None:
    with pytest.raises(ValueError, match="backoff"):
        Backoff(initial, cap, jitter=jitter)
