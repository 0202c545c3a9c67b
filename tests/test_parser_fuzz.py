"""Hostile bytes never crash the parsers that face a peer: property tests with Hypothesis (#11).

Two parsers read what another process sends. (1) The router's consumer reads every listener
stream with `core.sse.SseParser` and turns each event into a `Record` with
`router.consumer.decode_record`; its `_StreamReader` applies the records, enforces the 1 MiB
caps (SPEC §8) and keeps the resume ID. (2) The event bus reads NDJSON control lines with
`core.bus_protocol` (hello / welcome / subscribe / unsubscribe / forbidden, the 64 KiB cap of
SPEC §7, `LineSplitter`), and its server reads the hello body of `POST /bus/v1/session`.

For arbitrary bytes in arbitrary chunkings (whole, byte by byte, random splits) every parser
either returns results that hold their invariants or raises its own typed error
(`SseError`, `RecordDropped`, `BusProtocolError`), never anything else. The SSE parser is
checked against a small reference model of the WHATWG rules it implements, so "the same events
whatever the chunking" and "exactly the right events" are one property. Well-formed input built
with the project's encoders round-trips exactly.

Three bugs this found are pinned at the end (each test failed before its fix): deeply nested
JSON escaped as `RecursionError`; the ID pattern accepted a trailing newline; lone surrogates
decoded but could not be encoded again. The control-line strategies include all three inputs.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
from collections.abc import Coroutine
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from kv_listener.core import bus_protocol as bp
from kv_listener.core.bus_protocol import (
    BusProtocolError,
    BusProtocolErrorReason,
    Forbidden,
    Hello,
    LineSplitter,
    Role,
    Subscribe,
    Unsubscribe,
    Welcome,
)
from kv_listener.core.eventlog import Record, RecordEvent
from kv_listener.core.model import Tier
from kv_listener.core.sse import (
    MAX_DATA_BYTES,
    MAX_LINE_BYTES,
    ControlEvent,
    SseError,
    SseEvent,
    SseParser,
    encode_comment,
    encode_control,
    encode_record,
    record_data,
)
from kv_listener.router.bus_server import Broker, EventBusServer, TlsFiles
from kv_listener.router.config import EventSourceConfig, Transport
from kv_listener.router.consumer import (
    ConsumeEndReason,
    KvEventConsumerManager,
    RecordDropped,
    _SourceRunner,
    _StreamReader,
    decode_record,
)
from kv_listener.router.metrics import EventDropReason

# derandomize: the same examples on every run (CI and laptops agree); the budget is the file's
# ~20 s on two cores.
FUZZ = settings(max_examples=200, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FEW = settings(FUZZ, max_examples=40)

B = "vllm-1"
BOM = b"\xef\xbb\xbf"
HEX = "0123456789abcdef"
ID_CHARS = "ABCXYZabcxyz0189_-"

# --- shared strategies -----------------------------------------------------------------------


def chunked(data: st.DataObject, stream: bytes) -> list[bytes]:
    """`stream` cut at random points (possibly empty chunks)."""
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=12), label="cuts"))
    return [stream[a:b] for a, b in itertools.pairwise([0, *cuts, len(stream)])]


def chunkings(data: st.DataObject, stream: bytes) -> list[tuple[bool, list[bytes]]]:
    """(byte by byte?, chunks): whole, byte by byte, and one random split."""
    return [(False, [stream]), (True, [stream[i:i + 1] for i in range(len(stream))]),
            (False, chunked(data, stream))]


# SSE text: lone surrogates cannot be UTF-8 on a stream at all (the control-line strategies below
# do generate them, as JSON escapes).
line_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n"),
                    max_size=12)
ids = st.text(ID_CHARS, min_size=1, max_size=64)
prefix_hashes = st.text(HEX, min_size=64, max_size=64)

json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(1 << 70), 1 << 70), st.floats(allow_nan=True),
    st.text(max_size=10), st.sampled_from(["", "gpu_hot", "storage_warm", B, "1" * 64]),
)
# Nesting stays shallow here; deep nesting (BUG-1) is tested alone below.
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)

# --- 1. SSE parser against a reference model ---------------------------------------------------

_LINE_END = re.compile(rb"\r\n|\r|\n")


def reference_sse(stream: bytes, *, max_line: int, max_data: int, last_event_id: str = ""
                  ) -> tuple[list[SseEvent], bool, str, int]:
    """The WHATWG event-stream rules written as plainly as possible, on the whole stream at once:
    (events dispatched before any cap was broken, cap broken?, last event ID, comment lines)."""
    if stream.startswith(BOM):
        stream = stream[3:]
    *lines, tail = _LINE_END.split(stream)
    events: list[SseEvent] = []
    id_buffer, own_id, event, data = last_event_id, None, "", None
    comments = 0
    for line in lines:
        if len(line) > max_line:
            return events, True, last_event_id, comments
        if line == b"":
            last_event_id = id_buffer
            if data is not None:
                events.append(SseEvent(event or "message", b"\n".join(data).decode(
                    "utf-8", errors="replace"), own_id, last_event_id))
            own_id, event, data = None, "", None
            continue
        if line.startswith(b":"):
            comments += 1
            continue
        name, _, value = line.partition(b":")
        value = value.removeprefix(b" ")
        if name == b"data":
            data = [*(data or []), value]
            if len(b"\n".join(data)) > max_data:
                return events, True, last_event_id, comments
        elif name == b"event":
            event = value.decode("utf-8", errors="replace")
        elif name == b"id" and b"\x00" not in value:
            own_id = id_buffer = value.decode("utf-8", errors="replace")
    if len(tail) > max_line:
        return events, True, last_event_id, comments
    return events, False, last_event_id, comments


def run_sse(chunks: list[bytes], **kw: Any) -> tuple[list[SseEvent], bool, str, int]:
    parser = SseParser(**kw)
    events: list[SseEvent] = []
    try:
        for chunk in chunks:
            events.extend(parser.feed(chunk))
    except SseError:
        return events, True, parser.last_event_id, parser.comments
    return events, False, parser.last_event_id, parser.comments


def no_line_end(b: bytes) -> bytes:
    return b.replace(b"\r", b"").replace(b"\n", b"")


# Streams made of lines (a field, a comment or a blank line) with mixed line ends, a possible BOM
# and an unterminated tail; plus raw bytes.
sse_values = st.one_of(
    line_text.map(str.encode), st.binary(max_size=8).map(no_line_end),
    st.sampled_from([b"", b"x", BOM, b"\xe2\x82", b" lead", b"cache_created"]),
    st.sampled_from([b"\x00", b"a\x00b"]),  # an id with NUL is ignored (WHATWG)
)
sse_lines = st.one_of(
    st.builds(lambda name, sep, value: name + sep + value,
              st.sampled_from([b"data", b"data", b"data", b"data", b"event", b"id", b"id", b"retry",
                               b"foo", b"", b"Data", b"data ", b"\xef\xbb"]),
              st.sampled_from([b":", b": ", b": ", b":  ", b""]), sse_values),
    st.just(b""),  # dispatch
    st.sampled_from([b": ping", b":", b":x\x00", b""]),
)
structured_streams = st.builds(
    lambda bom, lines, tail: bom + b"".join(line + end for line, end in lines) + tail,
    st.sampled_from([b"", b"", BOM, BOM[:2]]),
    st.lists(st.tuples(sse_lines, st.sampled_from([b"\n", b"\n", b"\r\n", b"\r"])), max_size=25),
    st.one_of(st.just(b""), sse_lines, st.binary(max_size=6)),
)
sse_streams = st.one_of(structured_streams, structured_streams, structured_streams,
                        st.binary(max_size=60))
# A cap below 3 bytes could be broken by a partial BOM the parser must wait on; no real cap is.
small_caps = st.one_of(st.integers(3, 48), st.just(MAX_LINE_BYTES))


@settings(FUZZ, max_examples=600)  # the central property: the most examples
@given(stream=sse_streams, max_line=small_caps, max_data=st.one_of(st.integers(0, 48),
                                                                    st.just(MAX_DATA_BYTES)),
       initial_id=st.sampled_from(["", "e-3"]), data=st.data())
def test_sse_parser_matches_the_model_whatever_the_chunking(
        stream: bytes, max_line: int, max_data: int, initial_id: str, data: st.DataObject) -> None:
    kw: dict[str, Any] = {"max_line": max_line, "max_data": max_data, "last_event_id": initial_id}
    want_events, want_error, want_id, want_comments = reference_sse(stream, **kw)
    for bytewise, chunks in chunkings(data, stream):
        events, error, last_id, comments = run_sse(
            chunks, max_line_bytes=max_line, max_data_bytes=max_data, last_event_id=initial_id)
        assert error == want_error, chunks
        if error:
            # Events of the chunk that broke a cap are not returned: they come again on resume.
            assert events == want_events[:len(events)], chunks
            if bytewise:  # nothing is lost before the error
                assert events == want_events
        else:
            assert (events, last_id, comments) == (want_events, want_id, want_comments), chunks


def test_the_model_itself_knows_the_edge_cases() -> None:
    """The reference must be right for the properties above to mean anything."""
    stream = BOM + b": ping\r\nid: 1\rdata: a\r\ndata:b\n\nid\n\nevent: x\ndata\n\nid: a\x00b\n"
    events, error, last_id, comments = reference_sse(stream, max_line=99, max_data=99)
    assert events == [SseEvent("message", "a\nb", "1", "1"), SseEvent("x", "", None, "")]
    assert (error, last_id, comments) == (False, "", 1)
    assert run_sse([stream], max_line_bytes=99, max_data_bytes=99) == (events, False, "", 1)
    assert reference_sse(b"data: 12345\n", max_line=10, max_data=99)[1] is True
    assert reference_sse(b"data: 12\ndata: 3\n", max_line=10, max_data=3)[1] is True
    assert reference_sse(b"data: 12\ndata: 3\n", max_line=10, max_data=4)[1] is False
    assert reference_sse(b"x" * 11, max_line=10, max_data=99)[1] is True


# --- 2. SSE well-formed streams round-trip -------------------------------------------------------

records = st.builds(
    Record,
    id=st.one_of(st.none(), st.builds(lambda e, s: f"{e}-{s}", st.text(HEX, min_size=8, max_size=8),
                                      st.integers(0, 1 << 40))),
    event=st.sampled_from(list(RecordEvent)),
    backend=ids,
    prefix_hash=prefix_hashes,
    token_count=st.integers(0, (1 << 53) - 1),
    tier=st.one_of(st.none(), st.sampled_from(list(Tier))),
    ts=st.floats(0, 4e9),
)
stream_items = st.one_of(
    records,
    st.tuples(st.sampled_from(list(ControlEvent)), ids),
    line_text.map(lambda s: f"ping {s}"),  # a comment
)


def expected_prefix_record(r: Record) -> Record:
    if r.event is RecordEvent.CACHE_CLEARED:
        return Record(r.id, r.event, r.backend, None, None, None, round(r.ts, 3))
    if r.event is RecordEvent.CACHE_EVICTED:
        return Record(r.id, r.event, r.backend, r.prefix_hash, None, None, round(r.ts, 3))
    tier = r.tier or (Tier.GPU_HOT if r.event is RecordEvent.CACHE_CREATED else Tier.STORAGE_WARM)
    return Record(r.id, r.event, r.backend, r.prefix_hash, r.token_count, tier, round(r.ts, 3))


@FUZZ
@given(items=st.lists(stream_items, max_size=8), ending=st.sampled_from([b"\n", b"\r\n", b"\r"]),
       bom=st.booleans(), data=st.data())
def test_encoded_listener_streams_parse_and_decode_back_exactly(
        items: list[Any], ending: bytes, bom: bool, data: st.DataObject) -> None:
    """What the listener's encoders write (SPEC §6) is what the router reads, in any line-end
    style (the data is JSON: no raw line end inside), whatever the chunking."""
    wire: list[bytes] = []
    want_events: list[SseEvent] = []
    want_records: list[tuple[str, Record | ControlEvent]] = []
    last_id, n_comments = "", 0
    for item in items:
        if isinstance(item, Record):
            wire.append(encode_record(item))
            last_id = item.id if item.id is not None else last_id
            body = json.dumps(record_data(item), separators=(",", ":"))
            want_events.append(SseEvent(item.event.value, body, item.id, last_id))
            want_records.append((item.backend, expected_prefix_record(item)))
        elif isinstance(item, tuple):
            wire.append(encode_control(*item))
            body = json.dumps({"event": item[0].value, "backend": item[1]}, separators=(",", ":"))
            want_events.append(SseEvent(item[0].value, body, None, last_id))
            want_records.append((item[1], item[0]))
        else:
            wire.append(encode_comment(item))
            n_comments += 1
    stream = (BOM if bom else b"") + b"".join(wire).replace(b"\n", ending)
    for _, chunks in chunkings(data, stream):
        events, error, got_id, comments = run_sse(chunks)
        assert (events, error, got_id, comments) == (want_events, False, last_id, n_comments)
        got = [(backend, decode_record(backend, ev))
               for ev, (backend, _) in zip(events, want_records, strict=True)]
        assert got == want_records


blocks = st.tuples(
    st.one_of(st.none(), line_text.filter(lambda s: "\x00" not in s)),  # id
    st.one_of(st.none(), line_text),  # event
    st.lists(line_text, max_size=3),  # data lines (none: the block dispatches nothing)
)


@FUZZ
@given(items=st.lists(blocks, max_size=8), initial_id=st.sampled_from(["", "old-7"]),
       data=st.data())
def test_arbitrary_well_formed_blocks_round_trip_with_last_event_id(
        items: list[tuple[str | None, str | None, list[str]]], initial_id: str,
        data: st.DataObject) -> None:
    """Any id / event / data text without line ends comes back exactly; ids persist across
    events (WHATWG last event ID) and an `id:` in a block without data still sets it."""
    wire: list[bytes] = []
    want: list[SseEvent] = []
    last_id = initial_id
    for id_, event, lines in items:
        block = "" if id_ is None else f"id: {id_}\n"
        block += "" if event is None else f"event: {event}\n"
        block += "".join(f"data: {line}\n" for line in lines) + "\n"
        wire.append(block.encode())
        last_id = id_ if id_ is not None else last_id
        if lines:
            want.append(SseEvent(event or "message", "\n".join(lines), id_, last_id))
    stream = b"".join(wire)
    for _, chunks in chunkings(data, stream):
        events, error, got_id, _ = run_sse(chunks, last_event_id=initial_id)
        assert (events, error, got_id) == (want, False, last_id)


# --- 3. the consumer's record decoding -----------------------------------------------------------

EVENT_NAMES = ["message", *[e.value for e in RecordEvent], *[e.value for e in ControlEvent],
               "", "cache_created ", "CACHE_CREATED", "ping"]
sse_event_names = st.one_of(st.just("message"), st.sampled_from(EVENT_NAMES))


def valid_or(valid: st.SearchStrategy[Any], junk: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(valid, junk)


# Every field present, each one valid or a near miss: most examples get deep into the checks.
plausible_records = st.fixed_dictionaries({
    "event": valid_or(st.sampled_from([e.value for e in RecordEvent]), st.sampled_from(EVENT_NAMES)),
    "backend": valid_or(st.just(B), st.sampled_from(["vllm-2", "", None, 1])),
    "prefix_hash": valid_or(prefix_hashes, st.one_of(prefix_hashes.map(str.upper),
                                                     st.text(HEX, max_size=65), json_scalars)),
    "token_count": valid_or(st.integers(0, (1 << 53) - 1), st.one_of(
        st.integers(max_value=-1), st.integers(min_value=1 << 53),
        st.sampled_from([True, False, 1.0, 2.5, "7", None, [1]]))),
    "tier": valid_or(st.sampled_from([None, "gpu_hot", "storage_warm"]),
                     st.sampled_from(["GPU", "", 0, [], {}, "GPU_HOT"])),
    "ts": valid_or(st.floats(allow_nan=False, allow_infinity=False),
                   st.one_of(st.sampled_from([True, "1.5", None, float("nan"), float("inf")]),
                             st.integers(-(1 << 70), 1 << 70))),
})
record_fields = st.fixed_dictionaries({}, optional={
    "event": st.one_of(st.sampled_from(EVENT_NAMES), json_values),
    "backend": st.one_of(st.sampled_from([B, "vllm-2", ""]), json_values),
    "prefix_hash": st.one_of(prefix_hashes, json_values),
    "token_count": st.one_of(st.integers(-2, 1 << 54), json_values),
    "tier": st.one_of(st.sampled_from([None, "gpu_hot", "storage_warm", "GPU", ""]), json_values),
    "ts": st.one_of(st.floats(allow_nan=True), json_values),
})
record_bodies = st.one_of(
    plausible_records.map(json.dumps),
    st.builds(lambda d, extra: json.dumps({**extra, **d}), record_fields,
              st.dictionaries(st.text(max_size=6), json_values, max_size=2)),
    json_values.map(json.dumps),
    st.text(max_size=30),
    st.binary(max_size=30).map(lambda b: b.decode("utf-8", errors="replace")),
)


def check_record(backend: str, ev: SseEvent, got: Record | ControlEvent) -> None:
    """The invariants of everything `decode_record` returns."""
    if isinstance(got, ControlEvent):
        assert got.value in (ev.event, json.loads(ev.data).get("event"))
        return
    assert got.backend == backend and got.id == ev.id
    assert isinstance(got.event, RecordEvent)
    assert (got.prefix_hash is None) == (got.event is RecordEvent.CACHE_CLEARED)
    if got.prefix_hash is not None:
        assert len(got.prefix_hash) == 64 and set(got.prefix_hash) <= set(HEX)
    has_count = got.event in (RecordEvent.CACHE_CREATED, RecordEvent.CACHE_OFFLOADED)
    assert (got.token_count is not None) == has_count == (got.tier is not None)
    if got.token_count is not None:
        assert type(got.token_count) is int and 0 <= got.token_count < 1 << 53
        assert isinstance(got.tier, Tier)
    assert got.ts is None or (type(got.ts) in (int, float) and abs(got.ts) != float("inf")
                              and got.ts == got.ts)
    # What it returned is itself a valid record: re-encoded, it decodes to the same thing.
    body = {k: v for k, v in got.as_dict().items() if k != "id"}
    assert decode_record(backend, SseEvent("message", json.dumps(body), got.id, "")) == got


@FUZZ
@given(event=sse_event_names, body=record_bodies,
       id_=st.one_of(st.none(), line_text))
def test_decode_record_gives_a_valid_record_or_a_counted_drop(
        event: str, body: str, id_: str | None) -> None:
    ev = SseEvent(event, body, id_, id_ or "")
    try:
        got = decode_record(B, ev)
    except RecordDropped as exc:
        assert isinstance(exc.reason, EventDropReason)
        assert exc.reason is not EventDropReason.OVERSIZED  # a parser cap, never a decode result
        return
    check_record(B, ev, got)


@FEW
@given(record=records)
def test_decode_record_accepts_every_record_the_listener_encodes(record: Record) -> None:
    (ev,) = run_sse([encode_record(record)])[0]
    assert decode_record(record.backend, ev) == expected_prefix_record(record)
    # ... and refuses it on another backend's stream.
    with pytest.raises(RecordDropped) as info:
        decode_record(record.backend + "x", ev)
    assert info.value.reason is EventDropReason.BACKEND_MISMATCH


# --- 4. the consumer's stream reader: caps, resume ID, no gap, no duplicate ------------------------


def run_to_end(coro: Coroutine[Any, Any, Any]) -> Any:
    """Drive a coroutine that never really suspends (the fake apply_record does not)."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise AssertionError("the coroutine suspended")


def stream_reader(applied: list[Record], last_event_id: str | None, *, max_line: int,
                  max_data: int) -> _StreamReader:
    async def apply(record: Record) -> None:
        applied.append(record)

    cfg = EventSourceConfig(backend_name=B, transport=Transport.EVENT_BUS)
    manager = KvEventConsumerManager([cfg], apply, clock=lambda: 1000.0)
    state = manager.state(B)
    state.last_event_id = last_event_id
    reader = _StreamReader(_SourceRunner(manager, cfg, state))
    # The consumer's real caps are the parser's defaults (checked below); small ones keep the
    # examples small.
    assert (reader.parser.max_line_bytes, reader.parser.max_data_bytes) == (1 << 20, 1 << 20)
    reader.parser = SseParser(max_line_bytes=max_line, max_data_bytes=max_data,
                              last_event_id=last_event_id or "")
    return reader


def created(seq: int | None, n: int) -> bytes:
    r = Record(None if seq is None else f"e-{seq}", RecordEvent.CACHE_CREATED, B,
               f"{seq or 0:064x}", n, Tier.GPU_HOT, 1.5)
    return encode_record(r)


def reader_block(item: str, seq: int) -> bytes:
    if item == "numbered":
        return created(seq, seq)
    if item == "unnumbered":  # a resync body: does not move the ID
        return created(None, seq)
    if item == "bad":  # numbered but invalid: dropped, and the ID moves past it
        return f"id: e-{seq}\nevent: cache_created\ndata: {{}}\n\n".encode()
    if item == "comment":
        return b": ping\n\n"
    return created(seq, seq).replace(B.encode(), b"vllm-9")  # backend_mismatch drop


reader_items = st.one_of(
    st.just("numbered"), st.just("numbered"), st.just("unnumbered"), st.just("bad"),
    st.just("comment"), st.just("other_backend"),
)
OVERSIZED = {
    "line": b"data: " + b"x" * 300 + b"\n\n",
    "comment": b": " + b"p" * 300 + b"\n",
    "data": b"".join([b"data: " + b"y" * 150 + b"\n"] * 3) + b"\n",
    "unterminated": b"event: " + b"z" * 300,
}


@FUZZ
@given(items=st.lists(reader_items, max_size=10), oversized=st.one_of(
    st.none(), st.sampled_from(sorted(OVERSIZED))), at=st.integers(0, 10),
    drain=st.booleans(), resume=st.sampled_from([None, "e-0"]), data=st.data())
def test_stream_reader_resumes_from_the_last_record_it_handled(
        items: list[str], oversized: str | None, at: int, drain: bool, resume: str | None,
        data: st.DataObject) -> None:
    """Records before a cap is broken are applied in order, exactly once; the resume ID is the
    ID of the last record handled, so resuming from it loses nothing and repeats nothing."""
    wire = [reader_block(item, seq) for seq, item in enumerate(items, start=1)]
    if drain:
        wire.append(encode_control(ControlEvent.DRAINING, B) + created(99, 99))
    cut = min(at, len(wire))
    if oversized is not None:
        wire.insert(cut, OVERSIZED[oversized])
    stream = b"".join(wire)
    handled = reference_sse(stream, max_line=256, max_data=400, last_event_id=resume or "")[0]
    for bytewise, chunks in chunkings(data, stream):
        applied: list[Record] = []
        reader = stream_reader(applied, resume, max_line=256, max_data=400)
        end = None
        with capture_logs():
            for chunk in chunks:
                end = run_to_end(reader.feed(chunk))
                if end is not None:
                    break
        state = reader.state
        n = state.received  # prefix events handled (applied or dropped), in stream order
        if end is not None and end.reason is ConsumeEndReason.DRAINING:
            assert handled[n].event == "draining"
        else:
            assert n <= len(handled)
        valid = [r for ev in handled[:n]
                 if isinstance(r := _decoded(ev), Record)]
        assert applied == valid  # in order, none twice, none skipped
        assert state.applied == len(valid)
        want_id = handled[n - 1].last_event_id if n else (resume or "")
        assert state.last_event_id == (want_id or None)
        if end is None:
            assert oversized is None and not drain and n == len(handled)
        elif end.reason is ConsumeEndReason.OVERSIZED:
            assert oversized is not None and state.dropped[EventDropReason.OVERSIZED.value] == 1
            if bytewise:
                assert n == len(handled)  # nothing before the cap was lost
        else:
            assert end.reason is ConsumeEndReason.DRAINING and drain
            assert state.last_event_id != "e-99"  # nothing after `draining` is read


def _decoded(ev: SseEvent) -> Record | ControlEvent | None:
    try:
        return decode_record(B, ev)
    except RecordDropped:
        return None


# --- 5. event-bus control lines ----------------------------------------------------------------

BUS_TOKENS = [
    b'{"type":"hello"', b'{"type":"welcome"', b'{"type":"subscribe"', b'"type":', b'"stream_id":',
    b'"session_id":"s"', b'"reason":', b'"last_event_id":null', b'"role":"kv_listener"',
    b'"client_id":"a"', b'"sources":["a"]', b'"version":1', b"}", b"{", b",", b"[", b"]", b'"',
    b"\n", b"\r\n", b" ", b"\xff", b"\xe2\x82", b"null", b"1", b"true",
]
bus_bytes = st.lists(st.one_of(st.sampled_from(BUS_TOKENS), st.binary(max_size=6)),
                     max_size=20).map(b"".join)
# Values for every field: valid ones and near misses, with ids ending in a newline (BUG-2) and lone
# surrogates (BUG-3).
field_values = st.one_of(
    ids, st.sampled_from(["", "a" * 65, "a b", "a/b", "é", B, "kv_listener", "broker", "x" * 129,
                          "abc\n", "\ud800", "a\udfffb"]),
    ids.map(lambda i: i + "\n"), st.lists(st.one_of(ids, json_scalars), max_size=3), line_text,
    st.text(max_size=12), json_values,
)
MESSAGE_TYPES = [t.value for t in bp.MessageType] + ["Hello", "", "ping"]
REQUIRED = {
    "hello": {"role": st.sampled_from(["kv_listener", "broker"]), "client_id": ids,
              "sources": st.lists(ids, max_size=3, unique=True), "version": st.just(1)},
    "welcome": {"session_id": st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E),
                                      min_size=1, max_size=128)},
    "subscribe": {"stream_id": ids, "announced_source": ids,
                  "last_event_id": st.one_of(st.none(), line_text.filter(lambda s: "\x00" not in s))},
    "unsubscribe": {"stream_id": ids},
    "forbidden": {"reason": st.text(max_size=256)},
}
# Each type with all its fields, each valid or a near miss, maybe one field left out.
plausible_messages = st.sampled_from(sorted(REQUIRED)).flatmap(lambda t: st.builds(
    lambda obj, drop: {k: v for k, v in obj.items() if k != drop},
    st.fixed_dictionaries({"type": st.just(t), **{k: valid_or(v, field_values)
                                                  for k, v in REQUIRED[t].items()}},
                          optional={"extra": json_values}),
    st.sampled_from([None, None, None, "type", *REQUIRED[t]]),
))
random_objects = st.builds(
    lambda t, fields: {"type": t, **fields} if t is not None else fields,
    st.one_of(st.none(), st.sampled_from(MESSAGE_TYPES), json_scalars),
    st.dictionaries(st.sampled_from(["role", "client_id", "sources", "version", "session_id",
                                     "stream_id", "announced_source", "last_event_id", "reason",
                                     "extra"]), field_values, max_size=6),
)
message_objects = st.one_of(plausible_messages, plausible_messages, random_objects)


def decode_all(line: bytes) -> list[Any]:
    """Every decoder on one input: a typed result or `BusProtocolError`, nothing else."""
    out: list[Any] = []
    for decode in (bp.decode_message, bp.decode_hello, bp.decode_hello_body):
        try:
            out.append(decode(line))
        except BusProtocolError as exc:
            assert isinstance(exc.reason, BusProtocolErrorReason)
            out.append(exc)
    return out


ID_FULL = re.compile(r"[A-Za-z0-9_-]{1,64}")


def check_message(got: Any) -> None:
    """What a decoder returns holds the SPEC §7 field rules and re-encodes to itself."""
    if isinstance(got, Hello):
        assert ID_FULL.fullmatch(got.client_id) and got.version == bp.PROTOCOL_VERSION
        assert all(ID_FULL.fullmatch(s) for s in got.sources)
        assert len(set(got.sources)) == len(got.sources) and isinstance(got.role, Role)
        assert bp.decode_hello(bp.encode_hello(got)) == got
        return
    if isinstance(got, Welcome):
        assert 0 < len(got.session_id) <= 128 and got.session_id.isascii()
    elif isinstance(got, Subscribe):
        assert ID_FULL.fullmatch(got.stream_id) and ID_FULL.fullmatch(got.announced_source)
        assert got.last_event_id is None or not set(got.last_event_id) & set("\r\n\x00")
    elif isinstance(got, Unsubscribe):
        assert ID_FULL.fullmatch(got.stream_id)
    else:
        assert isinstance(got, Forbidden) and len(got.reason) <= 256
    assert bp.decode_message(bp.encode_message(got)) == got


def mutated(line: bytes, edits: list[tuple[int, int, int]]) -> bytes:
    """`line` with bytes replaced (0), inserted (1) or deleted (2) at the given positions."""
    out = bytearray(line)
    for op, where, value in edits:
        at = where % (len(out) + 1)
        if op == 0 and at < len(out):
            out[at] = value
        elif op == 1:
            out.insert(at, value)
        elif at < len(out):
            del out[at]
    return bytes(out)


@FUZZ
@given(line=st.one_of(
    bus_bytes,
    # surrogatepass: a lone surrogate becomes bytes that are not UTF-8 (refused as not_utf8)
    st.builds(mutated, plausible_messages.map(
        lambda o: json.dumps(o, ensure_ascii=False).encode("utf-8", "surrogatepass")),
              st.lists(st.tuples(st.integers(0, 2), st.integers(0, 1 << 16),
                                 st.sampled_from(b'{}[]",:\n\r \\0aZ\xff\x00')), max_size=3)),
))
def test_control_line_decoders_on_arbitrary_bytes(line: bytes) -> None:
    for got in decode_all(line):
        if not isinstance(got, BusProtocolError):
            check_message(got)


@FUZZ
@given(obj=message_objects, ending=st.sampled_from([b"", b"\n", b"\r\n"]))
def test_control_line_decoders_on_arbitrary_json_objects(obj: dict[str, Any], ending: bytes) -> None:
    line = json.dumps(obj).encode() + ending
    results = decode_all(line)
    for got in results:
        if isinstance(got, BusProtocolError):
            # The line is one JSON object: only its content can be wrong.
            assert got.reason not in (BusProtocolErrorReason.NOT_JSON, BusProtocolErrorReason.NOT_UTF8,
                                      BusProtocolErrorReason.NOT_OBJECT,
                                      BusProtocolErrorReason.LINE_TOO_LONG,
                                      BusProtocolErrorReason.NOT_ONE_LINE)
        else:
            check_message(got)
    # decode_hello and decode_hello_body agree on a one-line body.
    assert repr(results[1]) == repr(results[2])


valid_hellos = st.builds(Hello, st.sampled_from(list(Role)), ids,
                         st.lists(ids, max_size=5, unique=True).map(tuple))
valid_messages = st.one_of(
    st.builds(Welcome, st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1,
                               max_size=128)),
    st.builds(Subscribe, ids, ids, st.one_of(st.none(), line_text.filter(lambda s: "\x00" not in s))),
    st.builds(Unsubscribe, ids),
    st.builds(Forbidden, st.text(st.characters(blacklist_categories=("Cs",)), max_size=256)),
)


MESSAGE_TYPE_OF = {Hello: "hello", Welcome: "welcome", Subscribe: "subscribe",
                   Unsubscribe: "unsubscribe", Forbidden: "forbidden"}


@FUZZ
@given(message=st.one_of(valid_hellos, valid_messages), ending=st.sampled_from([b"\n", b"\r\n", b""]),
       data=st.data())
def test_valid_control_lines_round_trip_and_every_truncation_is_refused(
        message: Any, ending: bytes, data: st.DataObject) -> None:
    hello = isinstance(message, Hello)
    line = bp.encode_hello(message) if hello else bp.encode_message(message)
    assert line.endswith(b"\n") and line.count(b"\n") == 1 and len(line) <= bp.MAX_LINE_BYTES + 1
    assert json.loads(line)["type"] == MESSAGE_TYPE_OF[type(message)]
    wire = line[:-1] + ending
    if hello:
        assert bp.decode_hello(wire) == message == bp.decode_hello_body(wire)
        with pytest.raises(BusProtocolError) as info:
            bp.decode_message(wire)
        assert info.value.reason is BusProtocolErrorReason.WRONG_TYPE
    else:
        assert bp.decode_message(wire) == message
        with pytest.raises(BusProtocolError) as info:
            bp.decode_hello(wire)
        assert info.value.reason is BusProtocolErrorReason.WRONG_TYPE
    # A line cut anywhere before its closing brace is never a message.
    k = data.draw(st.integers(0, len(line) - 2), label="cut")
    for decode in (bp.decode_message, bp.decode_hello):
        with pytest.raises(BusProtocolError) as info:
            decode(line[:k])
        assert info.value.reason in (BusProtocolErrorReason.NOT_JSON, BusProtocolErrorReason.NOT_UTF8)
    with pytest.raises(BusProtocolError) as info:
        bp.decode_hello_body(line[:k])
    assert info.value.reason in (BusProtocolErrorReason.NOT_JSON, BusProtocolErrorReason.NOT_UTF8,
                                 BusProtocolErrorReason.NOT_ONE_LINE)
    # More than one line is not a hello body.
    with pytest.raises(BusProtocolError) as info:
        bp.decode_hello_body(line + line)
    assert info.value.reason is BusProtocolErrorReason.NOT_ONE_LINE


def padded(message: dict[str, Any], size: int) -> bytes:
    """`message` with an unknown key padding its JSON line to exactly `size` bytes (no `\\n`)."""
    base = len(json.dumps({**message, "pad": ""}, separators=(",", ":")))
    return json.dumps({**message, "pad": "p" * (size - base)}, separators=(",", ":")).encode()


HELLO_OBJ = {"type": "hello", "role": "kv_listener", "client_id": "kv-listener-a",
             "sources": [B], "version": 1}


@FEW
@given(extra=st.integers(1, 4096), junk=st.booleans(), ending=st.sampled_from([b"", b"\n", b"\r\n"]),
       data=st.data())
def test_lines_over_64_kib_are_line_too_long_whatever_they_hold(
        extra: int, junk: bool, ending: bytes, data: st.DataObject) -> None:
    """SPEC §7: a line over 64 KiB (its line end not counted) is refused before it is parsed;
    exactly 64 KiB is a line like any other."""
    cap = bp.MAX_LINE_BYTES
    assert bp.decode_hello(padded(HELLO_OBJ, cap) + ending).client_id == "kv-listener-a"
    assert bp.decode_hello_body(padded(HELLO_OBJ, cap) + ending).client_id == "kv-listener-a"
    assert bp.decode_message(padded({"type": "forbidden", "reason": "r"}, cap) + ending) == Forbidden("r")
    over = b"\xff[" * ((cap + extra + 1) // 2) if junk else padded(HELLO_OBJ, cap + extra)
    for decode in (bp.decode_message, bp.decode_hello, bp.decode_hello_body):
        with pytest.raises(BusProtocolError) as info:
            decode(over + ending)
        assert info.value.reason is BusProtocolErrorReason.LINE_TOO_LONG
    # The splitter refuses it even before its end arrives, in any chunking.
    splitter = LineSplitter()
    with pytest.raises(BusProtocolError) as info:
        for chunk in chunked(data, over):
            splitter.feed(chunk)
    assert info.value.reason is BusProtocolErrorReason.LINE_TOO_LONG
    assert LineSplitter().feed(padded(HELLO_OBJ, cap) + b"\n") == [padded(HELLO_OBJ, cap)]


def reference_split(stream: bytes, cap: int) -> tuple[list[bytes], bool]:
    *lines, tail = stream.split(b"\n")
    out = []
    for line in lines:
        if len(line) > cap:
            return out, True
        if line.strip():
            out.append(line)
    return out, len(tail) > cap


@FUZZ
@given(stream=bus_bytes, cap=st.one_of(st.integers(0, 40), st.just(bp.MAX_LINE_BYTES)),
       data=st.data())
def test_line_splitter_matches_a_plain_split_whatever_the_chunking(
        stream: bytes, cap: int, data: st.DataObject) -> None:
    want, want_error = reference_split(stream, cap)
    for bytewise, chunks in chunkings(data, stream):
        splitter = LineSplitter(cap)
        got: list[bytes] = []
        try:
            for chunk in chunks:
                got.extend(splitter.feed(chunk))
                assert splitter.pending <= cap  # never buffers past the cap
        except BusProtocolError as exc:
            assert exc.reason is BusProtocolErrorReason.LINE_TOO_LONG
            assert want_error and got == want[:len(got)]
            if bytewise:
                assert got == want
        else:
            assert not want_error and got == want


# --- 6. the bus server reading a hello (ASGI, in memory: no socket, no TLS) ----------------------

TOKEN = b"listener-a-token-0123456789"
SESSION_SCOPE = {"type": "http", "http_version": "2", "path": bp.SESSION_PATH, "method": "POST",
                 "headers": [(b"authorization", b"Bearer " + TOKEN)]}
hello_bodies = st.one_of(
    valid_hellos.map(bp.encode_hello),
    st.builds(lambda cid, src, role: json.dumps({**HELLO_OBJ, "client_id": cid, "sources": src,
                                                 "role": role}).encode() + b"\n",
              st.sampled_from(["kv-listener-a", "kv-listener-b", "x"]),
              st.lists(st.sampled_from([B, "vllm-2", "vllm-3"]), max_size=3),
              st.sampled_from(["kv_listener", "broker"])),
    message_objects.map(lambda o: json.dumps(o).encode()),
    bus_bytes,
    st.integers(1, 64).map(lambda n: padded(HELLO_OBJ, bp.MAX_LINE_BYTES + n)),
)


async def serve_hello(chunks: list[bytes]) -> tuple[int, bytes, list[dict[str, Any]]]:
    server = EventBusServer(TlsFiles("unused.pem", "unused.key"),
                            [Broker("kv-listener-a", "kv_listener", bp.token_hash(TOKEN), (B, "vllm-2"))],
                            hello_timeout_s=5.0, reject_drain_s=5.0)
    inbox = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
             for i, c in enumerate(chunks)]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return inbox.pop(0) if inbox else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    with capture_logs() as logs:
        await server._asgi(dict(SESSION_SCOPE), receive, send)
    assert sent and sent[0]["type"] == "http.response.start", (sent, logs)
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return sent[0]["status"], body, logs


@FEW
@given(body=hello_bodies, data=st.data())
def test_bus_server_answers_every_hello_body_with_200_400_or_403(
        body: bytes, data: st.DataObject) -> None:
    """SPEC §7: `400` malformed hello or oversized line, `403` role / backends not allowed,
    else a session whose first line is `welcome`; never a failed request."""
    status, answer, logs = asyncio.run(serve_hello(chunked(data, body) or [b""]))
    assert not [e for e in logs if e["event"] == "bus_request_failed"], logs
    try:
        hello = bp.decode_hello_body(body)
    except BusProtocolError:
        assert status == 400 and json.loads(answer)["type"] == "bad_request"
        return
    if hello.client_id == "kv-listener-a" and hello.role is Role.KV_LISTENER and set(
            hello.sources) <= {B, "vllm-2"}:
        assert status == 200
        assert isinstance(bp.decode_message(answer.split(b"\n")[0]), Welcome)
    else:
        assert status == 403 and isinstance(bp.decode_message(answer), Forbidden)


# --- 7. bugs found by the fuzzing above (each of these failed before its fix) ----------------------

DEEP = b"[" * 100_000  # under the 1 MiB data cap of an SSE record
DEEP_LINE = b"[" * 60_000  # under the 64 KiB control-line cap


def test_bug1_deeply_nested_record_data_is_a_counted_drop() -> None:
    # json.loads raised RecursionError, which decode_record did not turn into a drop
    with pytest.raises(RecordDropped) as info:
        decode_record(B, SseEvent("cache_created", DEEP.decode(), "e-1", "e-1"))
    assert info.value.reason is EventDropReason.MALFORMED_JSON


def test_bug1_deeply_nested_control_line_is_not_json() -> None:
    with pytest.raises(BusProtocolError) as info:
        bp.decode_message(DEEP_LINE)
    assert info.value.reason is BusProtocolErrorReason.NOT_JSON


def test_bug1_deeply_nested_hello_body_is_a_400() -> None:
    # the bus server's request failed (bus_request_failed, no response at all)
    status, _, logs = asyncio.run(serve_hello([DEEP_LINE]))
    assert status == 400 and not [e for e in logs if e["event"] == "bus_request_failed"]


@pytest.mark.parametrize("line", [
    b'{"type":"unsubscribe","stream_id":"abc\\n"}',
    b'{"type":"hello","role":"kv_listener","client_id":"a\\n","sources":["x"],"version":1}',
    b'{"type":"hello","role":"kv_listener","client_id":"a","sources":["x","x\\n"],"version":1}',
])
def test_bug2_an_id_with_a_trailing_newline_is_invalid(line: bytes) -> None:
    # ID_RE ended in `$`, which also matches before a final newline
    with pytest.raises(BusProtocolError) as info:
        bp.decode_hello(line) if b"hello" in line else bp.decode_message(line)
    assert info.value.reason is BusProtocolErrorReason.INVALID_FIELD


def test_bug2_stream_path_refuses_a_trailing_newline() -> None:
    with pytest.raises(BusProtocolError):
        bp.stream_path("abc\n")
    assert bp.parse_stream_path(bp.STREAMS_PATH + "abc\n") is None


@pytest.mark.parametrize("line", [
    b'{"type":"forbidden","reason":"\\ud800"}',
    b'{"type":"subscribe","stream_id":"s","announced_source":"a","last_event_id":"\\ud800"}',
])
def test_bug3_a_lone_surrogate_is_an_invalid_field(line: bytes) -> None:
    # it decoded, and encode_message then raised UnicodeEncodeError
    with pytest.raises(BusProtocolError) as info:
        bp.decode_message(line)
    assert info.value.reason is BusProtocolErrorReason.INVALID_FIELD


def test_bug3_encoding_a_lone_surrogate_is_a_protocol_error() -> None:
    with pytest.raises(BusProtocolError):
        bp.encode_message(Forbidden("\ud800"))
