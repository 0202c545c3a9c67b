"""`encode_record_list` (issue 13's batch encoder of a publish) writes the bytes `encode_record`
writes, record for record, whatever the records hold: every event type, numbered or not, odd
`ts` values (int, None, inf, nan, shared by several records), odd prefixes, counts and tiers.
Each test runs both encoders: the C module's (`core._sseenc`, where built) and the Python one."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kv_listener.core.model import Tier
from kv_listener.core.records import Record, RecordEvent
from kv_listener.core.sse import (
    _NATIVE,
    encode_record,
    encode_record_list,
    encode_record_list_python,
    encode_records,
    parse_sse,
)

Encoder = Callable[[Sequence[Record]], list[bytes]]
# the C encoder (skipped where it was not built) and the Python one
both_encoders = pytest.mark.parametrize("encode", [
    pytest.param(_NATIVE, id="c",
                 marks=pytest.mark.skipif(_NATIVE is None, reason="_sseenc not built")),
    pytest.param(encode_record_list_python, id="python"),
])

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


@both_encoders
@given(st.lists(_records, max_size=12))
def test_same_bytes_as_encode_record(encode: Encoder, records: list[Record]) -> None:
    try:
        expected = [encode_record(r) for r in records]
    except (TypeError, ValueError, AttributeError) as exc:  # refused: so by the batch encoder
        try:
            encode(records)
        except type(exc):
            return
        raise AssertionError("encode_record_list accepted what encode_record refuses") from exc
    assert encode(records) == expected
    assert encode_records(records) == b"".join(expected)


@both_encoders
def test_zero_and_negative_zero_keep_their_own_ts(encode: Encoder) -> None:
    """0.0 == -0.0, but their JSON differs: one list holding both writes each as it is."""
    records = [Record(f"e-{i}", RecordEvent.CACHE_EVICTED, "b", "ab", None, None, ts)
               for i, ts in enumerate([0.0, -0.0, 0.0, -0.0])]
    out = encode(records)
    assert out == [encode_record(r) for r in records]
    assert [b'"ts":-0.0}' in b for b in out] == [False, True, False, True]


@both_encoders
def test_more_kinds_in_one_list_than_the_encoder_remembers(encode: Encoder) -> None:
    """Twelve distinct ts and twelve backends in one list (the C encoder remembers 4 and 8
    per call) and an unnumbered record: the same bytes as encode_record."""
    records = [Record(f"e-{i}", RecordEvent.CACHE_CREATED, f"vllm-{i}", f"{i:064x}", 16 * i,
                      Tier.GPU_HOT, 1_796_000_000.0 + i / 7) for i in range(12)]
    records.append(Record(None, RecordEvent.CACHE_EVICTED, "b", "ab", None, None, 1.0))
    assert encode(records) == [encode_record(r) for r in records]
    assert encode(tuple(records)) == [encode_record(r) for r in records]


def test_the_c_encoder_is_the_one_used_where_built() -> None:
    if _NATIVE is None:
        pytest.skip("_sseenc not built")
    records = [Record("e-1", RecordEvent.CACHE_CLEARED, "b", None, None, None, 2.0)]
    assert encode_record_list(records) == _NATIVE(records) == [encode_record(records[0])]
    with pytest.raises(TypeError):
        _NATIVE(5)  # type: ignore[arg-type]


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
