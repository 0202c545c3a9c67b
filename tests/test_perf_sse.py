"""`encode_record_list` (issue 13's batch encoder of a publish) writes the bytes `encode_record`
writes, record for record, whatever the records hold: every event type, numbered or not, odd
`ts` values (int, None, inf, nan, shared by several records), odd prefixes, counts and tiers."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kv_listener.core.model import Tier
from kv_listener.core.records import Record, RecordEvent
from kv_listener.core.sse import encode_record, encode_record_list, encode_records, parse_sse

_HASH = "ab" * 32
_TS = st.sampled_from([1_796_000_000.0, 1_796_000_000.1234, 0.5, 1e300, 3])
_records = st.builds(
    Record,
    id=st.one_of(st.none(), st.sampled_from(["e1-1", "e1-2", "x-99"])),
    event=st.one_of(st.sampled_from(list(RecordEvent)), st.just("cache_created")),
    backend=st.sampled_from(["vllm-1", 'odd "backend"\n', "b2"]),
    prefix_hash=st.one_of(st.none(), st.just(_HASH), st.sampled_from(["x y", "é" * 3, ""])),
    token_count=st.one_of(st.none(), st.integers(0, 1 << 60), st.just(True), st.just(1.5)),
    tier=st.one_of(st.none(), st.sampled_from(list(Tier))),
    ts=st.one_of(st.none(), _TS, st.floats(allow_nan=True, allow_infinity=True),
                 st.integers(0, 10)),
)


@given(st.lists(_records, max_size=12))
def test_same_bytes_as_encode_record(records: list[Record]) -> None:
    try:
        expected = [encode_record(r) for r in records]
    except (TypeError, ValueError, AttributeError) as exc:  # refused: so by the batch encoder
        try:
            encode_record_list(records)
        except type(exc):
            return
        raise AssertionError("encode_record_list accepted what encode_record refuses") from exc
    assert encode_record_list(records) == expected
    assert encode_records(records) == b"".join(expected)


def test_a_publish_of_a_busy_engine() -> None:
    """The hot case: created and evicted records sharing one ts, parsed back."""
    ts = 1_796_000_000.4567
    records = [Record(f"e-{i}", RecordEvent.CACHE_CREATED if i % 2 else RecordEvent.CACHE_EVICTED,
                      "vllm-1", f"{i:064x}", 16 if i % 2 else None,
                      Tier.GPU_HOT if i % 2 else None, ts) for i in range(1, 101)]
    records.append(Record("e-101", RecordEvent.CACHE_CLEARED, "vllm-1", None, None, None, ts))
    out = encode_record_list(records)
    assert out == [encode_record(r) for r in records]
    events = parse_sse(out)
    assert [e.id for e in events] == [r.id for r in records]
    assert '"ts":1796000000.457}' in events[0].data
