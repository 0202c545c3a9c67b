"""Event-bus control lines (SPEC §7): exact bytes, strict decoding with typed reasons, the 64 KiB
cap, token hashing, and recognizing how a pushed SSE body ended."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kv_listener.core import bus_protocol as bp
from kv_listener.core.bus_protocol import (
    MAX_LINE_BYTES,
    BusProtocolError,
    BusProtocolErrorReason,
    Forbidden,
    Hello,
    LineSplitter,
    Role,
    StreamEnd,
    Subscribe,
    Unsubscribe,
    Welcome,
)
from kv_listener.core.eventlog import Record, RecordEvent
from kv_listener.core.model import Tier
from kv_listener.core.sse import ControlEvent, encode_comment, encode_control, encode_record

R = BusProtocolErrorReason


def refusal(step: Callable[[Any], object], arg: Any) -> R:
    """The reason `step(arg)` refuses its input with (it must raise `BusProtocolError`)."""
    with pytest.raises(BusProtocolError) as exc:
        step(arg)
    return exc.value.reason


def test_hello_bytes_are_the_spec_example() -> None:
    hello = Hello(Role.KV_LISTENER, "kv-listener-a", ("vllm-1", "vllm-2"))
    assert bp.encode_hello(hello) == (
        b'{"type":"hello","role":"kv_listener","client_id":"kv-listener-a",'
        b'"sources":["vllm-1","vllm-2"],"version":1}\n'
    )
    assert bp.decode_hello(bp.encode_hello(hello)) == hello
    assert bp.decode_hello_body(bp.encode_hello(hello)) == hello
    # The final newline may be missing; CRLF is tolerated.
    assert bp.decode_hello_body(bp.encode_hello(hello)[:-1]) == hello
    assert bp.decode_hello(bp.encode_hello(hello)[:-1] + b"\r\n") == hello


def test_router_lines_are_the_spec_shapes() -> None:
    assert bp.encode_message(Welcome("abc")) == b'{"type":"welcome","session_id":"abc"}\n'
    assert bp.encode_message(Subscribe("s1", "vllm-1", None)) == (
        b'{"type":"subscribe","stream_id":"s1","announced_source":"vllm-1","last_event_id":null}\n'
    )
    assert bp.encode_message(Subscribe("s1", "vllm-1", "ab12cd34-7")) == (
        b'{"type":"subscribe","stream_id":"s1","announced_source":"vllm-1",'
        b'"last_event_id":"ab12cd34-7"}\n'
    )
    assert bp.encode_message(Unsubscribe("s1")) == b'{"type":"unsubscribe","stream_id":"s1"}\n'
    assert bp.encode_message(Forbidden("backend_not_allowed")) == (
        b'{"type":"forbidden","reason":"backend_not_allowed"}\n'
    )
    assert bp.forbidden_body("role_mismatch") == b'{"type":"forbidden","reason":"role_mismatch"}\n'
    for m in (Welcome("x" * 128), Subscribe("a_b-C", "vllm-1", "e-1"), Unsubscribe("z"),
              Forbidden("")):
        assert bp.decode_message(bp.encode_message(m)) == m


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"", R.NOT_ONE_LINE),
        (b"\n", R.NOT_ONE_LINE),
        (b'{"type":"hello"}\n{"type":"hello"}\n', R.NOT_ONE_LINE),
        (b'{"type":"hello","role":"kv_listener","client_id":"a","sources":[],"version":1}\nx',
         R.NOT_ONE_LINE),
        (b"\xff\xfe\n", R.NOT_UTF8),
        (b"{not json}\n", R.NOT_JSON),
        (b"[1,2]\n", R.NOT_OBJECT),
        (b'{"role":"kv_listener"}\n', R.MISSING_FIELD),
        (b'{"type":"welcome","session_id":"x"}\n', R.WRONG_TYPE),
        (b'{"type":"hello","role":"admin","client_id":"a","sources":[],"version":1}', R.INVALID_FIELD),
        (b'{"type":"hello","role":"kv_listener","client_id":"a b","sources":[],"version":1}',
         R.INVALID_FIELD),
        (b'{"type":"hello","role":"kv_listener","client_id":"a","sources":"vllm-1","version":1}',
         R.INVALID_FIELD),
        (b'{"type":"hello","role":"kv_listener","client_id":"a","sources":["v/1"],"version":1}',
         R.INVALID_FIELD),
        (b'{"type":"hello","role":"kv_listener","client_id":"a","sources":["v","v"],"version":1}',
         R.INVALID_FIELD),
        (b'{"type":"hello","role":"kv_listener","client_id":"a","sources":[],"version":true}',
         R.INVALID_FIELD),
        (b'{"type":"hello","role":"kv_listener","client_id":"a","sources":[],"version":2}',
         R.UNSUPPORTED_VERSION),
        (b'{"type":"hello","role":"kv_listener","client_id":"a","sources":[]}', R.MISSING_FIELD),
    ],
)
def test_malformed_hello_bodies_are_refused_with_a_reason(body: bytes, reason: R) -> None:
    assert refusal(bp.decode_hello_body, body) is reason


def test_hello_ignores_unknown_keys() -> None:
    line = b'{"type":"hello","role":"broker","client_id":"b","sources":["x"],"version":1,"more":{}}'
    assert bp.decode_hello(line) == Hello(Role.BROKER, "b", ("x",))


def test_oversized_lines_are_refused_on_both_sides() -> None:
    big = "v" * 64
    n = MAX_LINE_BYTES // 67 + 1  # enough distinct 64-char names to pass 64 KiB
    sources = [f"{i:04d}{big[4:]}" for i in range(n)]
    hello = Hello(Role.KV_LISTENER, "a", tuple(sources))
    assert refusal(bp.encode_hello, hello) is R.LINE_TOO_LONG
    line = json.dumps({"type": "hello", "role": "kv_listener", "client_id": "a",
                       "sources": sources, "version": 1}).encode()
    assert len(line) > MAX_LINE_BYTES
    for decode in (bp.decode_hello, bp.decode_hello_body, bp.decode_message):
        assert refusal(decode, line) is R.LINE_TOO_LONG
    # Exactly at the cap is fine.
    pad = MAX_LINE_BYTES - len(b'{"type":"forbidden","reason":""}')
    with pytest.raises(BusProtocolError):  # reason too long, not the line
        bp.decode_message(b'{"type":"forbidden","reason":"' + b"r" * pad + b'"}')
    padded = b'{"type":"unsubscribe","stream_id":"s","x":"' + b"p" * (
        MAX_LINE_BYTES - len(b'{"type":"unsubscribe","stream_id":"s","x":""}')) + b'"}'
    assert len(padded) == MAX_LINE_BYTES
    assert bp.decode_message(padded) == Unsubscribe("s")
    assert refusal(bp.decode_message, padded[:-2] + b'p"}') is R.LINE_TOO_LONG


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        (b'{"type":"gossip"}', R.UNKNOWN_TYPE),
        (b'{"type":"hello","role":"kv_listener","client_id":"a","sources":[],"version":1}',
         R.WRONG_TYPE),
        (b'{"type":"welcome","session_id":""}', R.INVALID_FIELD),
        (b'{"type":"welcome","session_id":"a\\nb"}', R.INVALID_FIELD),
        (b'{"type":"subscribe","stream_id":"../x","announced_source":"v","last_event_id":null}',
         R.INVALID_FIELD),
        (b'{"type":"subscribe","stream_id":"s","announced_source":"v"}', R.MISSING_FIELD),
        (b'{"type":"subscribe","stream_id":"s","announced_source":"v","last_event_id":"a\\nb"}',
         R.INVALID_FIELD),
        (b'{"type":"subscribe","stream_id":"s","announced_source":"v","last_event_id":7}',
         R.INVALID_FIELD),
        (b'{"type":"unsubscribe"}', R.MISSING_FIELD),
        (b'{"type":"forbidden","reason":null}', R.INVALID_FIELD),
        (b'"welcome"', R.NOT_OBJECT),
    ],
)
def test_malformed_router_lines(line: bytes, reason: R) -> None:
    assert refusal(bp.decode_message, line) is reason


def test_encoders_refuse_what_decoders_refuse() -> None:
    with pytest.raises(BusProtocolError):
        bp.encode_message(Subscribe("bad id", "v", None))
    with pytest.raises(BusProtocolError):
        bp.encode_message(Subscribe("s", "v", "x\ny"))
    with pytest.raises(BusProtocolError):
        bp.encode_hello(Hello(Role.KV_LISTENER, "a", ("v", "v")))


def test_line_splitter_byte_by_byte_and_cap() -> None:
    data = (bp.encode_message(Welcome("w")) + b"\n" + bp.encode_message(Unsubscribe("s"))
            + b'{"partial"')
    s = LineSplitter()
    got: list[bytes] = []
    for i in range(len(data)):
        got.extend(s.feed(data[i:i + 1]))
    assert [bp.decode_message(x) for x in got] == [Welcome("w"), Unsubscribe("s")]
    assert s.pending == len(b'{"partial"')

    s = LineSplitter(max_line_bytes=8)
    assert s.feed(b"12345678\n") == [b"12345678"]
    assert refusal(s.feed, b"123456789") is R.LINE_TOO_LONG  # refused before its newline arrives
    with pytest.raises(BusProtocolError):
        LineSplitter(max_line_bytes=8).feed(b"123456789\n")


@given(st.lists(st.sampled_from([b"a", b"bc", b"\n", b"\n\n", b"{}", b"xyz"]), max_size=40),
       st.data())
def test_line_splitter_any_split_gives_the_same_lines(parts: list[bytes], data: st.DataObject) -> None:
    blob = b"".join(parts)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(blob)), max_size=10)))
    s = LineSplitter()
    got: list[bytes] = []
    prev = 0
    for c in [*cuts, len(blob)]:
        got.extend(s.feed(blob[prev:c]))
        prev = c
    complete = blob[: blob.rfind(b"\n") + 1] if b"\n" in blob else b""
    assert got == [x for x in complete.split(b"\n") if x.strip()]


def test_paths() -> None:
    assert bp.stream_path("s-1_A") == "/bus/v1/streams/s-1_A"
    assert bp.parse_stream_path("/bus/v1/streams/s-1_A") == "s-1_A"
    for bad in ("/bus/v1/streams/", "/bus/v1/streams/a/b", "/bus/v1/streams/%2e%2e", "/bus/v1/x"):
        assert bp.parse_stream_path(bad) is None
    with pytest.raises(BusProtocolError):
        bp.stream_path("a/b")


def test_token_hash_matches_sha256sum() -> None:
    token = b"s3cr3t-Token_42"
    expected = "sha256:" + hashlib.sha256(token).hexdigest()
    assert bp.token_hash(token) == expected
    assert bp.is_token_hash(expected)
    assert not bp.is_token_hash(expected.upper())
    assert not bp.is_token_hash("sha256:abc")
    sha256sum = shutil.which("sha256sum")
    if sha256sum is not None:  # the operator's recipe: printf %s "$TOKEN" | sha256sum
        out = subprocess.run([sha256sum], input=token, capture_output=True, check=True).stdout
        assert bp.token_hash(token) == "sha256:" + out.split()[0].decode()
    assert bp.token_hash_matches(expected, expected)
    assert not bp.token_hash_matches(bp.token_hash(b"other"), expected)
    assert not bp.token_hash_matches(expected, None)


@pytest.mark.parametrize(
    ("header", "token"),
    [
        (b"Bearer abc.DEF-123", b"abc.DEF-123"),
        (b"bearer abc", b"abc"),
        (b"  BEARER   abc  ", b"abc"),
        (b"Basic abc", None),
        (b"Bearer", None),
        (b"Bearer ", None),
        (b"Bearer a b", None),
        (b"Bearer \xc3\xa9", None),
        (b"abc", None),
    ],
)
def test_parse_bearer(header: bytes, token: bytes | None) -> None:
    assert bp.parse_bearer(header) == token


def _record(i: int) -> bytes:
    return encode_record(Record(f"e-{i}", RecordEvent.CACHE_CREATED, "vllm-1", "a" * 64, 16,
                                Tier.GPU_HOT, 1.5))


def test_stream_end_kind_reads_the_last_record() -> None:
    draining = encode_control(ControlEvent.DRAINING, "vllm-1")
    overflow = encode_control(ControlEvent.BUFFER_OVERFLOW, "vllm-1")
    assert bp.stream_end_kind(_record(1) + draining) is StreamEnd.DRAINING
    assert bp.stream_end_kind(draining) is StreamEnd.DRAINING
    assert bp.stream_end_kind(_record(1) + overflow) is StreamEnd.BUFFER_OVERFLOW
    assert bp.stream_end_kind((_record(1) + draining).replace(b"\n", b"\r\n")) is StreamEnd.DRAINING
    assert bp.stream_end_kind(draining + _record(2)) is StreamEnd.OTHER
    assert bp.stream_end_kind(_record(1)) is StreamEnd.OTHER
    assert bp.stream_end_kind(_record(1) + encode_comment("ping")) is StreamEnd.OTHER
    assert bp.stream_end_kind(b"") is StreamEnd.OTHER
    # The tail the server keeps is enough for the control record.
    tail = (_record(1) * 5 + draining)[-bp.STREAM_TAIL_BYTES:]
    assert bp.stream_end_kind(tail) is StreamEnd.DRAINING
