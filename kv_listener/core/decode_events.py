"""One event at a time: the wire knowledge of vLLM and SGLang events (part of `core.decode`).

Which field sits where in every historical layout of vLLM (0.9 .. 0.33) and SGLang (0.4.7 ..
0.5.23) events, array or map encoded (`wire-formats.md` §2-3), the field checks shared with the
TRT-LLM decoder, and the reasons an event, batch or frame is dropped (`DropReason`, whose values
are metric labels). A handler raises `EventDrop` to drop only its event; `core.decode` turns a
batch into events with these handlers (the reference path) or with `core.wire`'s typed layouts
(the fast path), which reuse the field helpers below.
"""

from __future__ import annotations

import enum
from array import array
from collections.abc import Callable
from typing import Any, Final

import msgspec

from kv_listener.core.cmodules import c_attr
from kv_listener.core.model import (
    U64_MASK,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Engine,
    KvEvent,
)


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


class EventDrop(Exception):
    """Drop the current event under `reason` (caught by the decoders, never escapes `core.decode`)."""

    def __init__(self, reason: DropReason) -> None:
        super().__init__(reason.value)
        self.reason = reason


# Anything a malformed msgpack object can make the field access code raise. Caught per event, so a
# hostile event costs only itself.
EVENT_ERRORS = (
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
CLEARED = AllBlocksCleared()
_NONES: list[Any] = [None] * 16


# --- field helpers ---------------------------------------------------------------------------


def wire_hash(h: Any) -> int:
    """One wire hash -> u64 (§1 rule 4): ints mod 2^64 (i64 or u64), bytes: last 8 bytes BE."""
    t = type(h)
    if t is int:
        if _I64_MIN <= h <= _M:
            return int(h & _M)
        raise EventDrop(DropReason.BAD_HASH)
    if t is bytes and h:
        return int.from_bytes(h[-8:], "big")
    raise EventDrop(DropReason.BAD_HASH)


def wire_hashes(v: Any) -> tuple[int, ...]:
    if type(v) is not list:
        raise EventDrop(DropReason.BAD_HASH)
    try:
        # Fast path: every hash an int (the default wire form of every engine).
        out = tuple([h & _M for h in v])
    except TypeError:
        # bytes hashes (vLLM VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0), or garbage.
        return tuple([wire_hash(h) for h in v])
    if bool in map(type, v):  # msgpack true/false passed the int path: not a hash
        raise EventDrop(DropReason.BAD_HASH)
    return out


def wire_parent(p: Any) -> int | None:
    return None if p is None else wire_hash(p)


_TOKEN_STEP = 1 << 16


def wire_tokens(v: Any, pairs_ok: bool) -> array[int]:
    if type(v) is not list:
        raise EventDrop(DropReason.BAD_TOKENS)
    try:
        # array('I') rejects non-ints (TypeError) and values outside 0..2^32-1 (OverflowError).
        if len(v) <= _TOKEN_STEP:
            return array("I", v)
        out = array("I")  # in steps, so the C loop never holds the GIL for long (see `core.decode._unpack`)
        for i in range(0, len(v), _TOKEN_STEP):
            out.extend(v[i:i + _TOKEN_STEP])
        return out
    except (TypeError, OverflowError):
        pass
    if pairs_ok and v and type(v[0]) is list:
        return _bigram_firsts(v)
    raise EventDrop(DropReason.BAD_TOKENS)


def raw_tokens(raw: Any) -> array[int] | None:
    """`wire_tokens` of the undecoded token IDs of the current vLLM layout (`core.wire`: a
    `msgspec.Raw` msgpack array): the same array, or the same EventDrop(BAD_TOKENS) for an ID
    outside 0 .. 2^32 - 1, or None when they are not a list of ints, which `list[int]` refused
    before (the reference decoder then takes the payload). Read by `core._wiretok` in C where
    setup.py built it; by msgspec and `wire_tokens` otherwise, and for anything it declines."""
    native = _U32_ARRAY
    if native is not None:
        toks: array[int] | None = native(raw)
        if toks is not None:
            return toks
    v = _decode_msgpack(raw)
    if type(v) is not list:
        return None
    for x in v:
        if type(x) is not int:
            return None
    return wire_tokens(v, False)


_U32_ARRAY: Final[Any] = c_attr("_wiretok", "u32_array")  # None where not built
_decode_msgpack: Final[Any] = msgspec.msgpack.decode


def _bigram_firsts(v: list[Any]) -> array[int]:
    """SGLang EAGLE bigram mode: token_ids are pairs `(t[i], t[i+1])` (sglang
    `mem_cache/utils.py::convert_to_bigram_key`: the draft sequence is the target shifted by one).
    The first element of pair i is the token at position i, so the firsts are exactly the page's
    tokens: that keeps `len(token_ids) == block_size * len(block_hashes)` and gives detokenize the
    real text (flattening, as Dynamo does, would double every inner token)."""
    for p in v:
        if type(p) is not list or len(p) != 2:
            raise EventDrop(DropReason.BAD_TOKENS)
    try:
        return array("I", [p[0] for p in v])
    except (TypeError, OverflowError):
        raise EventDrop(DropReason.BAD_TOKENS) from None


def _freeze(v: Any) -> Any:
    t = type(v)
    if t is list:
        return tuple([_freeze(x) for x in v])
    if t is dict:
        raise EventDrop(DropReason.MALFORMED_EVENT)
    return v


def wire_extra_keys(v: Any) -> tuple[Any, ...] | None:
    """vLLM >= 0.17 `extra_keys`: one entry per hash, each a tuple (msgpack array) or None."""
    if v is None:
        return None
    if type(v) is not list:
        raise EventDrop(DropReason.MALFORMED_EVENT)
    if v.count(None) == len(v):  # the common case: [None] * len(block_hashes)
        return tuple(v)
    if len(v) == 1 and type(first := v[0]) is list and all(type(x) is str for x in first):
        return (tuple(first),)  # the other common one: a salted root block's [[salt]]
    types = set(map(type, v))
    if list in types or dict in types:
        return tuple([_freeze(x) for x in v])
    return tuple(v)


def wire_block_size(bs: Any) -> int:
    if type(bs) is not int or bs < 0:
        raise EventDrop(DropReason.MALFORMED_EVENT)
    return int(bs)


def opt_str(x: Any) -> bool:
    return x is None or type(x) is str


def opt_int(x: Any) -> bool:
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


def _stored(hs: Any, parent: Any, toks: Any, bs: Any, lora_id: Any, lora_name: Any, medium: Any,
            group: Any, extra: Any, salt: Any, kind: Any, pairs_ok: bool) -> BlockStored:
    """The checks and normalization every layout of `BlockStored` shares (fields in model
    order, as read from the wire; None for a field the layout does not have)."""
    # One expression instead of six helper calls: this runs once per event on the hot path.
    if not (
        (lora_id is None or type(lora_id) is int)
        and (medium is None or type(medium) is str)
        and (lora_name is None or type(lora_name) is str)
        and (group is None or type(group) is int)
        and (kind is None or type(kind) is str)
        and (salt is None or type(salt) is str)
    ):
        raise EventDrop(DropReason.MALFORMED_EVENT)
    return BlockStored(
        wire_hashes(hs), None if parent is None else wire_hash(parent), wire_tokens(toks, pairs_ok),
        wire_block_size(bs), lora_id, lora_name, medium, group, wire_extra_keys(extra), salt, kind,
    )


def _vllm_stored_array(e: list[Any]) -> BlockStored:
    n = len(e)
    if n < 5:
        raise EventDrop(DropReason.MALFORMED_EVENT)
    f = e[:12] if n >= 12 else e + _NONES[: 12 - n]
    _, hs, parent, toks, bs, lora_id, medium, lora_name, extra, group, kind, _window = f
    return _stored(hs, parent, toks, bs, lora_id, lora_name, medium, group, extra, None, kind, False)


def _removed_array(e: list[Any]) -> BlockRemoved:
    """vLLM [tag, hashes, medium?, group_idx?] and SGLang [tag, hashes, medium?]."""
    n = len(e)
    if n < 2:
        raise EventDrop(DropReason.MALFORMED_EVENT)
    medium = e[2] if n > 2 else None
    group = e[3] if n > 3 else None
    if not (opt_str(medium) and opt_int(group)):
        raise EventDrop(DropReason.MALFORMED_EVENT)
    return BlockRemoved(wire_hashes(e[1]), medium, group)


# Map layouts (vLLM >= 0.24, PR #42892): fields by name, unknown keys ignored (locality,
# ownership, session_id, lookahead_token_ids, kv_cache_spec_sliding_window, ...). Fields that no
# engine can omit (non-nullable, no default: block_hashes, token_ids, block_size) are required; a
# missing nullable field reads as None, which is what omit_defaults would have meant.


def _vllm_stored_map(e: dict[Any, Any]) -> BlockStored:
    g = e.get
    hs, toks, bs = g("block_hashes"), g("token_ids"), g("block_size")
    if hs is None or toks is None or bs is None:
        raise EventDrop(DropReason.MALFORMED_EVENT)
    return _stored(hs, g("parent_block_hash"), toks, bs, g("lora_id"), g("lora_name"), g("medium"),
                   g("group_idx"), g("extra_keys"), None, g("kv_cache_spec_kind"), False)


def _removed_map(e: dict[Any, Any]) -> BlockRemoved:
    """vLLM {block_hashes, medium, group_idx, locality, ownership}; SGLang {block_hashes, medium}."""
    hs = e.get("block_hashes")
    if hs is None:
        raise EventDrop(DropReason.MALFORMED_EVENT)
    medium = e.get("medium")
    group = e.get("group_idx")
    if not (opt_str(medium) and opt_int(group)):
        raise EventDrop(DropReason.MALFORMED_EVENT)
    return BlockRemoved(wire_hashes(hs), medium, group)


def _cleared(_e: Any) -> AllBlocksCleared:
    return CLEARED


# --- SGLang events (§3.3) --------------------------------------------------------------------
#
# Arrays (<= 0.5.19): BlockStored [tag, hashes, parent, tokens, block_size, lora_id (6: 0.4.7 ..
# 0.5.6), medium (7: 0.5.9 ..), {"cache_salt": ...} (8: 0.5.18-0.5.19 salted blocks, PR #30827)].
# Maps (>= 0.5.20, PR #37482): + cache_salt, session_id (ignored), lora_name (0.5.22).
# Hashes are signed int64 (first 8 bytes of SHA-256 since 0.5.6; Python hash() before).


def _sglang_stored_array(e: list[Any]) -> BlockStored:
    n = len(e)
    if n < 5:
        raise EventDrop(DropReason.MALFORMED_EVENT)
    f = e[:8] if n >= 8 else e + _NONES[: 8 - n]
    _, hs, parent, toks, bs, lora_id, medium, meta = f
    salt = None
    if meta is not None:
        if type(meta) is not dict:
            raise EventDrop(DropReason.MALFORMED_EVENT)
        salt = meta.get("cache_salt")
    return _stored(hs, parent, toks, bs, lora_id, None, medium, None, None, salt, None, True)


def _sglang_stored_map(e: dict[Any, Any]) -> BlockStored:
    g = e.get
    hs, toks, bs = g("block_hashes"), g("token_ids"), g("block_size")
    if hs is None or toks is None or bs is None:
        raise EventDrop(DropReason.MALFORMED_EVENT)
    return _stored(hs, g("parent_block_hash"), toks, bs, g("lora_id"), g("lora_name"), g("medium"),
                   None, None, g("cache_salt"), None, True)


_Handler = Callable[[Any], KvEvent]


def _table(stored: _Handler, removed: _Handler) -> dict[str, _Handler]:
    """One layout's handlers by event tag."""
    return {"BlockStored": stored, "BlockRemoved": removed, "AllBlocksCleared": _cleared}


_VLLM_ARRAY = _table(_vllm_stored_array, _removed_array)
_VLLM_MAP = _table(_vllm_stored_map, _removed_map)
_SGLANG_ARRAY = _table(_sglang_stored_array, _removed_array)
_SGLANG_MAP = _table(_sglang_stored_map, _removed_map)
# TRT-LLM's streaming ZMQ publisher (PR #17023) and Dynamo's TRT-LLM republisher both emit
# vLLM-shaped map events (§4.3, §5), so engine=trtllm on ZMQ uses the vLLM tables.
HANDLERS: dict[Engine, tuple[dict[str, _Handler], dict[str, _Handler]]] = {
    Engine.VLLM: (_VLLM_ARRAY, _VLLM_MAP),
    Engine.SGLANG: (_SGLANG_ARRAY, _SGLANG_MAP),
    Engine.TRTLLM: (_VLLM_ARRAY, _VLLM_MAP),
}
