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
with the project's encoders round-trips exactly. The strategies and the reference models live in
`tests/support/fuzz.py`.

Three bugs this found are pinned at the end (each test failed before its fix): deeply nested
JSON escaped as `RecursionError`; the ID pattern accepted a trailing newline; lone surrogates
decoded but could not be encoded again. The control-line strategies include all three inputs.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from kv_listener.core import bus_protocol as bp
from kv_listener.core.eventlog import Record, RecordEvent
from kv_listener.core.model import Tier
from kv_listener.core.sse import (
    MAX_DATA_BYTES,
    ControlEvent,
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
from tests.support.fuzz import (
    BOM,
    FEW,
    FUZZ,
    HELLO_OBJ,
    MESSAGE_TYPE_OF,
    B,
    bus_bytes,
    check_message,
    check_record,
    chunked,
    chunkings,
    decode_all,
    hello_bodies,
    line_text,
    message_objects,
    mutated,
    padded,
    plausible_messages,
    record_bodies,
    records,
    reference_split,
    reference_sse,
    run_sse,
    small_caps,
    sse_event_names,
    sse_streams,
    stream_items,
    valid_hellos,
    valid_messages,
)

R = bp.BusProtocolErrorReason

# --- 1. SSE parser against a reference model ---------------------------------------------------


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
        if not isinstance(got, bp.BusProtocolError):
            check_message(got)


@FUZZ
@given(obj=message_objects, ending=st.sampled_from([b"", b"\n", b"\r\n"]))
def test_control_line_decoders_on_arbitrary_json_objects(obj: dict[str, Any], ending: bytes) -> None:
    line = json.dumps(obj).encode() + ending
    results = decode_all(line)
    for got in results:
        if isinstance(got, bp.BusProtocolError):
            # The line is one JSON object: only its content can be wrong.
            assert got.reason not in (R.NOT_JSON, R.NOT_UTF8,
                                      R.NOT_OBJECT,
                                      R.LINE_TOO_LONG,
                                      R.NOT_ONE_LINE)
        else:
            check_message(got)
    # decode_hello and decode_hello_body agree on a one-line body.
    assert repr(results[1]) == repr(results[2])


@FUZZ
@given(message=st.one_of(valid_hellos, valid_messages), ending=st.sampled_from([b"\n", b"\r\n", b""]),
       data=st.data())
def test_valid_control_lines_round_trip_and_every_truncation_is_refused(
        message: Any, ending: bytes, data: st.DataObject) -> None:
    hello = isinstance(message, bp.Hello)
    line = bp.encode_hello(message) if hello else bp.encode_message(message)
    assert line.endswith(b"\n") and line.count(b"\n") == 1 and len(line) <= bp.MAX_LINE_BYTES + 1
    assert json.loads(line)["type"] == MESSAGE_TYPE_OF[type(message)]
    wire = line[:-1] + ending
    if hello:
        assert bp.decode_hello(wire) == message == bp.decode_hello_body(wire)
        with pytest.raises(bp.BusProtocolError) as info:
            bp.decode_message(wire)
        assert info.value.reason is R.WRONG_TYPE
    else:
        assert bp.decode_message(wire) == message
        with pytest.raises(bp.BusProtocolError) as info:
            bp.decode_hello(wire)
        assert info.value.reason is R.WRONG_TYPE
    # A line cut anywhere before its closing brace is never a message.
    k = data.draw(st.integers(0, len(line) - 2), label="cut")
    for decode in (bp.decode_message, bp.decode_hello):
        with pytest.raises(bp.BusProtocolError) as info:
            decode(line[:k])
        assert info.value.reason in (R.NOT_JSON, R.NOT_UTF8)
    with pytest.raises(bp.BusProtocolError) as info:
        bp.decode_hello_body(line[:k])
    assert info.value.reason in (R.NOT_JSON, R.NOT_UTF8,
                                 R.NOT_ONE_LINE)
    # More than one line is not a hello body.
    with pytest.raises(bp.BusProtocolError) as info:
        bp.decode_hello_body(line + line)
    assert info.value.reason is R.NOT_ONE_LINE


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
    assert bp.decode_message(padded({"type": "forbidden", "reason": "r"}, cap) + ending) == bp.Forbidden("r")
    over = b"\xff[" * ((cap + extra + 1) // 2) if junk else padded(HELLO_OBJ, cap + extra)
    for decode in (bp.decode_message, bp.decode_hello, bp.decode_hello_body):
        with pytest.raises(bp.BusProtocolError) as info:
            decode(over + ending)
        assert info.value.reason is R.LINE_TOO_LONG
    # The splitter refuses it even before its end arrives, in any chunking.
    splitter = bp.LineSplitter()
    with pytest.raises(bp.BusProtocolError) as info:
        for chunk in chunked(data, over):
            splitter.feed(chunk)
    assert info.value.reason is R.LINE_TOO_LONG
    assert bp.LineSplitter().feed(padded(HELLO_OBJ, cap) + b"\n") == [padded(HELLO_OBJ, cap)]


@FUZZ
@given(stream=bus_bytes, cap=st.one_of(st.integers(0, 40), st.just(bp.MAX_LINE_BYTES)),
       data=st.data())
def test_line_splitter_matches_a_plain_split_whatever_the_chunking(
        stream: bytes, cap: int, data: st.DataObject) -> None:
    want, want_error = reference_split(stream, cap)
    for bytewise, chunks in chunkings(data, stream):
        splitter = bp.LineSplitter(cap)
        got: list[bytes] = []
        try:
            for chunk in chunks:
                got.extend(splitter.feed(chunk))
                assert splitter.pending <= cap  # never buffers past the cap
        except bp.BusProtocolError as exc:
            assert exc.reason is R.LINE_TOO_LONG
            assert want_error and got == want[:len(got)]
            if bytewise:
                assert got == want
        else:
            assert not want_error and got == want


# --- 6. the bus server reading a hello (ASGI, in memory: no socket, no TLS) ----------------------

TOKEN = b"listener-a-token-0123456789"
SESSION_SCOPE = {"type": "http", "http_version": "2", "path": bp.SESSION_PATH, "method": "POST",
                 "headers": [(b"authorization", b"Bearer " + TOKEN)]}


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
    except bp.BusProtocolError:
        assert status == 400 and json.loads(answer)["type"] == "bad_request"
        return
    if hello.client_id == "kv-listener-a" and hello.role is bp.Role.KV_LISTENER and set(
            hello.sources) <= {B, "vllm-2"}:
        assert status == 200
        assert isinstance(bp.decode_message(answer.split(b"\n")[0]), bp.Welcome)
    else:
        assert status == 403 and isinstance(bp.decode_message(answer), bp.Forbidden)


# --- 7. bugs found by the fuzzing above (each of these failed before its fix) ----------------------

DEEP = b"[" * 100_000  # under the 1 MiB data cap of an SSE record
DEEP_LINE = b"[" * 60_000  # under the 64 KiB control-line cap


def test_bug1_deeply_nested_record_data_is_a_counted_drop() -> None:
    # json.loads raised RecursionError, which decode_record did not turn into a drop
    with pytest.raises(RecordDropped) as info:
        decode_record(B, SseEvent("cache_created", DEEP.decode(), "e-1", "e-1"))
    assert info.value.reason is EventDropReason.MALFORMED_JSON


def test_bug1_deeply_nested_control_line_is_not_json() -> None:
    with pytest.raises(bp.BusProtocolError) as info:
        bp.decode_message(DEEP_LINE)
    assert info.value.reason is R.NOT_JSON


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
    with pytest.raises(bp.BusProtocolError) as info:
        bp.decode_hello(line) if b"hello" in line else bp.decode_message(line)
    assert info.value.reason is R.INVALID_FIELD


def test_bug2_stream_path_refuses_a_trailing_newline() -> None:
    with pytest.raises(bp.BusProtocolError):
        bp.stream_path("abc\n")
    assert bp.parse_stream_path(bp.STREAMS_PATH + "abc\n") is None


@pytest.mark.parametrize("line", [
    b'{"type":"forbidden","reason":"\\ud800"}',
    b'{"type":"subscribe","stream_id":"s","announced_source":"a","last_event_id":"\\ud800"}',
])
def test_bug3_a_lone_surrogate_is_an_invalid_field(line: bytes) -> None:
    # it decoded, and encode_message then raised UnicodeEncodeError
    with pytest.raises(bp.BusProtocolError) as info:
        bp.decode_message(line)
    assert info.value.reason is R.INVALID_FIELD


def test_bug3_encoding_a_lone_surrogate_is_a_protocol_error() -> None:
    with pytest.raises(bp.BusProtocolError):
        bp.encode_message(bp.Forbidden("\ud800"))
