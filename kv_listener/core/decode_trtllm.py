"""The TRT-LLM `POST /kv_cache_events` JSON body decoded (wire-formats §4.2; part of `core.decode`).

A body is a list of records `{event_id, window_size, attention_dp_rank, data}`; a record whose
`data` is malformed, of an unknown type, or an `updated` with no tier change keeps its
`event_id` (for dedupe and gap detection) with no events. Pure, like the rest of the core.
"""

from __future__ import annotations

import json
from array import array
from collections import Counter
from collections.abc import Callable
from typing import Any

from kv_listener.core.decode_events import (
    EVENT_ERRORS,
    DecodeError,
    DropReason,
    EventDrop,
    opt_int,
    opt_str,
    wire_hash,
    wire_parent,
)
from kv_listener.core.model import (
    MEDIUM_GPU,
    MEDIUM_TRTLLM_HOST,
    BlockRemoved,
    BlockStored,
    BlockUpdated,
    CacheCreated,
    KvEvent,
)
from kv_listener.core.structs import FrozenStruct


class TrtllmRecord(FrozenStruct, frozen=True, gc=False):
    """One record of a TRT-LLM `/kv_cache_events` response.

    `events` is empty when the record's `data` was dropped (malformed, unknown type, an `updated`
    with no tier change): the record is still returned so that `event_id` continuity (dedupe and
    gap detection) holds. `dp_rank` is TRT-LLM's `attention_dp_rank`.
    """

    event_id: int
    window_size: int | None
    dp_rank: int | None
    events: tuple[KvEvent, ...]


class DecodedTrtllm(FrozenStruct, frozen=True, gc=False):
    """A decoded TRT-LLM body: records in wire order, `raw_events` records on the wire."""

    records: tuple[TrtllmRecord, ...]
    raw_events: int
    drops: Counter[str]


# --- TRT-LLM (§4.2) --------------------------------------------------------------------------

_LEVEL_MEDIA: dict[int, str] = {0: MEDIUM_GPU, 1: MEDIUM_TRTLLM_HOST}


def trtllm_cache_level_medium(level: int) -> str:
    """TRT-LLM `cache_level` -> medium: 0 (primary) `GPU`, 1 (secondary) `HOST`, and any further
    level a storage tier named `CACHE_LEVEL_<n>` (none exists today; kept rather than dropped)."""
    medium = _LEVEL_MEDIA.get(level)
    return medium if medium is not None else f"CACHE_LEVEL_{level}"


def _level(v: Any) -> str:
    if type(v) is not int or v < 0:
        raise EventDrop(DropReason.MALFORMED_EVENT)
    return trtllm_cache_level_medium(v)


def _trt_stored(data: dict[str, Any]) -> tuple[KvEvent, ...]:
    """`stored` -> one BlockStored per block, chained: block i's parent is block i-1's hash, the
    first's is `parent_hash`. `block_size` is the block's own token count (the last block of an
    event may be partial, §4.2)."""
    blocks = data.get("blocks")
    if type(blocks) is not list:
        raise EventDrop(DropReason.MALFORMED_EVENT)
    prev = wire_parent(data.get("parent_hash"))
    out: list[KvEvent] = []
    for b in blocks:
        if type(b) is not dict:
            raise EventDrop(DropReason.MALFORMED_EVENT)
        h = wire_hash(b.get("block_hash"))
        toks = b.get("tokens")
        if toks is None:
            toks = []
        if type(toks) is not list:
            raise EventDrop(DropReason.BAD_TOKENS)
        try:
            ids = array("I", [t["token_id"] for t in toks])
        except (TypeError, KeyError, OverflowError, IndexError):
            raise EventDrop(DropReason.BAD_TOKENS) from None
        # cache_level is always serialized for stored blocks; absent means the primary pool,
        # where TRT-LLM stores new blocks.
        level = b.get("cache_level")
        medium = MEDIUM_GPU if level is None else _level(level)
        salt = b.get("cache_salt")  # PR #13051; absent before
        if not opt_str(salt):
            raise EventDrop(DropReason.MALFORMED_EVENT)
        out.append(BlockStored((h,), prev, ids, len(ids), medium=medium, cache_salt=salt))
        prev = h
    return tuple(out)


def _trt_removed(data: dict[str, Any]) -> tuple[KvEvent, ...]:
    hs = data.get("block_hashes")
    if type(hs) is not list:
        raise EventDrop(DropReason.MALFORMED_EVENT)
    # TRT-LLM does not say which level a removed block left: None = every medium.
    return (BlockRemoved(tuple([wire_hash(h) for h in hs])),)


def _trt_updated(data: dict[str, Any]) -> tuple[KvEvent, ...]:
    h = wire_hash(data.get("block_hash"))
    diff = data.get("cache_level")
    # The C++ diff fields are optional (§4.2, §8): a null/missing cache_level diff is a priority
    # update only, which moves no tier.
    if diff is None:
        raise EventDrop(DropReason.NO_TIER_CHANGE)
    if type(diff) is not dict:
        raise EventDrop(DropReason.MALFORMED_EVENT)
    old, new = diff.get("old_value"), diff.get("new_value")
    if new is None:
        raise EventDrop(DropReason.NO_TIER_CHANGE)
    new_medium = _level(new)
    old_medium = None if old is None else _level(old)
    if old_medium == new_medium:
        raise EventDrop(DropReason.NO_TIER_CHANGE)
    return (BlockUpdated(h, old_medium, new_medium),)


def _trt_created(data: dict[str, Any]) -> tuple[KvEvent, ...]:
    n = data.get("num_blocks_per_cache_level")
    if n is None:
        n = []
    if type(n) is not list or not all(type(x) is int for x in n):
        raise EventDrop(DropReason.MALFORMED_EVENT)
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
    if not (opt_int(ws) and opt_int(dp)):
        raise EventDrop(DropReason.MALFORMED_EVENT)
    data = rec.get("data")
    if type(data) is not dict:
        raise EventDrop(DropReason.MALFORMED_EVENT)
    kind = data.get("type")
    handler = _TRT_HANDLERS.get(kind) if type(kind) is str else None
    if handler is None:
        raise EventDrop(DropReason.UNKNOWN_TAG if type(kind) is str else DropReason.MALFORMED_EVENT)
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
        except EventDrop as d:
            drops[d.reason] += 1
            events = ()
        except EVENT_ERRORS:
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
