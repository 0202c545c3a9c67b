"""The one contract of what crosses from listener to router: prefix records and control events.

Owns (SPEC §6, §8):
- the types: `RecordEvent` (the four prefix events), `ControlEvent` (`draining`,
  `buffer_overflow`: no `id:`, the stream ends after them) and `Record`, the one prefix record,
  made by the listener's event log, carried by both transports, decoded by the router's consumer
  and applied by both router indexes;
- the validator: `is_prefix_hash` (64 lowercase hex) and `is_token_count` (an exact JSON
  integer, 0 <= n < 2^53), what every record an index stores was checked with (by the decoder
  here, or by `router.index.IndexEvent` for records a router builds itself);
- the one encoder of a record's (and a control event's) JSON data: `encode_data`,
  `record_data`, `control_data`; the SSE framing around it is `core.sse`'s;
- the one decoder: `decode_data` turns a record's JSON data back into a `Record` or the
  `ControlEvent`, or raises `InvalidRecord` with a `RecordFault` (the router counts it).

Pure: no I/O.
"""

from __future__ import annotations

import enum
import functools
import json
import math
from typing import Any

from kv_listener.core.model import Tier
from kv_listener.core.structs import FrozenStruct

_SEPARATORS = (",", ":")
#: JSON numbers at or above this are not exact integers (IEEE doubles).
MAX_TOKEN_COUNT = 1 << 53
_HEX = frozenset("0123456789abcdef")


class RecordEvent(enum.StrEnum):
    """Event types of prefix records (the SSE `event:` field). Values are metric labels."""

    CACHE_CREATED = "cache_created"
    CACHE_OFFLOADED = "cache_offloaded"
    CACHE_EVICTED = "cache_evicted"
    CACHE_CLEARED = "cache_cleared"


class ControlEvent(enum.StrEnum):
    """Stream-control records: no `id:`, the stream ends after them. Values are metric labels."""

    DRAINING = "draining"
    BUFFER_OVERFLOW = "buffer_overflow"


_UPSERTS = (RecordEvent.CACHE_CREATED, RecordEvent.CACHE_OFFLOADED)
_PREFIX_EVENTS = {e.value: e for e in RecordEvent}
_CONTROL_EVENTS = {e.value: e for e in ControlEvent}


class Record(FrozenStruct, frozen=True, gc=False):
    """One prefix record of a backend's stream. `id` is None for the unnumbered records of a
    resync (and for records an embedding router builds itself).

    `prefix_hash` is None for `cache_cleared`; `token_count` and `tier` are None for
    `cache_evicted` and `cache_cleared`. `ts` is the listener's wall-clock time (the event log
    always sets it; a decoded record has it only when the data carried one).
    """

    id: str | None
    event: RecordEvent
    backend: str
    prefix_hash: str | None
    token_count: int | None
    tier: Tier | None
    ts: float | None

    def as_dict(self) -> dict[str, object]:
        """The data object with `ts` as held (not rounded), plus `id`: what a consumer saw."""
        data = _data(self, self.ts)
        data["id"] = self.id
        return data


def upsert_event(tier: Tier) -> RecordEvent:
    """The event that says "present in `tier`"."""
    return RecordEvent.CACHE_CREATED if tier is Tier.GPU_HOT else RecordEvent.CACHE_OFFLOADED


def default_tier(event: RecordEvent) -> Tier:
    """The tier of an upsert whose data names none (`cache_created` -> GPU)."""
    return Tier.GPU_HOT if event is RecordEvent.CACHE_CREATED else Tier.STORAGE_WARM


# --- validation -----------------------------------------------------------------------------


def is_prefix_hash(value: object) -> bool:
    """64 lowercase hex digits (SPEC §2's form, the one every index key is built from)."""
    return isinstance(value, str) and len(value) == 64 and _HEX.issuperset(value)


def is_token_count(value: object) -> bool:
    """An int (not a bool) in [0, 2^53): what a JSON number carries exactly."""
    return (isinstance(value, int) and not isinstance(value, bool)
            and 0 <= value < MAX_TOKEN_COUNT)


class RecordFault(enum.StrEnum):
    """Why a record's data was refused. Values are the router's `event_dropped` reason labels."""

    MALFORMED_JSON = "malformed_json"  # data: is not a JSON object
    UNKNOWN_EVENT = "unknown_event"  # event type not one of the prefix or control events
    INVALID_FIELD = "invalid_field"  # prefix_hash / token_count / tier / ts malformed
    BACKEND_MISMATCH = "backend_mismatch"  # data.backend names another backend than the stream


class InvalidRecord(ValueError):
    """A record nobody may use; `fault` says why (the message is a short detail, never data)."""

    def __init__(self, fault: RecordFault, detail: str) -> None:
        super().__init__(detail)
        self.fault = fault


def _check_fields(event: RecordEvent, prefix_hash: object, token_count: object) -> None:
    """Raise `InvalidRecord` (INVALID_FIELD) unless the prefix fields are what `event` allows:
    a prefix hash except for `cache_cleared`, a token count for the upserts."""
    if event is RecordEvent.CACHE_CLEARED:
        return
    if not is_prefix_hash(prefix_hash):
        raise InvalidRecord(RecordFault.INVALID_FIELD, "prefix_hash is not 64 lowercase hex")
    if event in _UPSERTS and not is_token_count(token_count):
        raise InvalidRecord(RecordFault.INVALID_FIELD,
                            "token_count is not a non-negative integer")


# --- encoding -------------------------------------------------------------------------------


def _data(record: Record, ts: float | None) -> dict[str, object]:
    data: dict[str, object] = {"event": record.event.value, "backend": record.backend}
    if record.event is not RecordEvent.CACHE_CLEARED:
        data["prefix_hash"] = record.prefix_hash
    if record.event is RecordEvent.CACHE_CREATED or record.event is RecordEvent.CACHE_OFFLOADED:
        data["token_count"] = record.token_count
        data["tier"] = None if record.tier is None else record.tier.value
    if ts is not None:
        data["ts"] = ts
    return data


def record_data(record: Record) -> dict[str, object]:
    """The JSON object of a record's `data:` line, keys in SPEC order, `ts` rounded to ms."""
    return _data(record, None if record.ts is None else round(record.ts, 3))


def encode_data(record: Record) -> str:
    """The compact JSON text of `record_data(record)`."""
    return _plain_data(record) or json.dumps(record_data(record), separators=_SEPARATORS)


def _plain_data(record: Record) -> str | None:
    """The hot path (two records per block on a busy engine): the same text as
    `json.dumps(record_data(record))`, written directly; None when a field is not of the plain
    kind this relies on (then the caller uses `json.dumps`). Nothing here needs JSON escaping:
    a prefix hash of ASCII letters and digits, the backend name quoted by `json.dumps` once
    (`data_head`), enum values, an int, and a finite float, whose JSON form is its `repr`."""
    ts = record.ts
    if type(ts) is not float:
        return None  # an int, or none at all
    ts = round(ts, 3)
    if ts - ts != 0.0:
        return None  # inf or nan
    event = record.event
    head = data_head(event, record.backend)
    if event is RecordEvent.CACHE_CLEARED:
        return f'{head},"ts":{ts!r}}}'
    prefix = record.prefix_hash
    if prefix is None or not (prefix.isascii() and prefix.encode().isalnum()):
        return None  # (bytes.isalnum: str's verdict for ASCII text, by table, 4x faster)
    if event not in _UPSERTS:
        return f'{head},"prefix_hash":"{prefix}","ts":{ts!r}}}'
    count, tier = record.token_count, record.tier
    if type(count) is not int or tier is None:
        return None
    return f'{head},"prefix_hash":"{prefix}","token_count":{count},"tier":"{tier}","ts":{ts!r}}}'


@functools.lru_cache(maxsize=1024)
def data_head(event: RecordEvent, backend: str) -> str:
    """`{"event":"...","backend":"..."`: how every record's data starts (a few backends per
    process; `core.sse.encode_record_list` builds on it)."""
    return f'{{"event":"{event.value}","backend":{json.dumps(backend)}'


def control_data(event: ControlEvent, backend: str) -> str:
    """`{"event":"draining","backend":"..."}`."""
    return json.dumps({"event": event.value, "backend": backend}, separators=_SEPARATORS)


# --- decoding -------------------------------------------------------------------------------


def decode_data(backend: str, data: str, *, event: str | None = None,
                record_id: str | None = None) -> Record | ControlEvent:
    """The JSON data of one record of `backend`'s stream -> a `Record` (fields validated, `tier`
    defaulted from the event), or the `ControlEvent` that ends the stream. `event` is the
    transport's event type (the SSE `event:` field), which wins over the body's; `record_id`
    the record's own ID (the SSE `id:` field). Raises `InvalidRecord`."""
    try:
        obj = json.loads(data)
    # JSONDecodeError, UnicodeDecodeError of lone surrogates, and nesting deeper than the stack
    except (ValueError, RecursionError):
        raise InvalidRecord(RecordFault.MALFORMED_JSON, "data is not JSON") from None
    if not isinstance(obj, dict):
        raise InvalidRecord(RecordFault.MALFORMED_JSON, "data is not a JSON object")
    name: Any = event if event is not None else obj.get("event")
    if not isinstance(name, str):
        raise InvalidRecord(RecordFault.UNKNOWN_EVENT, "no event type")
    control = _CONTROL_EVENTS.get(name)
    if control is not None:
        return control
    kind = _PREFIX_EVENTS.get(name)
    if kind is None:
        raise InvalidRecord(RecordFault.UNKNOWN_EVENT, "unknown event type")

    if obj.get("backend", backend) != backend:
        # A stream of another backend (a mis-pointed endpoint) must not fill this backend's
        # entries: routing would send requests where the prefix is not cached.
        raise InvalidRecord(RecordFault.BACKEND_MISMATCH, "record names another backend")
    ts = obj.get("ts")
    if ts is not None and (isinstance(ts, bool) or not isinstance(ts, int | float)
                           or not math.isfinite(ts)):
        raise InvalidRecord(RecordFault.INVALID_FIELD, "ts is not a number")
    if kind is RecordEvent.CACHE_CLEARED:
        return Record(record_id, kind, backend, None, None, None, ts)
    prefix_hash = obj.get("prefix_hash")
    token_count = obj.get("token_count") if kind in _UPSERTS else None
    _check_fields(kind, prefix_hash, token_count)
    if kind is RecordEvent.CACHE_EVICTED:
        return Record(record_id, kind, backend, prefix_hash, None, None, ts)
    raw_tier = obj.get("tier")
    if raw_tier is None:
        tier = default_tier(kind)
    else:
        try:
            tier = Tier(raw_tier)
        except ValueError:
            raise InvalidRecord(RecordFault.INVALID_FIELD, "unknown tier") from None
    return Record(record_id, kind, backend, prefix_hash, token_count, tier, ts)
