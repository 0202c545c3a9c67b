"""SSE encoding is byte-exact; the parser reads it back whatever the chunking (even 1 byte)."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_listener.core.eventlog import Record, RecordEvent
from kv_listener.core.model import Tier
from kv_listener.core.sse import (
    PING,
    ControlEvent,
    SseError,
    SseEvent,
    SseParser,
    encode_comment,
    encode_control,
    encode_record,
    encode_records,
    parse_sse,
    record_data,
)

H = "6b913e22b32520efcfc547b83f6b5df8c006788e9a691b16b94d3f86352e4afb"


def rec(event: RecordEvent, **kw: object) -> Record:
    fields: dict[str, object] = {
        "id": "5f3a9c01-7", "event": event, "backend": "vllm-1", "prefix_hash": H,
        "token_count": 2048, "tier": Tier.GPU_HOT, "ts": 1764412345.123,
    }
    fields.update(kw)
    return Record(**fields)  # type: ignore[arg-type]


def test_cache_created_bytes() -> None:
    assert encode_record(rec(RecordEvent.CACHE_CREATED)) == (
        b"id: 5f3a9c01-7\n"
        b"event: cache_created\n"
        b'data: {"event":"cache_created","backend":"vllm-1","prefix_hash":"' + H.encode()
        + b'","token_count":2048,"tier":"gpu_hot","ts":1764412345.123}\n\n'
    )


def test_cache_offloaded_bytes_and_ts_rounded_to_ms() -> None:
    r = rec(RecordEvent.CACHE_OFFLOADED, tier=Tier.STORAGE_WARM, token_count=16,
            ts=1764412345.12349)
    assert encode_record(r) == (
        b"id: 5f3a9c01-7\nevent: cache_offloaded\n"
        b'data: {"event":"cache_offloaded","backend":"vllm-1","prefix_hash":"' + H.encode()
        + b'","token_count":16,"tier":"storage_warm","ts":1764412345.123}\n\n'
    )


def test_cache_evicted_carries_prefix_hash_only() -> None:
    r = rec(RecordEvent.CACHE_EVICTED, token_count=None, tier=None, ts=1764412345.0)
    assert encode_record(r) == (
        b"id: 5f3a9c01-7\nevent: cache_evicted\n"
        b'data: {"event":"cache_evicted","backend":"vllm-1","prefix_hash":"' + H.encode()
        + b'","ts":1764412345.0}\n\n'
    )


def test_cache_cleared_has_no_prefix_hash_and_unnumbered_has_no_id_line() -> None:
    r = rec(RecordEvent.CACHE_CLEARED, id=None, prefix_hash=None, token_count=None, tier=None,
            ts=1.5)
    assert encode_record(r) == (
        b'event: cache_cleared\ndata: {"event":"cache_cleared","backend":"vllm-1","ts":1.5}\n\n'
    )


def test_control_records_and_ping() -> None:
    assert encode_control(ControlEvent.DRAINING, "vllm-1") == (
        b'event: draining\ndata: {"event":"draining","backend":"vllm-1"}\n\n'
    )
    assert encode_control(ControlEvent.BUFFER_OVERFLOW, "sg_2") == (
        b'event: buffer_overflow\ndata: {"event":"buffer_overflow","backend":"sg_2"}\n\n'
    )
    assert encode_comment("ping") == PING == b": ping\n\n"
    with pytest.raises(ValueError):
        encode_comment("two\nlines")


def test_parser_byte_by_byte_reads_what_the_encoder_wrote() -> None:
    records = [
        rec(RecordEvent.CACHE_CLEARED, id=None, prefix_hash=None, token_count=None, tier=None),
        rec(RecordEvent.CACHE_CREATED, id=None),
        rec(RecordEvent.CACHE_OFFLOADED, id="e-9", tier=Tier.STORAGE_WARM),
        rec(RecordEvent.CACHE_EVICTED, id="e-10", token_count=None, tier=None),
    ]
    stream = encode_records(records) + PING + encode_control(ControlEvent.DRAINING, "vllm-1")
    parser = SseParser(last_event_id="e-3")
    events: list[SseEvent] = []
    ids_seen = []
    for i in range(len(stream)):
        events += parser.feed(stream[i : i + 1])
        ids_seen.append(parser.last_event_id)
    assert [e.event for e in events] == [
        "cache_cleared", "cache_created", "cache_offloaded", "cache_evicted",
        "draining",
    ]
    assert [e.id for e in events] == [None, None, "e-9", "e-10", None]
    # Unnumbered records leave the last event ID as it was (WHATWG): a consumer cut off within
    # a resync keeps its old ID.
    assert [e.last_event_id for e in events] == ["e-3", "e-3", "e-9", "e-10", "e-10"]
    assert [json.loads(e.data)["event"] for e in events] == [e.event for e in events]
    assert json.loads(events[2].data)["token_count"] == 2048
    assert parser.comments == 1
    # The ID only counts once its record is complete (the blank line), never mid-record.
    first_id_line_end = stream.index(b"id: e-9\n") + len(b"id: e-9\n")
    assert ids_seen[first_id_line_end] == "e-3"


def test_parser_line_endings_bom_and_field_rules() -> None:
    raw = (
        b"\xef\xbb\xbf: hello\r\n"
        b"id: 1\r\nevent: a\r\ndata: x\r\ndata:y\r\n\r\n"  # CRLF; "data:y" has no space
        b"id: 2\revent: b\rdata: z\r\r"  # bare CR
        b"retry: 10\nunknown: q\nid\ndata\n\n"  # "id" alone sets an empty ID; "data" alone
        b"event: nodata\n\n"  # no data: nothing dispatched
        b"id: bad\x00id\ndata: w\n\n"  # an ID containing NUL is ignored
        b"data: incomplete"
    )
    for chunks in ([raw], [raw[i : i + 1] for i in range(len(raw))],
                   [raw[i : i + 7] for i in range(0, len(raw), 7)]):
        events = parse_sse(chunks)
        assert [(e.event, e.data, e.id, e.last_event_id) for e in events] == [
            ("a", "x\ny", "1", "1"),
            ("b", "z", "2", "2"),
            ("message", "", "", ""),
            ("message", "w", None, ""),
        ]


def test_parser_crlf_split_across_chunks_is_one_line_end() -> None:
    parser = SseParser()
    assert parser.feed(b"data: a\r") == []
    assert parser.feed(b"\n") == []
    assert [e.data for e in parser.feed(b"\r\n")] == ["a"]


def test_parser_caps_line_and_data_size() -> None:
    parser = SseParser(max_line_bytes=64, max_data_bytes=100)
    with pytest.raises(SseError, match="line"):
        parser.feed(b"data: " + b"x" * 80)  # no line end yet: the buffer alone breaks the cap
    parser = SseParser(max_line_bytes=64, max_data_bytes=100)
    with pytest.raises(SseError, match="line"):
        parser.feed(b"data: " + b"x" * 80 + b"\n")
    parser = SseParser(max_line_bytes=64, max_data_bytes=100)
    line = b"data: " + b"x" * 50 + b"\n"
    parser.feed(line)
    with pytest.raises(SseError, match="data"):
        parser.feed(line)
    # Exactly at the caps is fine.
    parser = SseParser(max_line_bytes=56, max_data_bytes=101)
    assert [len(e.data) for e in parser.feed(line + line + b"\n")] == [101]


def test_parser_invalid_utf8_is_replaced_not_fatal() -> None:
    assert parse_sse([b"data: \xff\xfe\n\n"])[0].data == "\ufffd\ufffd"


records_st = st.builds(
    Record,
    id=st.one_of(st.none(), st.from_regex(r"[0-9a-f]{8}-[0-9]{1,6}", fullmatch=True)),
    event=st.sampled_from(list(RecordEvent)),
    backend=st.from_regex(r"[A-Za-z0-9_-]{1,64}", fullmatch=True),
    prefix_hash=st.from_regex(r"[0-9a-f]{64}", fullmatch=True),
    token_count=st.integers(0, 1 << 20),
    tier=st.sampled_from(list(Tier)),
    ts=st.floats(0, 2e9),
)


@settings(max_examples=100, deadline=None)
@given(records=st.lists(records_st, max_size=8), cuts=st.lists(st.integers(0, 5000)))
def test_round_trip_any_chunking(records: list[Record], cuts: list[int]) -> None:
    stream = encode_records(records)
    bounds = sorted({0, len(stream), *(c for c in cuts if c < len(stream))})
    chunks = [stream[a:b] for a, b in itertools.pairwise(bounds)]
    events = parse_sse(chunks)
    assert [(e.event, e.id) for e in events] == [(r.event.value, r.id) for r in records]
    for e, r in zip(events, records, strict=True):
        data = json.loads(e.data)
        assert list(data)[:2] == ["event", "backend"]
        assert data["backend"] == r.backend
        assert data["ts"] == round(r.ts, 3)
        if r.event is RecordEvent.CACHE_CLEARED:
            assert list(data) == ["event", "backend", "ts"]
        elif r.event is RecordEvent.CACHE_EVICTED:
            assert list(data) == ["event", "backend", "prefix_hash", "ts"]
        else:
            assert list(data) == ["event", "backend", "prefix_hash", "token_count", "tier", "ts"]
            assert r.tier is not None
            assert (data["token_count"], data["tier"]) == (r.token_count, r.tier.value)


odd_records_st = st.builds(
    Record,
    id=st.one_of(st.none(), st.text(max_size=12).filter(lambda s: "\n" not in s and "\r" not in s)),
    event=st.sampled_from(list(RecordEvent)),
    backend=st.text(max_size=12),
    prefix_hash=st.one_of(st.none(), st.text(max_size=70),
                          st.from_regex(r"[0-9a-f]{64}", fullmatch=True)),
    token_count=st.one_of(st.none(), st.booleans(), st.integers(-5, 1 << 70)),
    tier=st.one_of(st.none(), st.sampled_from(list(Tier))),
    ts=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 1 << 40)),
)


@settings(max_examples=400, deadline=None)
@given(odd_records_st)
def test_direct_encoding_writes_exactly_what_json_dumps_writes(r: Record) -> None:
    """The hot path writes the JSON by hand; whatever a record holds (odd backends, prefixes
    that need escaping or are None, bools, huge ints, NaN, int timestamps), the bytes are
    those of `json.dumps` of `record_data`."""
    data = json.dumps(record_data(r), separators=(",", ":"))
    head = f"id: {r.id}\n" if r.id is not None else ""
    assert encode_record(r) == f"{head}event: {r.event.value}\ndata: {data}\n\n".encode()
