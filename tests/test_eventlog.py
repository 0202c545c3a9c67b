"""EventLog: transitions -> records, coalescing on a fake clock, IDs, history, every resync case."""

from __future__ import annotations

import itertools

import pytest

from kv_listener.core.eventlog import (
    EventLog,
    Record,
    RecordEvent,
    ResyncReason,
    parse_event_id,
)
from kv_listener.core.model import PrefixTransition, Tier, TransitionKind

P1 = "a" * 64
P2 = "b" * 64
P3 = "c" * 64
E = "0123abcd"


def created(p: str, n: int, tier: Tier = Tier.GPU_HOT) -> PrefixTransition:
    return PrefixTransition(TransitionKind.CREATED, p, n, tier)


def count(p: str, n: int, tier: Tier | None = Tier.GPU_HOT) -> PrefixTransition:
    return PrefixTransition(TransitionKind.TOKEN_COUNT, p, n, tier)


def moved(p: str, n: int, tier: Tier) -> PrefixTransition:
    return PrefixTransition(TransitionKind.TIER, p, n, tier)


def evicted(p: str) -> PrefixTransition:
    return PrefixTransition(TransitionKind.EVICTED, p)


CLEARED = PrefixTransition(TransitionKind.CLEARED)


def new_log(history: int = 100, interval: float = 0.25) -> EventLog:
    return EventLog("vllm-1", E, history, interval)


def shape(records: list[Record] | tuple[Record, ...]) -> list[tuple[object, ...]]:
    return [(r.id, r.event.value, r.prefix_hash, r.token_count, r.tier) for r in records]


def test_created_tier_evicted_cleared_go_out_at_once_with_sequential_ids() -> None:
    log = new_log()
    out = log.record([created(P1, 16), created(P2, 32, Tier.STORAGE_WARM)], now=10.0)
    out += log.record([moved(P1, 16, Tier.STORAGE_WARM)], now=10.001)
    out += log.record([moved(P1, 16, Tier.GPU_HOT), evicted(P2)], now=10.002)
    out += log.record([CLEARED], now=10.003)
    assert shape(out) == [
        (f"{E}-1", "cache_created", P1, 16, Tier.GPU_HOT),
        (f"{E}-2", "cache_offloaded", P2, 32, Tier.STORAGE_WARM),
        (f"{E}-3", "cache_offloaded", P1, 16, Tier.STORAGE_WARM),
        (f"{E}-4", "cache_created", P1, 16, Tier.GPU_HOT),
        (f"{E}-5", "cache_evicted", P2, None, None),
        (f"{E}-6", "cache_cleared", None, None, None),
    ]
    assert [r.ts for r in out] == [10.0, 10.0, 10.001, 10.002, 10.002, 10.003]
    assert all(r.backend == "vllm-1" for r in out)
    assert log.live() == {}
    assert log.last_id == f"{E}-6"


def test_token_count_coalesced_latest_wins_then_flushed_when_due() -> None:
    log = new_log(interval=0.25)
    assert shape(log.record([created(P1, 16)], now=100.0))[0][3] == 16
    # Within the interval after the creation: held, latest value wins.
    assert log.record([count(P1, 32)], now=100.05) == []
    assert log.record([count(P1, 48)], now=100.10) == []
    assert log.next_flush_at() == pytest.approx(100.25)
    assert log.flush(100.2) == []
    assert log.live() == {P1: (16, Tier.GPU_HOT)}  # the live state is what was sent
    out = log.flush(100.25)
    assert shape(out) == [(f"{E}-2", "cache_created", P1, 48, Tier.GPU_HOT)]
    assert out[0].ts == 100.25
    assert log.next_flush_at() is None
    assert log.live() == {P1: (48, Tier.GPU_HOT)}
    # After a quiet interval an update goes out at once (leading edge).
    assert shape(log.record([count(P1, 64)], now=101.0))[0][3] == 64


def test_at_most_one_update_per_prefix_per_interval_but_prefixes_independent() -> None:
    log = new_log(interval=1.0)
    log.record([created(P1, 1), created(P2, 1)], now=0.0)
    sent: list[Record] = []
    t = 0.0
    for step in range(1, 401):
        t = step * 0.01
        sent += log.flush(t)
        sent += log.record([count(P1, step + 1), count(P2, step + 1)], now=t)
    sent += log.flush(t + 1.0)
    for p in (P1, P2):
        times = [r.ts for r in sent if r.prefix_hash == p]
        assert all(b - a >= 1.0 - 1e-9 for a, b in itertools.pairwise(times))
        assert 3 <= len(times) <= 5
    assert log.live() == {P1: (401, Tier.GPU_HOT), P2: (401, Tier.GPU_HOT)}


def test_due_updates_are_flushed_before_new_records_of_a_later_call() -> None:
    log = new_log(interval=0.25)
    log.record([created(P1, 16)], now=0.0)
    log.record([count(P1, 32)], now=0.1)  # pending, due 0.25
    out = log.record([created(P2, 8)], now=0.5)
    assert shape(out) == [
        (f"{E}-2", "cache_created", P1, 32, Tier.GPU_HOT),
        (f"{E}-3", "cache_created", P2, 8, Tier.GPU_HOT),
    ]


@pytest.mark.parametrize(
    ("superseding", "expected"),
    [
        (evicted(P1), [(f"{E}-2", "cache_evicted", P1, None, None)]),
        (CLEARED, [(f"{E}-2", "cache_cleared", None, None, None)]),
        (moved(P1, 40, Tier.STORAGE_WARM),
         [(f"{E}-2", "cache_offloaded", P1, 40, Tier.STORAGE_WARM)]),
    ],
)
def test_pending_update_dropped_when_superseded(
    superseding: PrefixTransition, expected: list[tuple[object, ...]]
) -> None:
    log = new_log(interval=0.25)
    log.record([created(P1, 16)], now=0.0)
    assert log.record([count(P1, 32)], now=0.1) == []
    out = log.record([superseding], now=0.2)
    out += log.flush(5.0)  # nothing stale comes out later
    assert shape(out) == expected
    assert log.next_flush_at() is None


def test_update_back_to_the_sent_value_cancels_the_pending_one() -> None:
    log = new_log(interval=0.25)
    log.record([created(P1, 16)], now=0.0)
    log.record([count(P1, 32)], now=0.1)
    assert log.record([count(P1, 16)], now=0.2) == []
    assert log.flush(1.0) == []
    assert log.last_seq == 1


def test_token_count_of_unknown_prefix_or_other_tier_goes_out_at_once() -> None:
    log = new_log(interval=10.0)
    out = log.record([count(P1, 16)], now=0.0)  # never created: an upsert, not a coalesced one
    out += log.record([count(P1, 24, Tier.STORAGE_WARM)], now=0.1)  # tier differs: at once
    out += log.record([count(P1, 32, None)], now=0.2)  # no tier: keeps the live one, coalesced
    assert shape(out) == [
        (f"{E}-1", "cache_created", P1, 16, Tier.GPU_HOT),
        (f"{E}-2", "cache_offloaded", P1, 24, Tier.STORAGE_WARM),
    ]
    assert shape(log.flush(100.0)) == [(f"{E}-3", "cache_offloaded", P1, 32, Tier.STORAGE_WARM)]


def test_noop_transitions_emit_nothing() -> None:
    log = new_log()
    log.record([created(P1, 16)], now=0.0)
    assert log.record([created(P1, 16), evicted(P2)], now=1.0) == []  # same state; unknown prefix
    assert log.last_seq == 1


def test_zero_interval_sends_every_update() -> None:
    log = new_log(interval=0.0)
    log.record([created(P1, 1)], now=0.0)
    out = log.record([count(P1, 2), count(P1, 3)], now=0.0)
    assert [r.token_count for r in out] == [2, 3]


def test_clock_stepping_back_does_not_hold_an_update() -> None:
    log = new_log(interval=0.25)
    log.record([created(P1, 1)], now=1000.0)
    log.record([count(P1, 2)], now=1000.1)  # due 1000.25
    assert shape(log.flush(500.0))[0][3] == 2  # wall clock stepped back by 500 s


def test_malformed_batch_raises_before_changing_anything() -> None:
    log = new_log()
    bad = [
        created(P1, 16),
        PrefixTransition(TransitionKind.TIER, P2, 8, None),
    ]
    with pytest.raises(ValueError, match="tier"):
        log.record(bad, now=0.0)
    with pytest.raises(ValueError, match="prefix_hash"):
        log.record([PrefixTransition(TransitionKind.CREATED, None, 1, Tier.GPU_HOT)], now=0.0)
    with pytest.raises(ValueError, match="negative"):
        log.record([count(P1, -1)], now=0.0)
    assert log.last_seq == 0
    assert log.live() == {}


def test_constructor_rejects_bad_parameters() -> None:
    with pytest.raises(ValueError):
        EventLog("b", E, 0, 0.25)
    with pytest.raises(ValueError):
        EventLog("b", E, 10, -1.0)
    with pytest.raises(ValueError):
        EventLog("b", "ab-cd", 10, 0.25)


# --- replay and resync ------------------------------------------------------------------------


def filled_log(history: int = 5) -> tuple[EventLog, list[Record]]:
    log = new_log(history=history)
    out: list[Record] = []
    for i, p in enumerate((P1, P2, P3)):
        out += log.record([created(p, 16 * (i + 1))], now=float(i))
    out += log.record([evicted(P2)], now=3.0)
    out += log.record([moved(P3, 48, Tier.STORAGE_WARM)], now=4.0)
    return log, out  # ids 1..5, live: P1 gpu 16, P3 warm 48


def test_replay_after_an_id_in_the_history_has_no_gap_and_no_duplicate() -> None:
    log, out = filled_log()
    for k in range(6):
        replay = log.since(f"{E}-{k}")
        assert replay.resync is None
        assert list(replay.records) == out[k:]


def test_resume_at_the_newest_id_is_empty_and_not_a_resync() -> None:
    log, _ = filled_log()
    replay = log.since(f"{E}-5")
    assert replay.records == ()
    assert replay.resync is None
    empty = new_log()
    assert empty.since(f"{E}-0").records == ()
    assert empty.since(f"{E}-0").resync is None


def expected_resync(log: EventLog, last_id: str) -> list[tuple[object, ...]]:
    return [
        (None, "cache_cleared", None, None, None),
        (None, "cache_created", P1, 16, Tier.GPU_HOT),
        (last_id, "cache_offloaded", P3, 48, Tier.STORAGE_WARM),
    ]


@pytest.mark.parametrize(
    ("last_id", "reason"),
    [
        (None, ResyncReason.NEW_CONSUMER),
        ("ffffffff-3", ResyncReason.UNKNOWN_EPOCH),
        (f"{E}-6", ResyncReason.AHEAD),
        (f"{E}-99999999999", ResyncReason.AHEAD),
        ("garbage", ResyncReason.MALFORMED_ID),
        (f"{E}-", ResyncReason.MALFORMED_ID),
        (f"{E}--1", ResyncReason.UNKNOWN_EPOCH),  # reads as epoch "<E>-", never as seq -1
        (f"{E}-1x", ResyncReason.MALFORMED_ID),
        (f"{E}-١", ResyncReason.MALFORMED_ID),  # a non-ASCII digit is not a seq
    ],
)
def test_resync_cases(last_id: str | None, reason: ResyncReason) -> None:
    log, _ = filled_log()
    replay = log.since(last_id)
    assert replay.resync is reason
    assert shape(replay.records) == expected_resync(log, f"{E}-5")
    # Snapshot records keep the ts of the record that set their state.
    assert [r.ts for r in replay.records[1:]] == [0.0, 4.0]


def test_id_older_than_the_history_resyncs_and_the_oldest_kept_boundary_replays() -> None:
    log, out = filled_log(history=3)  # keeps ids 3, 4, 5
    assert log.since(f"{E}-1").resync is ResyncReason.TOO_OLD
    assert log.since(f"{E}-0").resync is ResyncReason.TOO_OLD
    replay = log.since(f"{E}-2")  # needs 3.. which are all kept
    assert replay.resync is None
    assert list(replay.records) == out[2:]


def test_resync_of_an_empty_log_carries_epoch_dash_zero() -> None:
    log = new_log()
    replay = log.since(None, now=42.0)
    assert shape(replay.records) == [(f"{E}-0", "cache_cleared", None, None, None)]
    assert replay.records[0].ts == 42.0


def test_resync_with_no_live_prefix_puts_the_newest_id_on_the_cleared_record() -> None:
    log = new_log()
    log.record([created(P1, 1)], now=1.0)
    log.record([evicted(P1)], now=2.0)
    replay = log.since(None)
    assert shape(replay.records) == [(f"{E}-2", "cache_cleared", None, None, None)]
    assert replay.records[0].ts == 2.0  # default: the newest record's ts


def test_resync_snapshot_excludes_updates_not_sent_yet() -> None:
    log = new_log(interval=0.25)
    log.record([created(P1, 16)], now=0.0)
    log.record([count(P1, 99)], now=0.1)  # pending
    snap = log.since(None).records
    assert shape(snap)[-1] == (f"{E}-1", "cache_created", P1, 16, Tier.GPU_HOT)
    # ...and the pending update then follows as a live record with the next ID.
    assert shape(log.flush(1.0)) == [(f"{E}-2", "cache_created", P1, 99, Tier.GPU_HOT)]


def test_parse_event_id() -> None:
    assert parse_event_id("abc-12") == ("abc", 12)
    assert parse_event_id("abc-0") == ("abc", 0)
    assert parse_event_id("12") is None
    assert parse_event_id("-12") is None
    assert parse_event_id("abc-1" + "0" * 19) is None  # absurdly long seq
    assert RecordEvent("cache_created") is RecordEvent.CACHE_CREATED


def test_a_live_prefix_costs_its_dict_entry_and_a_small_value() -> None:
    """One live entry per prefix the engine holds (a million for a million single-block
    prefixes): the entry's value is 40 bytes, not tracked by the GC, and shares its int and float
    with the record (boxed once per call, compiled), where a tuple with its own int and float
    took 120. Here, with a history of 1,000 records: 100 bytes per live prefix; 150 compiled and
    124 pure before (records and entries with their own ints and floats, a GC header each)."""
    import gc  # noqa: PLC0415
    import tracemalloc  # noqa: PLC0415

    n, per_call = 20_000, 50
    log = new_log(history=1000)
    prefixes = [f"{i:064x}" for i in range(n)]
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for start in range(0, n, per_call):
            # fresh ints, as the tracker's transitions carry (freed with them)
            batch = [created(p, 1000 + start + i) for i, p in enumerate(prefixes[start:start + per_call])]
            log.record(batch, now=1764412345.0 + start)
            del batch
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert log.live_count == n and log.history_len == 1000
    assert log.live()[prefixes[-1]] == (1000 + n - 1, Tier.GPU_HOT)
    assert grown / n < 110, grown / n


def test_records_written_counts_every_numbered_record_by_event_and_no_replay() -> None:
    log = new_log(interval=1.0)
    assert log.records_written() == {}
    written: list[Record] = []
    written += log.record([created(P1, 16), created(P2, 32, Tier.STORAGE_WARM)], 0.0)
    written += log.record([count(P1, 48)], 0.5)  # coalesced: due at 1.0
    written += log.record([moved(P2, 32, Tier.GPU_HOT), evicted(P1)], 0.6)
    written += log.record([created(P3, 16)], 0.7)
    written += log.flush(2.0)
    written += log.record([CLEARED], 3.0)
    log.since(None, 3.0)  # a replay: its records are not written again
    by_event: dict[str, int] = {}
    for r in written:
        by_event[r.event.value] = by_event.get(r.event.value, 0) + 1
    assert log.records_written() == by_event == {
        "cache_created": 3, "cache_offloaded": 1, "cache_evicted": 1, "cache_cleared": 1}
