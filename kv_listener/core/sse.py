"""SSE wire format of the prefix event stream (SPEC §6), both directions.

Owns the exact bytes: `encode_record` / `encode_control` / `encode_comment` produce what
`GET /events/{backend}` and the push-mode stream bodies carry (one implementation, so the two
transports cannot drift apart), and `SseParser` reads them back incrementally (router consumer,
event-bus server, tests). Pure: no I/O.

Encoding rules: `\n` line ends; `id:` line only for numbered records; data is compact JSON with
the keys in SPEC order; `ts` rounded to milliseconds.
Parsing follows the WHATWG event-stream rules (CR, LF and CRLF line ends, a leading BOM, comments,
`data:` lines joined by `\n`, a block without data dispatches nothing) with two caps a hostile
peer cannot get past: one line, and one event's data, at most 1 MiB each by default.
"""

from __future__ import annotations

import enum
import functools
import json
from collections.abc import Iterable

import msgspec

from kv_listener.core.eventlog import Record, RecordEvent

_SEPARATORS = (",", ":")
MAX_LINE_BYTES = 1 << 20
MAX_DATA_BYTES = 1 << 20
PING = b": ping\n\n"


class ControlEvent(enum.StrEnum):
    """Stream-control records: no `id:`, the stream ends after them. Values are metric labels."""

    DRAINING = "draining"
    BUFFER_OVERFLOW = "buffer_overflow"


def record_data(record: Record) -> dict[str, object]:
    """The JSON object of a record's `data:` line, keys in SPEC order."""
    data: dict[str, object] = {"event": record.event.value, "backend": record.backend}
    if record.event is not RecordEvent.CACHE_CLEARED:
        data["prefix_hash"] = record.prefix_hash
    if record.event is RecordEvent.CACHE_CREATED or record.event is RecordEvent.CACHE_OFFLOADED:
        data["token_count"] = record.token_count
        data["tier"] = None if record.tier is None else record.tier.value
    data["ts"] = round(record.ts, 3)
    return data


def encode_record(record: Record) -> bytes:
    """`id: <id>\\nevent: <event>\\ndata: <json>\\n\\n` (no id line when `record.id` is None)."""
    data = _plain_data(record)
    if data is None:
        data = json.dumps(record_data(record), separators=_SEPARATORS)
    # f"{member}" of a StrEnum is its value, without the Python-level `.value` property
    if record.id is not None:
        return f"id: {record.id}\nevent: {record.event}\ndata: {data}\n\n".encode()
    return f"event: {record.event}\ndata: {data}\n\n".encode()


_UPSERTS = (RecordEvent.CACHE_CREATED, RecordEvent.CACHE_OFFLOADED)


def _plain_data(record: Record) -> str | None:
    """The hot path (two records per block on a busy engine): the same text as
    `json.dumps(record_data(record))`, written directly; None when a field is not of the plain
    kind this relies on (then the caller uses `json.dumps`). Nothing here needs JSON escaping:
    a prefix hash of ASCII letters and digits, the backend name quoted by `json.dumps` once
    (`_head`), enum values, an int, and a finite float, whose JSON form is its `repr`."""
    event = record.event
    ts = round(record.ts, 3)
    if type(ts) is not float or ts - ts != 0.0:
        return None
    head = _head(event, record.backend)
    if event is RecordEvent.CACHE_CLEARED:
        return f'{head},"ts":{ts!r}}}'
    prefix = record.prefix_hash
    if prefix is None or not (prefix.isascii() and prefix.isalnum()):
        return None
    if event not in _UPSERTS:
        return f'{head},"prefix_hash":"{prefix}","ts":{ts!r}}}'
    count, tier = record.token_count, record.tier
    if type(count) is not int or tier is None:
        return None
    return f'{head},"prefix_hash":"{prefix}","token_count":{count},"tier":"{tier}","ts":{ts!r}}}'


@functools.lru_cache(maxsize=1024)
def _head(event: RecordEvent, backend: str) -> str:
    """`{"event":"...","backend":"..."` (a few backends per process)."""
    return f'{{"event":"{event.value}","backend":{json.dumps(backend)}'


def encode_records(records: Iterable[Record]) -> bytes:
    return b"".join(encode_record(r) for r in records)


def encode_control(event: ControlEvent, backend: str) -> bytes:
    """`event: draining\\ndata: {"event":"draining","backend":"..."}\\n\\n` (no id line)."""
    data = json.dumps({"event": event.value, "backend": backend}, separators=_SEPARATORS)
    return f"event: {event.value}\ndata: {data}\n\n".encode()


def encode_comment(text: str) -> bytes:
    """`: <text>\\n\\n`: ignored by every SSE client; used as keep-alive (`: ping`)."""
    if "\n" in text or "\r" in text:
        raise ValueError("an SSE comment is one line")
    return f": {text}\n\n".encode()


# --- parsing --------------------------------------------------------------------------------


class SseError(ValueError):
    """The peer broke a cap (line or data too long): the consumer closes the stream and resumes."""


class SseEvent(msgspec.Struct, frozen=True, gc=False):
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
