"""Event-bus wire protocol (SPEC §7), the part that is neither HTTP/2 nor SSE.

Owns: the NDJSON control lines of a push-mode session (`hello` from the listener; `welcome`,
`subscribe`, `unsubscribe`, `forbidden` from the router), their encoding (compact JSON, keys in
SPEC order, one `\\n`-terminated line) and strict decoding (every field checked, a typed reason
for every refusal), the 64 KiB line cap, the request paths, bearer-token parsing and the
`sha256:<hex>` token hash the router stores, and recognizing how a pushed SSE body ended
(`draining` / `buffer_overflow`). Both ends use this module, so they cannot disagree.

Pure: no I/O, no clock. Decoders raise `BusProtocolError` carrying a `BusProtocolErrorReason`
(an Enum whose value is a metric label); the edges decide what a refusal means (HTTP 400, a
counted drop, the end of a session).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
import re
from dataclasses import dataclass
from typing import Any

PROTOCOL_VERSION = 1
#: Longest control line either side accepts (SPEC §7: "oversized line (> 64 KiB)"), excluding
#: its `\n`.
MAX_LINE_BYTES = 64 * 1024
NDJSON_CONTENT_TYPE = "application/x-ndjson"
SESSION_PATH = "/bus/v1/session"
STREAMS_PATH = "/bus/v1/streams/"
#: Client ids, announced sources (backend names) and stream ids share the backend-name alphabet:
#: they travel in URL paths and metric labels, so nothing needs escaping.
ID_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")  # always fullmatch: `$` also matches before a final \n
_MAX_SESSION_ID = 128
_MAX_EVENT_ID = 1024
_MAX_REASON = 256
_TOKEN_HASH_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
_SEPARATORS = (",", ":")


class Role(enum.StrEnum):
    """Role of a bus client; a credential (broker entry) carries exactly one."""

    KV_LISTENER = "kv_listener"
    BROKER = "broker"


_ROLES = frozenset(r.value for r in Role)


class MessageType(enum.StrEnum):
    HELLO = "hello"
    WELCOME = "welcome"
    SUBSCRIBE = "subscribe"
    UNSUBSCRIBE = "unsubscribe"
    FORBIDDEN = "forbidden"


class BusProtocolErrorReason(enum.StrEnum):
    """Why a control line was refused. Values are metric labels."""

    LINE_TOO_LONG = "line_too_long"
    NOT_UTF8 = "not_utf8"
    NOT_JSON = "not_json"
    NOT_OBJECT = "not_object"
    UNKNOWN_TYPE = "unknown_type"  # a `type` this version does not know (skippable)
    WRONG_TYPE = "wrong_type"  # a known type where another was required
    MISSING_FIELD = "missing_field"
    INVALID_FIELD = "invalid_field"
    UNSUPPORTED_VERSION = "unsupported_version"
    NOT_ONE_LINE = "not_one_line"  # hello body: nothing, or more than one line


class NoSessionError(LookupError):
    """No live listener session announces the backend yet (event bus, SPEC §7). The event-bus
    server raises it (its `NoSession`) from `open_announced_stream`; a consumer retries every
    `reconnect_interval_ms` and counts it as `no_session`. Here, so that the router's consumer
    and server share it without importing each other."""


class BusProtocolError(ValueError):
    def __init__(self, reason: BusProtocolErrorReason, detail: str) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True, slots=True)
class Hello:
    """The listener's one-line request body: who it is and which backends it announces."""

    role: Role
    client_id: str
    sources: tuple[str, ...]
    version: int = PROTOCOL_VERSION


@dataclass(frozen=True, slots=True)
class Welcome:
    """The router accepted the session (always its first line)."""

    session_id: str


@dataclass(frozen=True, slots=True)
class Subscribe:
    """Push `announced_source` from `last_event_id` (None: a new consumer, resync) as stream
    `stream_id`."""

    stream_id: str
    announced_source: str
    last_event_id: str | None


@dataclass(frozen=True, slots=True)
class Unsubscribe:
    """End that stream's request body (within 1 s)."""

    stream_id: str


@dataclass(frozen=True, slots=True)
class Forbidden:
    """The credential no longer allows this session: it ends."""

    reason: str


#: What the router sends on a session's response stream.
RouterMessage = Welcome | Subscribe | Unsubscribe | Forbidden


# --- encoding -------------------------------------------------------------------------------


def _line(obj: dict[str, Any]) -> bytes:
    data = json.dumps(obj, separators=_SEPARATORS, ensure_ascii=False).encode("utf-8") + b"\n"
    if len(data) - 1 > MAX_LINE_BYTES:
        raise BusProtocolError(BusProtocolErrorReason.LINE_TOO_LONG,
                               f"{len(data) - 1} bytes > {MAX_LINE_BYTES}")
    return data


def encode_hello(hello: Hello) -> bytes:
    """`{"type":"hello","role":...,"client_id":...,"sources":[...],"version":1}\\n`."""
    _check_hello(hello.role, hello.client_id, list(hello.sources), hello.version)
    return _line({"type": MessageType.HELLO.value, "role": hello.role.value,
                  "client_id": hello.client_id, "sources": list(hello.sources),
                  "version": hello.version})


def encode_message(message: RouterMessage) -> bytes:
    """One router control line, validated like the decoder validates it."""
    if isinstance(message, Welcome):
        _check_session_id(message.session_id)
        return _line({"type": MessageType.WELCOME.value, "session_id": message.session_id})
    if isinstance(message, Subscribe):
        _check_id("stream_id", message.stream_id)
        _check_id("announced_source", message.announced_source)
        _check_event_id(message.last_event_id)
        return _line({"type": MessageType.SUBSCRIBE.value, "stream_id": message.stream_id,
                      "announced_source": message.announced_source,
                      "last_event_id": message.last_event_id})
    if isinstance(message, Unsubscribe):
        _check_id("stream_id", message.stream_id)
        return _line({"type": MessageType.UNSUBSCRIBE.value, "stream_id": message.stream_id})
    _check_reason(message.reason)
    return _line({"type": MessageType.FORBIDDEN.value, "reason": message.reason})


def forbidden_body(reason: str) -> bytes:
    """Body of a `403`: the same JSON object as the `forbidden` line (SPEC §7)."""
    return encode_message(Forbidden(reason))


# --- decoding -------------------------------------------------------------------------------


def _object(line: bytes) -> dict[str, Any]:
    if line.endswith(b"\n"):
        line = line[:-1]
    if line.endswith(b"\r"):
        line = line[:-1]
    if len(line) > MAX_LINE_BYTES:
        raise BusProtocolError(BusProtocolErrorReason.LINE_TOO_LONG,
                               f"{len(line)} bytes > {MAX_LINE_BYTES}")
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        raise BusProtocolError(BusProtocolErrorReason.NOT_UTF8, "line is not UTF-8") from None
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than the C stack allows
        raise BusProtocolError(BusProtocolErrorReason.NOT_JSON, "line is not JSON") from None
    if not isinstance(obj, dict):
        raise BusProtocolError(BusProtocolErrorReason.NOT_OBJECT, "line is not a JSON object")
    return obj


def _field(obj: dict[str, Any], name: str) -> Any:
    if name not in obj:
        raise BusProtocolError(BusProtocolErrorReason.MISSING_FIELD, f"{name} is missing")
    return obj[name]


def _invalid(name: str, why: str) -> BusProtocolError:
    return BusProtocolError(BusProtocolErrorReason.INVALID_FIELD, f"{name}: {why}")


def _check_id(name: str, value: object) -> str:
    if not isinstance(value, str) or not ID_RE.fullmatch(value):
        raise _invalid(name, "must match [A-Za-z0-9_-]{1,64}")
    return value


def _check_session_id(value: object) -> str:
    if (not isinstance(value, str) or not 0 < len(value) <= _MAX_SESSION_ID
            or not value.isascii() or not value.isprintable()):
        raise _invalid("session_id", f"must be 1 to {_MAX_SESSION_ID} printable ASCII characters")
    return value


def _check_event_id(value: object) -> str | None:
    if value is None:
        return None
    # An SSE id must not contain CR, LF or NUL (it would end or be ignored in the id: line).
    if (not isinstance(value, str) or len(value) > _MAX_EVENT_ID
            or any(c in value for c in "\r\n\x00") or not _is_text(value)):
        raise _invalid("last_event_id", "must be null or a string without CR, LF or NUL")
    return value


def _check_reason(value: object) -> str:
    if not isinstance(value, str) or len(value) > _MAX_REASON or not _is_text(value):
        raise _invalid("reason", f"must be a string of at most {_MAX_REASON} characters")
    return value


def _is_text(value: str) -> bool:
    """False for a string holding a lone surrogate (JSON lets `\\ud800` through): it could not
    be written as UTF-8 again."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_hello(role: object, client_id: object, sources: object, version: object) -> Hello:
    if not isinstance(role, str) or role not in _ROLES:
        raise _invalid("role", "must be kv_listener or broker")
    _check_id("client_id", client_id)
    if not isinstance(sources, list):
        raise _invalid("sources", "must be a list of backend names")
    for i, s in enumerate(sources):
        _check_id(f"sources[{i}]", s)
    if len(set(sources)) != len(sources):
        raise _invalid("sources", "must not repeat a backend")
    # bool is an int in Python; `true` is not a version.
    if isinstance(version, bool) or not isinstance(version, int):
        raise _invalid("version", "must be an integer")
    if version != PROTOCOL_VERSION:
        raise BusProtocolError(BusProtocolErrorReason.UNSUPPORTED_VERSION,
                               f"version {version} (this end speaks {PROTOCOL_VERSION})")
    assert isinstance(client_id, str)
    return Hello(Role(role), client_id, tuple(sources), version)


def decode_hello(line: bytes) -> Hello:
    """One hello line (with or without its `\\n`). Unknown keys are ignored (forward
    compatibility); everything the router relies on is checked."""
    obj = _object(line)
    kind = _field(obj, "type")
    if kind != MessageType.HELLO.value:
        raise BusProtocolError(BusProtocolErrorReason.WRONG_TYPE, "expected type hello")
    return _check_hello(_field(obj, "role"), _field(obj, "client_id"), _field(obj, "sources"),
                        _field(obj, "version"))


def decode_hello_body(body: bytes) -> Hello:
    """The whole body of `POST /bus/v1/session`: exactly one JSON line (its final `\\n` may be
    omitted), nothing after it."""
    if len(body) > MAX_LINE_BYTES + 2:
        raise BusProtocolError(BusProtocolErrorReason.LINE_TOO_LONG,
                               f"hello body of {len(body)} bytes > {MAX_LINE_BYTES}")
    line, nl, rest = body.partition(b"\n")
    if not line.strip() or rest:
        raise BusProtocolError(BusProtocolErrorReason.NOT_ONE_LINE,
                               "the hello body must be exactly one JSON line")
    return decode_hello(line + nl)


def decode_message(line: bytes) -> RouterMessage:
    """One router control line. An unknown `type` raises with reason `unknown_type`, which a
    listener skips (a newer router may send more kinds of lines)."""
    obj = _object(line)
    kind = _field(obj, "type")
    if kind == MessageType.WELCOME.value:
        return Welcome(_check_session_id(_field(obj, "session_id")))
    if kind == MessageType.SUBSCRIBE.value:
        return Subscribe(
            _check_id("stream_id", _field(obj, "stream_id")),
            _check_id("announced_source", _field(obj, "announced_source")),
            _check_event_id(_field(obj, "last_event_id")),
        )
    if kind == MessageType.UNSUBSCRIBE.value:
        return Unsubscribe(_check_id("stream_id", _field(obj, "stream_id")))
    if kind == MessageType.FORBIDDEN.value:
        return Forbidden(_check_reason(_field(obj, "reason")))
    if kind == MessageType.HELLO.value:
        raise BusProtocolError(BusProtocolErrorReason.WRONG_TYPE, "hello is not a router message")
    raise BusProtocolError(BusProtocolErrorReason.UNKNOWN_TYPE, "unknown message type")


class LineSplitter:
    """Incremental NDJSON splitter with the line cap: `feed()` takes any split of the bytes and
    returns the complete lines (without `\\n`); a line longer than `max_line_bytes` raises, even
    before its end arrives (a peer cannot make us buffer without bound)."""

    def __init__(self, max_line_bytes: int = MAX_LINE_BYTES) -> None:
        self.max_line_bytes = max_line_bytes
        self._buf = bytearray()

    @property
    def pending(self) -> int:
        """Bytes of an incomplete line held."""
        return len(self._buf)

    def feed(self, chunk: bytes) -> list[bytes]:
        buf = self._buf
        buf += chunk
        out: list[bytes] = []
        start = 0
        while True:
            nl = buf.find(b"\n", start)
            if nl < 0:
                break
            if nl - start > self.max_line_bytes:
                raise BusProtocolError(BusProtocolErrorReason.LINE_TOO_LONG,
                                       f"line longer than {self.max_line_bytes} bytes")
            line = bytes(buf[start:nl])
            if line.strip():
                out.append(line)
            start = nl + 1
        del buf[:start]
        if len(buf) > self.max_line_bytes:
            raise BusProtocolError(BusProtocolErrorReason.LINE_TOO_LONG,
                                   f"line longer than {self.max_line_bytes} bytes")
        return out


# --- paths ----------------------------------------------------------------------------------


def stream_path(stream_id: str) -> str:
    return STREAMS_PATH + _check_id("stream_id", stream_id)


def parse_stream_path(path: str) -> str | None:
    """`/bus/v1/streams/<id>` -> `<id>`; None for any other path or a malformed id."""
    if not path.startswith(STREAMS_PATH):
        return None
    stream_id = path[len(STREAMS_PATH):]
    return stream_id if ID_RE.fullmatch(stream_id) else None


# --- credentials ----------------------------------------------------------------------------


def token_hash(token: bytes) -> str:
    """What the router's `brokers[].token_hash` stores: `sha256:<64 lowercase hex>`, the same as
    `printf %s "$TOKEN" | sha256sum`."""
    return "sha256:" + hashlib.sha256(token).hexdigest()


def is_token_hash(value: str) -> bool:
    return bool(_TOKEN_HASH_RE.match(value))


def token_hash_matches(presented_hash: str, stored_hash: str | None) -> bool:
    """Constant-time comparison of two `sha256:<hex>` strings (False when none is stored)."""
    if stored_hash is None:
        return False
    return hmac.compare_digest(presented_hash.encode("ascii", "replace"),
                               stored_hash.encode("ascii", "replace"))


def valid_token(token: bytes) -> bool:
    """A bearer token must fit in a header value: visible ASCII, no spaces, not empty."""
    return bool(token) and all(0x21 <= b <= 0x7E for b in token)


def parse_bearer(value: bytes) -> bytes | None:
    """`Bearer <token>` (scheme case-insensitive, RFC 7235) -> token; None when malformed."""
    scheme, sep, token = value.strip().partition(b" ")
    token = token.strip()
    if not sep or scheme.lower() != b"bearer" or not valid_token(token):
        return None
    return token


# --- pushed SSE bodies ----------------------------------------------------------------------


class StreamEnd(enum.StrEnum):
    """How a pushed SSE body ended, read from its last record. Values are metric labels."""

    DRAINING = "draining"
    BUFFER_OVERFLOW = "buffer_overflow"
    OTHER = "other"  # anything else: unsubscribed, cut, or the listener's own end


#: Bytes of the tail of a body kept to recognize its last record (a control record is short).
STREAM_TAIL_BYTES = 512


def stream_end_kind(tail: bytes) -> StreamEnd:
    """Classify the end of a pushed SSE body from (at least) its last `STREAM_TAIL_BYTES` bytes:
    `draining` / `buffer_overflow` when its last record is that stream-control record."""
    block = tail.replace(b"\r\n", b"\n").replace(b"\r", b"\n").rstrip(b"\n")
    last = block.rpartition(b"\n\n")[2]
    for raw in last.split(b"\n"):
        name, _, value = raw.partition(b":")
        if name == b"event":
            value = value.removeprefix(b" ")
            if value == StreamEnd.DRAINING.value.encode():
                return StreamEnd.DRAINING
            if value == StreamEnd.BUFFER_OVERFLOW.value.encode():
                return StreamEnd.BUFFER_OVERFLOW
    return StreamEnd.OTHER
