"""Strategies and reference models for the parser fuzz tests (tests/test_parser_fuzz.py, #11).

What the properties there are checked against: chunkings of a byte stream; a plain reference model
of the WHATWG event-stream rules (`reference_sse`) and of NDJSON line splitting with a cap
(`reference_split`); streams, record bodies and control lines that are well formed, near misses,
or raw bytes; the invariants of every decoded record and control message (`check_record`,
`check_message`).
"""

from __future__ import annotations

import itertools
import json
import re
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from kv_listener.core import bus_protocol as bp
from kv_listener.core.eventlog import Record, RecordEvent
from kv_listener.core.model import Tier
from kv_listener.core.sse import MAX_LINE_BYTES, ControlEvent, SseError, SseEvent, SseParser
from kv_listener.router.consumer import decode_record

# derandomize: the same examples on every run (CI and laptops agree); the budget is the file's
# ~20 s on two cores.
FUZZ = settings(max_examples=200, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


FEW = settings(FUZZ, max_examples=40)


B = "vllm-1"


BOM = b"\xef\xbb\xbf"


HEX = "0123456789abcdef"


ID_CHARS = "ABCXYZabcxyz0189_-"


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


# --- the SSE parser's reference model and its streams ------------------------------------

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


# --- prefix records, well formed and not ---------------------------------------------------

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


# --- event-bus control lines ----------------------------------------------------------------

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
    """Every decoder on one input: a typed result or `bp.BusProtocolError`, nothing else."""
    out: list[Any] = []
    for decode in (bp.decode_message, bp.decode_hello, bp.decode_hello_body):
        try:
            out.append(decode(line))
        except bp.BusProtocolError as exc:
            assert isinstance(exc.reason, bp.BusProtocolErrorReason)
            out.append(exc)
    return out


ID_FULL = re.compile(r"[A-Za-z0-9_-]{1,64}")


def check_message(got: Any) -> None:
    """What a decoder returns holds the SPEC §7 field rules and re-encodes to itself."""
    if isinstance(got, bp.Hello):
        assert ID_FULL.fullmatch(got.client_id) and got.version == bp.PROTOCOL_VERSION
        assert all(ID_FULL.fullmatch(s) for s in got.sources)
        assert len(set(got.sources)) == len(got.sources) and isinstance(got.role, bp.Role)
        assert bp.decode_hello(bp.encode_hello(got)) == got
        return
    if isinstance(got, bp.Welcome):
        assert 0 < len(got.session_id) <= 128 and got.session_id.isascii()
    elif isinstance(got, bp.Subscribe):
        assert ID_FULL.fullmatch(got.stream_id) and ID_FULL.fullmatch(got.announced_source)
        assert got.last_event_id is None or not set(got.last_event_id) & set("\r\n\x00")
    elif isinstance(got, bp.Unsubscribe):
        assert ID_FULL.fullmatch(got.stream_id)
    else:
        assert isinstance(got, bp.Forbidden) and len(got.reason) <= 256
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


valid_hellos = st.builds(bp.Hello, st.sampled_from(list(bp.Role)), ids,
                         st.lists(ids, max_size=5, unique=True).map(tuple))


valid_messages = st.one_of(
    st.builds(bp.Welcome, st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1,
                               max_size=128)),
    st.builds(bp.Subscribe, ids, ids, st.one_of(st.none(), line_text.filter(lambda s: "\x00" not in s))),
    st.builds(bp.Unsubscribe, ids),
    st.builds(bp.Forbidden, st.text(st.characters(blacklist_categories=("Cs",)), max_size=256)),
)


MESSAGE_TYPE_OF = {bp.Hello: "hello", bp.Welcome: "welcome", bp.Subscribe: "subscribe",
                   bp.Unsubscribe: "unsubscribe", bp.Forbidden: "forbidden"}


def padded(message: dict[str, Any], size: int) -> bytes:
    """`message` with an unknown key padding its JSON line to exactly `size` bytes (no `\\n`)."""
    base = len(json.dumps({**message, "pad": ""}, separators=(",", ":")))
    return json.dumps({**message, "pad": "p" * (size - base)}, separators=(",", ":")).encode()


HELLO_OBJ = {"type": "hello", "role": "kv_listener", "client_id": "kv-listener-a",
             "sources": [B], "version": 1}


def reference_split(stream: bytes, cap: int) -> tuple[list[bytes], bool]:
    *lines, tail = stream.split(b"\n")
    out = []
    for line in lines:
        if len(line) > cap:
            return out, True
        if line.strip():
            out.append(line)
    return out, len(tail) > cap


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
