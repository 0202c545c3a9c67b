"""SSE wire format of the prefix event stream (SPEC §6), both directions.

Owns the exact bytes: `encode_record` / `encode_control` / `encode_comment` frame what
`GET /events/{backend}` and the push-mode stream bodies carry (one implementation, so the two
transports cannot drift apart), and `SseParser` reads them back incrementally (router consumer,
event-bus server, tests). Pure: no I/O.

Encoding rules: `\n` line ends; `id:` line only for numbered records; the data line is
`core.records`' one encoding of the record (compact JSON, keys in SPEC order, `ts` rounded to
milliseconds).
Parsing follows the WHATWG event-stream rules (CR, LF and CRLF line ends, a leading BOM, comments,
`data:` lines joined by `\n`, a block without data dispatches nothing) with two caps a hostile
peer cannot get past: one line, and one event's data, at most 1 MiB each by default.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Final

from msgspec.structs import astuple

from kv_listener.core.cmodules import c_attr
from kv_listener.core.model import Tier
from kv_listener.core.records import (
    ControlEvent,
    Record,
    RecordEvent,
    control_data,
    data_head,
    encode_data,
    record_data,
)
from kv_listener.core.structs import FrozenStruct, fields_in_order

# ControlEvent and record_data are re-exported: SSE users name them from here too.
__all__ = [
    "MAX_DATA_BYTES", "MAX_LINE_BYTES", "PING", "ControlEvent", "SseError", "SseEvent",
    "SseParser", "encode_comment", "encode_control", "encode_record", "encode_record_list",
    "encode_record_list_python", "encode_records", "parse_sse", "record_data",
]

MAX_LINE_BYTES = 1 << 20
MAX_DATA_BYTES = 1 << 20
PING = b": ping\n\n"


def encode_record(record: Record) -> bytes:
    """`id: <id>\\nevent: <event>\\ndata: <json>\\n\\n` (no id line when `record.id` is None)."""
    data = encode_data(record)
    # f"{member}" of a StrEnum is its value, without the Python-level `.value` property
    if record.id is not None:
        return f"id: {record.id}\nevent: {record.event}\ndata: {data}\n\n".encode()
    return f"event: {record.event}\ndata: {data}\n\n".encode()


def encode_records(records: Iterable[Record]) -> bytes:
    return b"".join(encode_record_list(list(records)))


# Final: compiled (setup.py), C statics rather than a module dict lookup per read
_CLEARED: Final = RecordEvent.CACHE_CLEARED
_CREATED: Final = RecordEvent.CACHE_CREATED
_OFFLOADED: Final = RecordEvent.CACHE_OFFLOADED
#: A tier's text by dict (`f"{member}"` of a StrEnum goes through Enum.__format__: 6x slower)
_TIER_TEXT: dict[Tier | None, str] = {t: t.value for t in Tier}
# The str and bytes methods of the prefix check, looked up once: compiled, `s.isascii()` is a
# call by name (a method lookup each time), a method descriptor held as a C static is called
# directly; two per record.
_isascii: Final[Any] = str.isascii
_isalnum: Final[Any] = bytes.isalnum
# A record's fields as one tuple, in this order (checked at import): compiled, each attribute
# of a msgspec Struct is a generic lookup (~160 instructions), and a record has eight of them.
_astuple: Final[Any] = astuple
_RECORD_FIELDS: Final = fields_in_order(
    Record, ("id", "event", "backend", "prefix_hash", "token_count", "tier", "ts"))


def _head_of(event: RecordEvent, backend: str) -> str:
    """A record's text between its `id:` value and its fields: `\nevent: <event>\ndata: ` and
    the start of the data (`data_head`). Shared by both encoders below."""
    return f"\nevent: {event}\ndata: {data_head(event, backend)}"


def _tail_of(ts: float) -> str | None:
    """`,"ts":<ts to the ms>}\n\n`, the end of a record; None for inf and nan, which are not
    JSON numbers (`encode_record`'s json.dumps path writes them). Shared by both encoders."""
    rounded = round(ts, 3)
    return None if rounded - rounded != 0.0 else f',"ts":{rounded!r}}}\n\n'


def encode_record_list(records: Sequence[Record]) -> list[bytes]:
    """`[encode_record(r) for r in records]`, the same bytes, built faster for the records of
    one publish (two per block on a busy engine): by `core._sseenc` in C where setup.py built
    it, else by `encode_record_list_python`."""
    native = _NATIVE
    if native is not None:
        out: list[bytes] = native(records)
        return out
    return encode_record_list_python(records)


def encode_record_list_python(records: Sequence[Record]) -> list[bytes]:
    """`encode_record_list` in Python (compiled by mypyc where it can be): what they share is
    worked out once per list (the `event:` line and the start of the data of each event type
    and backend, the text of each `ts`, whose rounding and `repr` cost more than the rest of a
    record), and each numbered record of the plain kind `core.records` writes directly is one
    f-string. Any other record goes through `encode_record`."""
    out: list[bytes] = []
    heads: dict[tuple[RecordEvent, str], str] = {}
    tails: dict[float, str | None] = {}
    for r in records:
        f: tuple[Any, ...] = _astuple(r)  # typed: unpacked by index, not by iteration
        # event, count, tier and ts untyped: a record may hold anything there (a plain str
        # event, an int ts, a float count), which the checks below send to encode_record; a
        # typed local would be a cast, which raises
        rid: str | None
        backend: str
        prefix: str | None
        rid, event, backend, prefix, count, tier, ts = f
        if rid is None or type(ts) is not float or type(event) is not RecordEvent:
            out.append(encode_record(r))
            continue
        # 0.0 and -0.0 are one key with two tails (-0.0 keeps its sign): zero is not cached
        tail = tails.get(ts, "") if ts != 0.0 else _tail_of(ts)
        if tail == "":
            tail = tails[ts] = _tail_of(ts)
        head = heads.get((event, backend))
        if head is None:
            head = heads[(event, backend)] = _head_of(event, backend)
        if tail is None:
            out.append(encode_record(r))
        elif event is _CLEARED:
            out.append(f"id: {rid}{head}{tail}".encode())
        elif prefix is None or not (_isascii(prefix) and _isalnum(prefix.encode())):
            # (bytes.isalnum: the same verdict for ASCII text, by table, 4x faster than str's)
            out.append(encode_record(r))
        elif event is not _CREATED and event is not _OFFLOADED:
            out.append(f'id: {rid}{head},"prefix_hash":"{prefix}"{tail}'.encode())
        elif type(count) is not int or (tier_text := _TIER_TEXT.get(tier)) is None:
            out.append(encode_record(r))
        else:
            out.append(f'id: {rid}{head},"prefix_hash":"{prefix}","token_count":{count},'
                       f'"tier":"{tier_text}"{tail}'.encode())
    return out


# `_sseenc.Encoder(...).encode_list`, or None where it was not built; its fallback for records
# not of the plain kinds is `encode_record`
_ENCODER: Final[Any] = c_attr("_sseenc", "Encoder")
_NATIVE: Final[Any] = None if _ENCODER is None else _ENCODER(
    Record, RecordEvent, _CLEARED, _CREATED, _OFFLOADED, _TIER_TEXT, _head_of, _tail_of,
    encode_record).encode_list


def encode_control(event: ControlEvent, backend: str) -> bytes:
    """`event: draining\\ndata: {"event":"draining","backend":"..."}\\n\\n` (no id line)."""
    return f"event: {event.value}\ndata: {control_data(event, backend)}\n\n".encode()


def encode_comment(text: str) -> bytes:
    """`: <text>\\n\\n`: ignored by every SSE client; used as keep-alive (`: ping`)."""
    if "\n" in text or "\r" in text:
        raise ValueError("an SSE comment is one line")
    return f": {text}\n\n".encode()


# --- parsing --------------------------------------------------------------------------------


class SseError(ValueError):
    """The peer broke a cap (line or data too long): the consumer closes the stream and resumes."""


class SseEvent(FrozenStruct, frozen=True, gc=False):
    """One dispatched event. `id` is this event's own `id:` field (None when it had none);
    `last_event_id` is the WHATWG "last event ID" after it (ids persist across events), which is
    what a consumer sends as `Last-Event-ID` when it reconnects."""

    event: str
    data: str
    id: str | None
    last_event_id: str


class SseParser:
    """Incremental event-stream parser; `feed()` accepts any split of the bytes, even 1 byte."""

    def __init__(
        self, *, max_line_bytes: int = MAX_LINE_BYTES, max_data_bytes: int = MAX_DATA_BYTES,
        last_event_id: str = "",
    ) -> None:
        self.max_line_bytes = max_line_bytes
        self.max_data_bytes = max_data_bytes
        # WHATWG "last event ID string": updated when an event block ends (blank line), so a
        # stream cut between a record's `id:` line and its end does not advance it.
        self.last_event_id = last_event_id
        self.comments = 0  # comment lines seen (keep-alives)
        self._buf = bytearray()
        self._skip_lf = False  # last line ended in CR: a following LF belongs to that line end
        self._bom_checked = False
        self._id_buffer = last_event_id  # WHATWG "last event ID buffer": persists across events
        self._own_id: str | None = None
        self._event = ""
        self._data: list[str] = []
        self._data_len = 0

    def feed(self, chunk: bytes) -> list[SseEvent]:
        out: list[SseEvent] = []
        buf = self._buf
        buf += chunk
        if not self._bom_checked:
            if len(buf) < 3 and b"\xef\xbb\xbf".startswith(bytes(buf)):
                return out  # could still be a BOM
            if buf.startswith(b"\xef\xbb\xbf"):
                del buf[:3]
            self._bom_checked = True
        pos = 0
        n = len(buf)
        # Next CR / LF at or after pos (-1: none left in this buffer). Searched again only when
        # passed, so a big chunk of many lines costs one pass, not one scan per line.
        next_cr = buf.find(b"\r")
        next_lf = buf.find(b"\n")
        while pos < n:
            if self._skip_lf:
                self._skip_lf = False
                if buf[pos] == 0x0A:
                    pos += 1
                    continue
            if 0 <= next_cr < pos:
                next_cr = buf.find(b"\r", pos)
            if 0 <= next_lf < pos:
                next_lf = buf.find(b"\n", pos)
            if next_cr < 0 and next_lf < 0:
                break
            end = next_lf if next_cr < 0 or 0 <= next_lf < next_cr else next_cr
            if end - pos > self.max_line_bytes:
                raise SseError(f"SSE line longer than {self.max_line_bytes} bytes")
            self._line(bytes(buf[pos:end]), out)
            pos = end + 1
            self._skip_lf = end == next_cr
        del buf[:pos]
        if len(buf) > self.max_line_bytes:
            raise SseError(f"SSE line longer than {self.max_line_bytes} bytes")
        return out

    def _line(self, raw: bytes, out: list[SseEvent]) -> None:
        if not raw:
            self._dispatch(out)
            return
        if raw[0] == 0x3A:  # ":"
            self.comments += 1
            return
        name, colon, value_b = raw.partition(b":")
        if colon and value_b.startswith(b" "):
            value_b = value_b[1:]
        if name == b"data":
            self._data_len += len(value_b) + (1 if self._data else 0)
            if self._data_len > self.max_data_bytes:
                raise SseError(f"SSE data longer than {self.max_data_bytes} bytes")
            self._data.append(value_b.decode("utf-8", errors="replace"))
        elif name == b"event":
            self._event = value_b.decode("utf-8", errors="replace")
        elif name == b"id" and b"\x00" not in value_b:
            self._own_id = value_b.decode("utf-8", errors="replace")
            self._id_buffer = self._own_id
        # `retry` and unknown fields are ignored (reconnect timing is the consumer's own).

    def _dispatch(self, out: list[SseEvent]) -> None:
        self.last_event_id = self._id_buffer
        if self._data:
            out.append(SseEvent(self._event or "message", "\n".join(self._data), self._own_id,
                                self.last_event_id))
        self._event = ""
        self._data = []
        self._data_len = 0
        self._own_id = None


def parse_sse(chunks: Iterable[bytes]) -> list[SseEvent]:
    """Parse a whole byte stream given as chunks (an incomplete last event is not returned)."""
    parser = SseParser()
    out: list[SseEvent] = []
    for chunk in chunks:
        out.extend(parser.feed(chunk))
    return out
