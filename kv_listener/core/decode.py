"""Pure decoders of engine KV-cache event payloads into the normalized model (`core.model`).

Owns the wire knowledge: which field sits where in every historical layout of vLLM (0.9 .. 0.33)
and SGLang (0.4.7 .. 0.5.23) msgpack batches, the TRT-LLM `POST /kv_cache_events` JSON, and the
reasons an event, batch or frame is dropped (`DropReason`, whose values are metric labels).
Facts and versions come from `shared/reference/wire-formats.md` §1-4; the section numbers below
refer to it.

Error model ("core raises, edges decide"):

- a payload that is not msgpack/JSON, or whose envelope is not a batch, raises `DecodeError`
  (with a `reason`); the edge counts it and goes on;
- a malformed or unknown *event* drops only itself: it is counted in `drops` under its reason and
  the good events of the same batch are kept, in order.

No function here does I/O, logs, or reads a clock. Error messages never quote payload content
(token IDs and salts must not reach logs).

Hot path: a busy engine sends thousands of blocks per second. A payload that is a well-formed
batch of known events is parsed and type-checked in C by `msgspec` into the typed layouts of
`core.wire` and turned into model events directly (`_decode_typed`); anything else goes to the
reference decoder (`_decode_reference`), which unpacks generically and judges each event alone
(per-event code reads fields positionally or with one `dict.get` each and leaves the per-token
work to C). Both give the same result (tests/test_decode_typed.py) but for one thing: invalid
UTF-8 in a key or value the model does not read sinks the batch for the reference decoder
only. `bench/decode.py` prints the figures.
"""

from __future__ import annotations

import enum
import json
from array import array
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgpack
import msgspec

from kv_listener.core import wire
from kv_listener.core.model import (
    MEDIUM_GPU,
    MEDIUM_TRTLLM_HOST,
    U64_MASK,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    BlockUpdated,
    CacheCreated,
    Engine,
    EventBatch,
    KvEvent,
)

__all__ = [
    "DecodeError",
    "DecodedBatch",
    "DecodedTrtllm",
    "DropReason",
    "TrtllmRecord",
    "decode_trtllm_events",
    "decode_zmq_payload",
    "trtllm_cache_level_medium",
    "vllm_salt_candidates",
]


class DropReason(enum.StrEnum):
    """Why an event, a batch or a frame was dropped. Values are metric label values."""

    # --- one event dropped, the rest of its batch kept (counted in `drops`) ---
    MALFORMED_EVENT = "malformed_event"  # not an array/map, missing or mistyped field
    UNKNOWN_TAG = "unknown_tag"  # well-formed event of a type we do not know (future engines)
    BAD_HASH = "bad_hash"  # block hash neither int nor non-empty bytes (or out of u64/i64 range)
    BAD_TOKENS = "bad_tokens"  # token id not an int in 0..2^32-1 (or a malformed EAGLE pair)
    NO_TIER_CHANGE = "no_tier_change"  # TRT-LLM `updated` without a cache_level change (skipped)
    TOO_MANY_TOKENS = "too_many_tokens"  # more token IDs than `max_event_tokens`
    TOO_MANY_HASHES = "too_many_hashes"  # more block hashes than `max_event_hashes`
    # --- a whole payload dropped: raised as DecodeError ---
    INVALID_MSGPACK = "invalid_msgpack"  # payload is not one msgpack object
    INVALID_JSON = "invalid_json"  # TRT-LLM body is not JSON
    MALFORMED_BATCH = "malformed_batch"  # msgpack/JSON fine, but not a batch envelope / list
    OVERSIZED_ARRAY = "oversized_array"  # an array beyond twice the event caps: not decoded
    # --- frame level, used by the ZMQ source (`core.sequence` parses frames) ---
    BAD_FRAME_COUNT = "bad_frame_count"  # a ZMQ message that is not [topic, seq, payload]
    BAD_SEQ = "bad_seq"  # sequence frame that is not 8 bytes
    # --- TRT-LLM source ---
    DUPLICATE_EVENT_ID = "duplicate_event_id"  # event_id already applied


class DecodeError(Exception):
    """A whole payload/frame cannot be decoded. `reason` is the metric label to count it under.

    The message names the problem, never the payload's content.
    """

    def __init__(self, reason: DropReason, message: str) -> None:
        super().__init__(f"{reason.value}: {message}")
        self.reason = reason


class DecodedBatch(msgspec.Struct, frozen=True, gc=False):
    """One decoded vLLM/SGLang batch.

    `raw_events` is the number of events on the wire (decoded + dropped); `drops` maps a
    `DropReason` (a `str`) to how many events were dropped for it. `sum(drops.values()) ==
    raw_events - len(batch.events)`.
    """

    batch: EventBatch
    raw_events: int
    drops: Counter[str]


class TrtllmRecord(msgspec.Struct, frozen=True, gc=False):
    """One record of a TRT-LLM `/kv_cache_events` response.

    `events` is empty when the record's `data` was dropped (malformed, unknown type, an `updated`
    with no tier change): the record is still returned so that `event_id` continuity (dedupe and
    gap detection) holds. `dp_rank` is TRT-LLM's `attention_dp_rank`.
    """

    event_id: int
    window_size: int | None
    dp_rank: int | None
    events: tuple[KvEvent, ...]


class DecodedTrtllm(msgspec.Struct, frozen=True, gc=False):
    """A decoded TRT-LLM body: records in wire order, `raw_events` records on the wire."""

    records: tuple[TrtllmRecord, ...]
    raw_events: int
    drops: Counter[str]


class _Drop(Exception):
    """Internal: drop the current event under `reason` (never escapes this module)."""

    def __init__(self, reason: DropReason) -> None:
        super().__init__(reason.value)
        self.reason = reason


# Anything a malformed msgpack object can make the field access code raise. Caught per event, so a
# hostile event costs only itself.
_EVENT_ERRORS = (
    TypeError,
    ValueError,
    IndexError,
    KeyError,
    OverflowError,
    AttributeError,
    RecursionError,  # absurdly nested extra_keys (msgpack allows ~1000 levels)
)

_M = U64_MASK
_I64_MIN = -(1 << 63)
_CLEARED = AllBlocksCleared()
_NONES: list[Any] = [None] * 16


# --- field helpers ---------------------------------------------------------------------------


def _hash(h: Any) -> int:
    """One wire hash -> u64 (§1 rule 4): ints mod 2^64 (i64 or u64), bytes: last 8 bytes BE."""
    t = type(h)
    if t is int:
        if _I64_MIN <= h <= _M:
            return int(h & _M)
        raise _Drop(DropReason.BAD_HASH)
    if t is bytes and h:
        return int.from_bytes(h[-8:], "big")
    raise _Drop(DropReason.BAD_HASH)


def _hashes(v: Any) -> tuple[int, ...]:
    if type(v) is not list:
        raise _Drop(DropReason.BAD_HASH)
    try:
        # Fast path: every hash an int (the default wire form of every engine).
        out = tuple([h & _M for h in v])
    except TypeError:
        # bytes hashes (vLLM VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0), or garbage.
        return tuple([_hash(h) for h in v])
    if bool in map(type, v):  # msgpack true/false passed the int path: not a hash
        raise _Drop(DropReason.BAD_HASH)
    return out


def _parent(p: Any) -> int | None:
    return None if p is None else _hash(p)


_TOKEN_STEP = 1 << 16


def _tokens(v: Any, pairs_ok: bool) -> array[int]:
    if type(v) is not list:
        raise _Drop(DropReason.BAD_TOKENS)
    try:
        # array('I') rejects non-ints (TypeError) and values outside 0..2^32-1 (OverflowError).
        if len(v) <= _TOKEN_STEP:
            return array("I", v)
        out = array("I")  # in steps, so the C loop never holds the GIL for long (see _unpack)
        for i in range(0, len(v), _TOKEN_STEP):
            out.extend(v[i:i + _TOKEN_STEP])
        return out
    except (TypeError, OverflowError):
        pass
    if pairs_ok and v and type(v[0]) is list:
        return _bigram_firsts(v)
    raise _Drop(DropReason.BAD_TOKENS)


def _bigram_firsts(v: list[Any]) -> array[int]:
    """SGLang EAGLE bigram mode: token_ids are pairs `(t[i], t[i+1])` (sglang
    `mem_cache/utils.py::convert_to_bigram_key`: the draft sequence is the target shifted by one).
    The first element of pair i is the token at position i, so the firsts are exactly the page's
    tokens: that keeps `len(token_ids) == block_size * len(block_hashes)` and gives detokenize the
    real text (flattening, as Dynamo does, would double every inner token)."""
    for p in v:
        if type(p) is not list or len(p) != 2:
            raise _Drop(DropReason.BAD_TOKENS)
    try:
        return array("I", [p[0] for p in v])
    except (TypeError, OverflowError):
        raise _Drop(DropReason.BAD_TOKENS) from None


def _freeze(v: Any) -> Any:
    t = type(v)
    if t is list:
        return tuple([_freeze(x) for x in v])
    if t is dict:
        raise _Drop(DropReason.MALFORMED_EVENT)
    return v


def _extra_keys(v: Any) -> tuple[Any, ...] | None:
    """vLLM >= 0.17 `extra_keys`: one entry per hash, each a tuple (msgpack array) or None."""
    if v is None:
        return None
    if type(v) is not list:
        raise _Drop(DropReason.MALFORMED_EVENT)
    if v.count(None) == len(v):  # the common case: [None] * len(block_hashes)
        return tuple(v)
    if len(v) == 1 and type(first := v[0]) is list and all(type(x) is str for x in first):
        return (tuple(first),)  # the other common one: a salted root block's [[salt]]
    types = set(map(type, v))
    if list in types or dict in types:
        return tuple([_freeze(x) for x in v])
    return tuple(v)


def _block_size(bs: Any) -> int:
    if type(bs) is not int or bs < 0:
        raise _Drop(DropReason.MALFORMED_EVENT)
    return int(bs)


def _opt_str(x: Any) -> bool:
    return x is None or type(x) is str


def _opt_int(x: Any) -> bool:
    return x is None or type(x) is int


# --- vLLM events (§2.4) ----------------------------------------------------------------------
#
# Legacy array layouts (vLLM <= 0.23; msgspec array_like writes every field, so the length is
# fixed per release, table in §2.4):
#   BlockStored  [tag, hashes, parent, tokens, block_size, lora_id,        # 6: 0.9.0 .. 0.10.1
#                 medium,                                                  # 7: 0.10.2 .. 0.13
#                 lora_name,                                               # 8: 0.14 .. 0.16
#                 extra_keys,                                              # 9: 0.17 .. 0.19
#                 group_idx,                                               # 10: 0.20 .. 0.21
#                 kv_cache_spec_kind, kv_cache_spec_sliding_window]        # 12: 0.22 .. 0.23
#   BlockRemoved [tag, hashes, medium (0.10.2), group_idx (0.20)]
# Longer arrays (a future field) are read up to what we know; shorter ones pad with None.


def _vllm_stored_array(e: list[Any]) -> BlockStored:
    n = len(e)
    if n < 5:
        raise _Drop(DropReason.MALFORMED_EVENT)
    f = e[:12] if n >= 12 else e + _NONES[: 12 - n]
    _, hs, parent, toks, bs, lora_id, medium, lora_name, extra, group, kind, _window = f
    # One expression instead of five helper calls: this runs once per event on the hot path.
    if not (
        (lora_id is None or type(lora_id) is int)
        and (medium is None or type(medium) is str)
        and (lora_name is None or type(lora_name) is str)
        and (group is None or type(group) is int)
        and (kind is None or type(kind) is str)
    ):
        raise _Drop(DropReason.MALFORMED_EVENT)
    return BlockStored(
        _hashes(hs),
        None if parent is None else _hash(parent),
        _tokens(toks, False),
        _block_size(bs),
        lora_id,
        lora_name,
        medium,
        group,
        _extra_keys(extra),
        None,
        kind,
    )


def _removed_array(e: list[Any]) -> BlockRemoved:
    """vLLM [tag, hashes, medium?, group_idx?] and SGLang [tag, hashes, medium?]."""
    n = len(e)
    if n < 2:
        raise _Drop(DropReason.MALFORMED_EVENT)
    medium = e[2] if n > 2 else None
    group = e[3] if n > 3 else None
    if not (_opt_str(medium) and _opt_int(group)):
        raise _Drop(DropReason.MALFORMED_EVENT)
    return BlockRemoved(_hashes(e[1]), medium, group)


# Map layouts (vLLM >= 0.24, PR #42892): fields by name, unknown keys ignored (locality,
# ownership, session_id, lookahead_token_ids, kv_cache_spec_sliding_window, ...). Fields that no
# engine can omit (non-nullable, no default: block_hashes, token_ids, block_size) are required; a
# missing nullable field reads as None, which is what omit_defaults would have meant.


def _vllm_stored_map(e: dict[Any, Any]) -> BlockStored:
    g = e.get
    hs = g("block_hashes")
    toks = g("token_ids")
    bs = g("block_size")
    if hs is None or toks is None or bs is None:
        raise _Drop(DropReason.MALFORMED_EVENT)
    lora_id = g("lora_id")
    medium = g("medium")
    lora_name = g("lora_name")
    group = g("group_idx")
    kind = g("kv_cache_spec_kind")
    # One expression instead of five helper calls: this runs once per event on the hot path.
    if not (
        (lora_id is None or type(lora_id) is int)
        and (medium is None or type(medium) is str)
        and (lora_name is None or type(lora_name) is str)
        and (group is None or type(group) is int)
        and (kind is None or type(kind) is str)
    ):
        raise _Drop(DropReason.MALFORMED_EVENT)
    return BlockStored(
        _hashes(hs),
        None if (parent := g("parent_block_hash")) is None else _hash(parent),
        _tokens(toks, False),
        _block_size(bs),
        lora_id,
        lora_name,
        medium,
        group,
        _extra_keys(g("extra_keys")),
        None,
        kind,
    )


def _removed_map(e: dict[Any, Any]) -> BlockRemoved:
    """vLLM {block_hashes, medium, group_idx, locality, ownership}; SGLang {block_hashes, medium}."""
    hs = e.get("block_hashes")
    if hs is None:
        raise _Drop(DropReason.MALFORMED_EVENT)
    medium = e.get("medium")
    group = e.get("group_idx")
    if not (_opt_str(medium) and _opt_int(group)):
        raise _Drop(DropReason.MALFORMED_EVENT)
    return BlockRemoved(_hashes(hs), medium, group)


def _cleared(_e: Any) -> AllBlocksCleared:
    return _CLEARED


# --- SGLang events (§3.3) --------------------------------------------------------------------
#
# Arrays (<= 0.5.19): BlockStored [tag, hashes, parent, tokens, block_size, lora_id (6: 0.4.7 ..
# 0.5.6), medium (7: 0.5.9 ..), {"cache_salt": ...} (8: 0.5.18-0.5.19 salted blocks, PR #30827)].
# Maps (>= 0.5.20, PR #37482): + cache_salt, session_id (ignored), lora_name (0.5.22).
# Hashes are signed int64 (first 8 bytes of SHA-256 since 0.5.6; Python hash() before).


def _sglang_stored_array(e: list[Any]) -> BlockStored:
    n = len(e)
    if n < 5:
        raise _Drop(DropReason.MALFORMED_EVENT)
    f = e[:8] if n >= 8 else e + _NONES[: 8 - n]
    _, hs, parent, toks, bs, lora_id, medium, meta = f
    salt = None
    if meta is not None:
        if type(meta) is not dict:
            raise _Drop(DropReason.MALFORMED_EVENT)
        salt = meta.get("cache_salt")
    if not (
        (lora_id is None or type(lora_id) is int)
        and (medium is None or type(medium) is str)
        and (salt is None or type(salt) is str)
    ):
        raise _Drop(DropReason.MALFORMED_EVENT)
    return BlockStored(
        _hashes(hs),
        None if parent is None else _hash(parent),
        _tokens(toks, True),
        _block_size(bs),
        lora_id,
        None,
        medium,
        None,
        None,
        salt,
        None,
    )


def _sglang_stored_map(e: dict[Any, Any]) -> BlockStored:
    g = e.get
    hs = g("block_hashes")
    toks = g("token_ids")
    bs = g("block_size")
    if hs is None or toks is None or bs is None:
        raise _Drop(DropReason.MALFORMED_EVENT)
    lora_id = g("lora_id")
    medium = g("medium")
    lora_name = g("lora_name")
    salt = g("cache_salt")
    if not (
        (lora_id is None or type(lora_id) is int)
        and (medium is None or type(medium) is str)
        and (lora_name is None or type(lora_name) is str)
        and (salt is None or type(salt) is str)
    ):
        raise _Drop(DropReason.MALFORMED_EVENT)
    return BlockStored(
        _hashes(hs),
        None if (parent := g("parent_block_hash")) is None else _hash(parent),
        _tokens(toks, True),
        _block_size(bs),
        lora_id,
        lora_name,
        medium,
        None,
        None,
        salt,
        None,
    )


_Handler = Callable[[Any], KvEvent]

_VLLM_ARRAY: dict[str, _Handler] = {
    "BlockStored": _vllm_stored_array,
    "BlockRemoved": _removed_array,
    "AllBlocksCleared": _cleared,
}
_VLLM_MAP: dict[str, _Handler] = {
    "BlockStored": _vllm_stored_map,
    "BlockRemoved": _removed_map,
    "AllBlocksCleared": _cleared,
}
_SGLANG_ARRAY: dict[str, _Handler] = {
    "BlockStored": _sglang_stored_array,
    "BlockRemoved": _removed_array,
    "AllBlocksCleared": _cleared,
}
_SGLANG_MAP: dict[str, _Handler] = {
    "BlockStored": _sglang_stored_map,
    "BlockRemoved": _removed_map,
    "AllBlocksCleared": _cleared,
}
# TRT-LLM's streaming ZMQ publisher (PR #17023) and Dynamo's TRT-LLM republisher both emit
# vLLM-shaped map events (§4.3, §5), so engine=trtllm on ZMQ uses the vLLM tables.
_TABLES: dict[Engine, tuple[dict[str, _Handler], dict[str, _Handler]]] = {
    Engine.VLLM: (_VLLM_ARRAY, _VLLM_MAP),
    Engine.SGLANG: (_SGLANG_ARRAY, _SGLANG_MAP),
    Engine.TRTLLM: (_VLLM_ARRAY, _VLLM_MAP),
}


# --- batches ---------------------------------------------------------------------------------


#: Payloads above this are unpacked in steps of this many bytes (see `_unpack`).
UNPACK_STEP_BYTES = 64 << 10


def _unpack_in_steps(payload: bytes | bytearray | memoryview, opts: dict[str, Any]) -> Any:
    """`msgpack.unpackb(payload, **opts)`, fed to a streaming Unpacker 64 KiB at a time. Its C
    parser keeps its state between feeds, so each call parses at most one step: another thread
    (the daemon's event loop, while a large batch is decoded in a worker) waits for the GIL a
    millisecond or two instead of the whole frame (70 ms and more for 2.6 MB)."""
    view = memoryview(payload)
    unpacker = msgpack.Unpacker(max_buffer_size=len(view) + 1, **opts)
    obj: Any = None
    done = False
    for start in range(0, len(view), UNPACK_STEP_BYTES):
        unpacker.feed(view[start:start + UNPACK_STEP_BYTES])
        if done:
            raise msgpack.ExtraData(obj, b"")  # bytes after the one object
        try:
            obj = unpacker.unpack()
            done = True
        except msgpack.OutOfData:
            continue
    if not done:
        raise msgpack.OutOfData("truncated")
    if unpacker.tell() != len(view):
        raise msgpack.ExtraData(obj, b"")
    return obj


def _unpack(payload: bytes | bytearray | memoryview, max_array_len: int) -> Any:
    # strict_map_key=False: an odd key type must not sink the whole batch (the event that
    # carries it is judged on its own); str keys stay str (raw=False). max_array_len: a
    # msgpack bomb (one array of millions of token IDs) is refused before it is built.
    opts: dict[str, Any] = {"raw": False, "strict_map_key": False,
                            "max_array_len": max_array_len, "max_map_len": max_array_len}
    try:
        if len(payload) > UNPACK_STEP_BYTES:
            return _unpack_in_steps(payload, opts)
        return msgpack.unpackb(payload, **opts)
    except ValueError as exc:
        if "exceeds max_" in str(exc):
            raise DecodeError(DropReason.OVERSIZED_ARRAY, "an array or map beyond the caps") from None
        raise DecodeError(
            DropReason.INVALID_MSGPACK, f"payload is not one msgpack object ({type(exc).__name__})"
        ) from None
    except Exception as exc:  # msgpack raises ExtraData, FormatError, StackError, ValueError, ...
        raise DecodeError(
            DropReason.INVALID_MSGPACK, f"payload is not one msgpack object ({type(exc).__name__})"
        ) from None


def _envelope(obj: Any) -> tuple[float, list[Any], int | None]:
    """`[ts, events]` (vLLM 0.9.0), `[ts, events, dp_rank]` (every later release; SGLang calls
    it attn_dp_rank), or defensively a map {ts, events, data_parallel_rank|attn_dp_rank}."""
    t = type(obj)
    if t is list:
        n = len(obj)
        if n < 2:
            raise DecodeError(DropReason.MALFORMED_BATCH, f"batch array of {n} elements")
        ts, events = obj[0], obj[1]
        dp = obj[2] if n > 2 else None
    elif t is dict:
        ts, events = obj.get("ts"), obj.get("events")
        dp = obj.get("data_parallel_rank")
        if dp is None:
            dp = obj.get("attn_dp_rank")
    else:
        raise DecodeError(DropReason.MALFORMED_BATCH, f"batch is a {t.__name__}")
    tt = type(ts)
    if tt is not float and tt is not int:
        raise DecodeError(DropReason.MALFORMED_BATCH, "batch ts is not a number")
    if type(events) is not list:
        raise DecodeError(DropReason.MALFORMED_BATCH, "batch events is not an array")
    if dp is not None and type(dp) is not int:
        raise DecodeError(DropReason.MALFORMED_BATCH, "batch dp rank is not an int")
    return float(ts), events, dp


#: Default event caps (`config.Limits`): token IDs and block hashes of one event.
DEFAULT_MAX_EVENT_TOKENS = 1 << 20
DEFAULT_MAX_EVENT_HASHES = 1 << 16


def decode_zmq_payload(
    engine: Engine, payload: bytes | bytearray | memoryview, seq: int | None = None, *,
    max_event_tokens: int = DEFAULT_MAX_EVENT_TOKENS,
    max_event_hashes: int = DEFAULT_MAX_EVENT_HASHES,
) -> DecodedBatch:
    """Decode the msgpack payload frame of a vLLM / SGLang (or TRT-LLM streaming) batch.

    Array and map events may be mixed in one batch. Raises `DecodeError` (reason
    `invalid_msgpack`, `malformed_batch`, or `oversized_array` for an array over twice the
    caps) when the payload or its envelope is unusable; a bad event only drops itself (counted
    in `drops`), and so does one with more than `max_event_tokens` token IDs or
    `max_event_hashes` hashes. `seq` is copied into `EventBatch.seq`.
    """
    max_len = 2 * max(max_event_tokens, max_event_hashes)
    if len(payload) <= min(max_len, UNPACK_STEP_BYTES):
        # Too short to hold an array over the caps: the typed fast path can take it.
        fast = _decode_typed(engine, payload, seq, max_event_tokens, max_event_hashes)
        if fast is not None:
            return fast
    return _decode_reference(engine, payload, seq, max_event_tokens, max_event_hashes, max_len)


def _decode_reference(
    engine: Engine, payload: bytes | bytearray | memoryview, seq: int | None,
    max_event_tokens: int, max_event_hashes: int, max_len: int,
) -> DecodedBatch:
    """Any payload: generic unpacking (arrays and maps up to `max_len` elements), then every
    event read field by field and judged alone."""
    ts, events, dp = _envelope(_unpack(payload, max_len))
    array_table, map_table = _TABLES[engine]
    out: list[KvEvent] = []
    drops: Counter[str] = Counter()
    for ev in events:
        try:
            t = type(ev)
            if t is list:
                tag = ev[0]
                handler = array_table.get(tag)
            elif t is dict:
                tag = ev.get("type")
                handler = map_table.get(tag)
            else:
                drops[DropReason.MALFORMED_EVENT] += 1
                continue
            if handler is None:
                reason = DropReason.UNKNOWN_TAG if type(tag) is str else DropReason.MALFORMED_EVENT
                drops[reason] += 1
                continue
            decoded = handler(ev)
        except _Drop as d:
            drops[d.reason] += 1
            continue
        except _EVENT_ERRORS:
            drops[DropReason.MALFORMED_EVENT] += 1
            continue
        if type(decoded) is BlockStored:
            if len(decoded.token_ids) > max_event_tokens:
                drops[DropReason.TOO_MANY_TOKENS] += 1
                continue
            if len(decoded.block_hashes) > max_event_hashes:
                drops[DropReason.TOO_MANY_HASHES] += 1
                continue
        elif type(decoded) is BlockRemoved and len(decoded.block_hashes) > max_event_hashes:
            drops[DropReason.TOO_MANY_HASHES] += 1
            continue
        out.append(decoded)
    return DecodedBatch(EventBatch(ts, tuple(out), dp, seq), len(events), drops)


_STORED_TYPES = frozenset(wire.STORED_TYPES)
_REMOVED_TYPES = frozenset(wire.REMOVED_TYPES)


def _decode_typed(
    engine: Engine, payload: bytes | bytearray | memoryview, seq: int | None,
    max_event_tokens: int, max_event_hashes: int,
) -> DecodedBatch | None:
    """The fast path: `core.wire` parses and type-checks a well-formed batch in C, and its
    events become the same model events `_decode_reference` would build. None when `core.wire`
    refuses the payload or an event needs the reference decoder's judgement."""
    batch = wire.typed_batch(engine, payload)
    if batch is None:
        return None
    out: list[KvEvent] = []
    drops: Counter[str] = Counter()
    sglang = engine is Engine.SGLANG
    try:
        for ev in batch.events:
            t = type(ev)
            if t in _STORED_TYPES:
                toks = ev.token_ids
                hs = ev.block_hashes
                if len(toks) > max_event_tokens:
                    drops[DropReason.TOO_MANY_TOKENS] += 1
                    continue
                if len(hs) > max_event_hashes:
                    drops[DropReason.TOO_MANY_HASHES] += 1
                    continue
                if not sglang:
                    lora_name, group, extra, salt, kind = (
                        ev.lora_name, ev.group_idx, _extra_keys(ev.extra_keys), None,
                        ev.kv_cache_spec_kind)
                elif t is wire.SglangStoredArray:
                    lora_name, group, extra, kind = None, None, None, None
                    salt = None if ev.meta is None else ev.meta.cache_salt
                else:
                    lora_name, group, extra, salt, kind = ev.lora_name, None, None, ev.cache_salt, None
                parent = ev.parent_block_hash
                out.append(BlockStored(
                    tuple([h & _M for h in hs]), None if parent is None else parent & _M,
                    _tokens(toks, False), ev.block_size, ev.lora_id, lora_name, ev.medium, group,
                    extra, salt, kind))
            elif t in _REMOVED_TYPES:
                hs = ev.block_hashes
                if len(hs) > max_event_hashes:
                    drops[DropReason.TOO_MANY_HASHES] += 1
                    continue
                out.append(BlockRemoved(tuple([h & _M for h in hs]), ev.medium, ev.group_idx))
            else:
                out.append(_CLEARED)
    except (_Drop, *_EVENT_ERRORS):
        return None  # e.g. a map inside extra_keys: the reference decoder counts that event
    return DecodedBatch(EventBatch(float(batch.ts), tuple(out), batch.dp, seq),
                        len(batch.events), drops)


def vllm_salt_candidates(event: BlockStored) -> tuple[str, ...]:
    """Strings of a root vLLM `BlockStored`'s first `extra_keys` entry that may be the request's
    `cache_salt`, in wire order (the salt, when present, is the last one).

    vLLM (§2.6) adds `cache_salt` to block 0's extra keys only, after the LoRA name and the
    multimodal identifiers; extra keys are untagged on the wire (0.17 .. 0.33), so a plain string
    can also be a multimodal identifier (vLLM <= 0.18). The LoRA name (== `lora_name`, first) is
    excluded. Empty for continuation blocks (parent set) and for events without extra keys.
    """
    if event.parent_hash is not None or not event.extra_keys:
        return ()
    first = event.extra_keys[0]
    if type(first) is not tuple:
        return ()
    if len(first) == 1 and event.lora_name is None and type(first[0]) is str:
        return first  # the common case: a salted root block, its salt alone
    strs = [x for x in first if type(x) is str]
    if strs and event.lora_name is not None and strs[0] == event.lora_name:
        strs = strs[1:]
    return tuple(strs)


# --- TRT-LLM (§4.2) --------------------------------------------------------------------------

_LEVEL_MEDIA: dict[int, str] = {0: MEDIUM_GPU, 1: MEDIUM_TRTLLM_HOST}


def trtllm_cache_level_medium(level: int) -> str:
    """TRT-LLM `cache_level` -> medium: 0 (primary) `GPU`, 1 (secondary) `HOST`, and any further
    level a storage tier named `CACHE_LEVEL_<n>` (none exists today; kept rather than dropped)."""
    medium = _LEVEL_MEDIA.get(level)
    return medium if medium is not None else f"CACHE_LEVEL_{level}"


def _level(v: Any) -> str:
    if type(v) is not int or v < 0:
        raise _Drop(DropReason.MALFORMED_EVENT)
    return trtllm_cache_level_medium(v)


def _trt_stored(data: dict[str, Any]) -> tuple[KvEvent, ...]:
    """`stored` -> one BlockStored per block, chained: block i's parent is block i-1's hash, the
    first's is `parent_hash`. `block_size` is the block's own token count (the last block of an
    event may be partial, §4.2)."""
    blocks = data.get("blocks")
    if type(blocks) is not list:
        raise _Drop(DropReason.MALFORMED_EVENT)
    prev = _parent(data.get("parent_hash"))
    out: list[KvEvent] = []
    for b in blocks:
        if type(b) is not dict:
            raise _Drop(DropReason.MALFORMED_EVENT)
        h = _hash(b.get("block_hash"))
        toks = b.get("tokens")
        if toks is None:
            toks = []
        if type(toks) is not list:
            raise _Drop(DropReason.BAD_TOKENS)
        try:
            ids = array("I", [t["token_id"] for t in toks])
        except (TypeError, KeyError, OverflowError, IndexError):
            raise _Drop(DropReason.BAD_TOKENS) from None
        # cache_level is always serialized for stored blocks; absent means the primary pool,
        # where TRT-LLM stores new blocks.
        level = b.get("cache_level")
        medium = MEDIUM_GPU if level is None else _level(level)
        salt = b.get("cache_salt")  # PR #13051; absent before
        if not _opt_str(salt):
            raise _Drop(DropReason.MALFORMED_EVENT)
        out.append(BlockStored((h,), prev, ids, len(ids), medium=medium, cache_salt=salt))
        prev = h
    return tuple(out)


def _trt_removed(data: dict[str, Any]) -> tuple[KvEvent, ...]:
    hs = data.get("block_hashes")
    if type(hs) is not list:
        raise _Drop(DropReason.MALFORMED_EVENT)
    # TRT-LLM does not say which level a removed block left: None = every medium.
    return (BlockRemoved(tuple([_hash(h) for h in hs])),)


def _trt_updated(data: dict[str, Any]) -> tuple[KvEvent, ...]:
    h = _hash(data.get("block_hash"))
    diff = data.get("cache_level")
    # The C++ diff fields are optional (§4.2, §8): a null/missing cache_level diff is a priority
    # update only, which moves no tier.
    if diff is None:
        raise _Drop(DropReason.NO_TIER_CHANGE)
    if type(diff) is not dict:
        raise _Drop(DropReason.MALFORMED_EVENT)
    old, new = diff.get("old_value"), diff.get("new_value")
    if new is None:
        raise _Drop(DropReason.NO_TIER_CHANGE)
    new_medium = _level(new)
    old_medium = None if old is None else _level(old)
    if old_medium == new_medium:
        raise _Drop(DropReason.NO_TIER_CHANGE)
    return (BlockUpdated(h, old_medium, new_medium),)


def _trt_created(data: dict[str, Any]) -> tuple[KvEvent, ...]:
    n = data.get("num_blocks_per_cache_level")
    if n is None:
        n = []
    if type(n) is not list or not all(type(x) is int for x in n):
        raise _Drop(DropReason.MALFORMED_EVENT)
    return (CacheCreated(tuple(n)),)


_TRT_HANDLERS: dict[str, Callable[[dict[str, Any]], tuple[KvEvent, ...]]] = {
    "created": _trt_created,
    "stored": _trt_stored,
    "removed": _trt_removed,
    "updated": _trt_updated,
}


def _trt_data(rec: dict[str, Any]) -> tuple[KvEvent, ...]:
    ws = rec.get("window_size")
    dp = rec.get("attention_dp_rank")
    if not (_opt_int(ws) and _opt_int(dp)):
        raise _Drop(DropReason.MALFORMED_EVENT)
    data = rec.get("data")
    if type(data) is not dict:
        raise _Drop(DropReason.MALFORMED_EVENT)
    kind = data.get("type")
    handler = _TRT_HANDLERS.get(kind) if type(kind) is str else None
    if handler is None:
        raise _Drop(DropReason.UNKNOWN_TAG if type(kind) is str else DropReason.MALFORMED_EVENT)
    return handler(data)


def decode_trtllm_events(body: bytes | bytearray | str | list[Any]) -> DecodedTrtllm:
    """Decode a `trtllm-serve` `POST /kv_cache_events` response (a JSON list of records).

    Raises `DecodeError` (`invalid_json`, or `malformed_batch` for a non-list body). A record
    without a usable integer `event_id` is dropped and counted; a record whose `data` is bad is
    kept with no events (its `event_id` still counts for dedupe/gaps) and counted.
    """
    if isinstance(body, list):
        obj: Any = body
    else:
        try:
            obj = json.loads(body)
        except (ValueError, TypeError, RecursionError):  # ValueError covers UnicodeDecodeError
            raise DecodeError(DropReason.INVALID_JSON, "body is not JSON") from None
    if type(obj) is not list:
        raise DecodeError(DropReason.MALFORMED_BATCH, f"body is a {type(obj).__name__}, not a list")
    records: list[TrtllmRecord] = []
    drops: Counter[str] = Counter()
    for rec in obj:
        if type(rec) is not dict or type(event_id := rec.get("event_id")) is not int:
            drops[DropReason.MALFORMED_EVENT] += 1
            continue
        try:
            events = _trt_data(rec)
        except _Drop as d:
            drops[d.reason] += 1
            events = ()
        except _EVENT_ERRORS:
            drops[DropReason.MALFORMED_EVENT] += 1
            events = ()
        ws, dp = rec.get("window_size"), rec.get("attention_dp_rank")
        records.append(
            TrtllmRecord(
                event_id,
                ws if type(ws) is int else None,
                dp if type(dp) is int else None,
                events,
            )
        )
    return DecodedTrtllm(tuple(records), len(obj), drops)
