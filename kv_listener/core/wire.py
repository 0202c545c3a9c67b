"""Typed wire layouts of vLLM and SGLang msgpack batches, for `msgspec`'s typed decoder.

The fast path of `core.decode.decode_zmq_payload`: a well-formed batch is parsed and checked in
one C pass straight into these Structs (fields by name for the map layouts, by position for the
array ones; a tagged union on `type` / the first element, as the engines define their own
events with msgspec), instead of building generic lists and dicts and reading them field by
field in Python. It accepts a strict subset of what the reference decoder accepts, and
`core.decode` turns what it accepts into exactly the same model events: anything else (a
malformed or unknown event, bytes hashes, EAGLE token pairs, a map envelope, mixed layouts)
makes `typed_batch` return None and the reference decoder, which drops only the bad events and
counts why, takes the payload. Field facts and versions: `shared/reference/wire-formats.md`
§2.4 (vLLM) and §3.3 (SGLang); the reference decoder's comments give the history.

Pure: no I/O.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from kv_listener.core.model import Engine
from kv_listener.core.structs import fields_in_order

__all__ = ["REMOVED_TYPES", "STORED_TYPES", "VLLM_STORED_MAP", "VLLM_STORED_MAP_FIELDS", "typed_batch"]

# Token IDs are left undecoded (`msgspec.Raw`): `core.decode_events.raw_tokens` reads them into
# an `array("I")` in one pass (C where built), with the verdicts `list[int]` and `wire_tokens`
# gave: an ID outside 0 .. 2^32 - 1 is its event's BAD_TOKENS, anything but a list of ints
# (EAGLE pairs, floats) sends the payload to the reference decoder.
_TOKENS = msgspec.Raw
_SIZE = Annotated[int, msgspec.Meta(ge=0)]


# --- map layouts (vLLM >= 0.24, SGLang >= 0.5.20): unknown keys are ignored -------------------

_MAP = {"tag_field": "type", "frozen": True, "gc": False}


class _VllmStoredMap(msgspec.Struct, tag="BlockStored", **_MAP):
    block_hashes: list[int]
    token_ids: _TOKENS
    block_size: _SIZE
    parent_block_hash: int | None = None
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class _SglangStoredMap(msgspec.Struct, tag="BlockStored", **_MAP):
    block_hashes: list[int]
    token_ids: _TOKENS
    block_size: _SIZE
    parent_block_hash: int | None = None
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    cache_salt: str | None = None


class _RemovedMap(msgspec.Struct, tag="BlockRemoved", **_MAP):
    block_hashes: list[int]
    medium: str | None = None
    group_idx: int | None = None


class _ClearedMap(msgspec.Struct, tag="AllBlocksCleared", **_MAP):
    pass


# --- array layouts (vLLM <= 0.23, SGLang <= 0.5.19): shorter arrays take the defaults, longer
# ones are read up to what we know -----------------------------------------------------------

_ARR = {"array_like": True, "frozen": True, "gc": False}


class _VllmStoredArray(msgspec.Struct, tag="BlockStored", **_ARR):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: _TOKENS
    block_size: _SIZE
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class _SglangMeta(msgspec.Struct, frozen=True, gc=False):
    cache_salt: str | None = None


class SglangStoredArray(msgspec.Struct, tag="BlockStored", **_ARR):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: _TOKENS
    block_size: _SIZE
    lora_id: int | None = None
    medium: str | None = None
    meta: _SglangMeta | None = None


class _RemovedArray(msgspec.Struct, tag="BlockRemoved", **_ARR):
    block_hashes: list[int]
    medium: str | None = None
    group_idx: int | None = None


class _ClearedArray(msgspec.Struct, tag="AllBlocksCleared", **_ARR):
    pass


_VllmMap = _VllmStoredMap | _RemovedMap | _ClearedMap
_SglangMap = _SglangStoredMap | _RemovedMap | _ClearedMap
_VllmArray = _VllmStoredArray | _RemovedArray | _ClearedArray
_SglangArray = SglangStoredArray | _RemovedArray | _ClearedArray


def _decoder(event_type: Any) -> msgspec.msgpack.Decoder[Any]:
    batch = msgspec.defstruct("Batch", [("ts", float), ("events", list[event_type]),
                                        ("dp", int | None, None)],
                              array_like=True, frozen=True, gc=False)
    return msgspec.msgpack.Decoder(batch)


# Per engine: the map decoder (current releases) first, then the legacy array one. TRT-LLM's
# streaming ZMQ publisher writes vLLM-shaped events (wire-formats §4.3).
_DECODERS: dict[Engine, tuple[msgspec.msgpack.Decoder[Any], ...]] = {
    Engine.VLLM: (_decoder(_VllmMap), _decoder(_VllmArray)),
    Engine.TRTLLM: (_decoder(_VllmMap), _decoder(_VllmArray)),
    Engine.SGLANG: (_decoder(_SglangMap), _decoder(_SglangArray)),
}

#: The Struct types `typed_batch` can put in `events`, by kind.
STORED_TYPES = (_VllmStoredMap, _SglangStoredMap, _VllmStoredArray, SglangStoredArray)
#: The current vLLM layout (0.24 ..), which `core.decode` reads as one tuple of its fields, in
#: this order (`msgspec.structs.astuple`: one C call instead of ten attribute lookups).
VLLM_STORED_MAP = _VllmStoredMap
VLLM_STORED_MAP_FIELDS = fields_in_order(_VllmStoredMap, (
    "block_hashes", "token_ids", "block_size", "parent_block_hash", "lora_id", "medium",
    "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"))
REMOVED_TYPES = (_RemovedMap, _RemovedArray)


def typed_batch(engine: Engine, payload: bytes | bytearray | memoryview) -> Any | None:
    """The batch as typed Structs (`ts`, `events`, `dp`), or None when the payload is not a
    well-formed batch of known events of one layout (the reference decoder then judges it)."""
    for decoder in _DECODERS[engine]:
        try:
            return decoder.decode(payload)
        except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
            continue
    return None
