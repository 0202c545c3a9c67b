"""Encoders that produce real engine wire payloads from model events (tests, benches, the demo).

Owns the *producer* side of `shared/reference/wire-formats.md` §2.4 (vLLM), §3.3 (SGLang) and
§4.2 (TRT-LLM): for a given engine release it writes exactly what that release's publisher
writes, so the §7 hex vectors come out byte for byte:

- vLLM/SGLang events are msgspec structs with `tag=True` in the engines. In array mode
  (`array_like=True`: vLLM <= 0.23, SGLang <= 0.5.19) msgspec writes *every* field, trailing
  Nones included, so the array length is fixed per release. In map mode it writes the tag
  (`"type"`) first, then fields in declaration order, omitting a defaulted field equal to its
  default (all defaults are None) and keeping required fields even when None. msgspec sizes the
  map header from the struct's maximum key count: 16 or more keys possible -> map16
  (`de 00 NN`) even for 8 keys written (vLLM 0.33's 15-field BlockStored), else a fixmap.
- The batch is always an array `[ts(float64), events, dp_rank]` (2 elements in vLLM 0.9.0).
- Hashes: vLLM >= 0.10.2 sends the u64 (low 64 bits of the digest); vLLM < 0.10.2 (Python
  `hash()`) and every SGLang send a signed int64. The model keeps u64, so the encoder converts.

We write msgpack with the `msgpack` package (a declared dependency) and set the one header
msgspec would size differently by hand; `tests/test_decode.py` cross-checks against msgspec.

Wire-only fields the model does not keep (session_id, locality, ownership,
lookahead_token_ids, kv_cache_spec_sliding_window, bytes hashes, EAGLE token pairs, ...) are set
with `Wire(event, fields={...})`. A model field a release cannot carry raises ValueError rather
than vanishing silently.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from kv_listener.core.decode import DecodedBatch, DecodedTrtllm, TrtllmRecord
from kv_listener.core.model import (
    MEDIUM_GPU,
    MEDIUM_TRTLLM_HOST,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    BlockUpdated,
    CacheCreated,
    KvEvent,
)

__all__ = [
    "SGLANG_VERSIONS",
    "VLLM_VERSIONS",
    "Layout",
    "Wire",
    "assemble_batch",
    "decoded_to_jsonable",
    "encode_sglang_batch",
    "encode_sglang_event",
    "encode_trtllm_events",
    "encode_vllm_batch",
    "encode_vllm_event",
    "event_to_jsonable",
    "sglang_layout",
    "trtllm_to_jsonable",
    "vllm_layout",
]


@dataclass(frozen=True, slots=True)
class Wire:
    """A model event plus raw wire values for fields the model does not keep (or keeps
    normalized): e.g. `{"block_hashes": [digest_bytes]}`, `{"session_id": "s"}`,
    `{"token_ids": [[1, 2], [2, 3]]}`. Each name must be a field of the chosen release."""

    event: KvEvent
    fields: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Layout:
    """What one engine release writes (field names in declaration order, without the tag)."""

    engine: str
    version: tuple[int, int, int]
    map_events: bool
    stored: tuple[str, ...]
    removed: tuple[str, ...]
    required: frozenset[str]  # map mode: fields without a default (written even when None)
    batch_len: int  # 2 (vLLM 0.9.0) or 3
    signed_hashes: bool
    salt_metadata: bool = False  # SGLang 0.5.18-0.5.19: salted blocks append {"cache_salt": ...}


_STORED_REQUIRED = frozenset(
    {"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"}
)

# (first release, change) for vLLM, §2.4 per-release table; each step adds to the previous one.
_VLLM_STEPS: tuple[tuple[tuple[int, int, int], dict[str, Any]], ...] = (
    ((0, 9, 0), {"stored": ("block_hashes", "parent_block_hash", "token_ids", "block_size",
                            "lora_id"), "removed": ("block_hashes",), "batch_len": 2,
                 "signed": True, "map": False}),
    ((0, 9, 1), {"batch_len": 3}),  # data_parallel_rank
    ((0, 10, 2), {"stored+": ("medium",), "removed+": ("medium",), "signed": False}),  # #19737
    ((0, 14, 0), {"stored+": ("lora_name",)}),  # PR #27577
    ((0, 17, 0), {"stored+": ("extra_keys",)}),  # PR #33304
    ((0, 20, 0), {"stored+": ("group_idx",), "removed+": ("group_idx",)}),  # PR #37688
    ((0, 22, 0), {"stored+": ("kv_cache_spec_kind", "kv_cache_spec_sliding_window")}),  # #40984
    ((0, 24, 0), {"map": True}),  # PR #42892
    ((0, 26, 0), {"stored+": ("locality",), "removed+": ("locality",)}),
    ((0, 29, 0), {"stored+": ("ownership",), "removed+": ("ownership",)}),
    ((0, 30, 0), {"stored+": ("session_id",)}),  # PR #51381
    ((0, 33, 0), {"stored+": ("lookahead_token_ids",)}),
)
_VLLM_REQUIRED = _STORED_REQUIRED | {"lora_name"}

# SGLang, §3.3 table. Array mode writes defaulted fields too (medium has a default of None).
_SGLANG_STEPS: tuple[tuple[tuple[int, int, int], dict[str, Any]], ...] = (
    ((0, 4, 7), {"stored": ("block_hashes", "parent_block_hash", "token_ids", "block_size",
                            "lora_id"), "removed": ("block_hashes",), "batch_len": 3,
                 "signed": True, "map": False}),
    ((0, 5, 9), {"stored+": ("medium",), "removed+": ("medium",)}),
    ((0, 5, 18), {"salt_metadata": True}),  # PR #30827: BlockStoredWithMetadata
    ((0, 5, 20), {"map": True, "salt_metadata": False,  # PR #37482
                  "stored+": ("cache_salt", "session_id")}),
    ((0, 5, 22), {"stored+": ("lora_name",)}),
)
_SGLANG_REQUIRED = frozenset({"block_hashes", "parent_block_hash", "token_ids", "block_size",
                              "lora_id"})

#: Releases with a distinct layout (the first release of each step).
VLLM_VERSIONS: tuple[str, ...] = tuple(".".join(map(str, v)) for v, _ in _VLLM_STEPS)
SGLANG_VERSIONS: tuple[str, ...] = tuple(".".join(map(str, v)) for v, _ in _SGLANG_STEPS)


def _parse_version(version: str) -> tuple[int, int, int]:
    parts = version.split(".")
    if not 2 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"version {version!r}: expected MAJOR.MINOR[.PATCH]")
    nums = [int(p) for p in parts] + [0] * (3 - len(parts))
    return nums[0], nums[1], nums[2]


def _layout(engine: str, version: str, steps: Any, required: frozenset[str]) -> Layout:
    v = _parse_version(version)
    if v < steps[0][0]:
        raise ValueError(f"{engine} {version}: KV events start with {steps[0][0]}")
    state: dict[str, Any] = {"salt_metadata": False}
    for first, change in steps:
        if v < first:
            break
        for k, val in change.items():
            if k.endswith("+"):
                state[k[:-1]] = state[k[:-1]] + val
            else:
                state[k] = val
    return Layout(
        engine=engine,
        version=v,
        map_events=state["map"],
        stored=state["stored"],
        removed=state["removed"],
        required=required,
        batch_len=state["batch_len"],
        signed_hashes=state["signed"],
        salt_metadata=state["salt_metadata"],
    )


def vllm_layout(version: str) -> Layout:
    """The layout of a vLLM release (0.9.0 or newer; newer than 0.33 = the 0.33 layout)."""
    return _layout("vllm", version, _VLLM_STEPS, _VLLM_REQUIRED)


def sglang_layout(version: str) -> Layout:
    """The layout of an SGLang release (0.4.7 or newer; newer than 0.5.23 = 0.5.22's layout)."""
    return _layout("sglang", version, _SGLANG_STEPS, _SGLANG_REQUIRED)


# --- events ----------------------------------------------------------------------------------


def _wire_hash(h: int, signed: bool) -> int:
    return h - (1 << 64) if signed and h >= 1 << 63 else h


def _stored_values(ev: BlockStored, lay: Layout) -> dict[str, Any]:
    signed = lay.signed_hashes
    vals: dict[str, Any] = {
        "block_hashes": [_wire_hash(h, signed) for h in ev.block_hashes],
        "parent_block_hash": None
        if ev.parent_hash is None
        else _wire_hash(ev.parent_hash, signed),
        "token_ids": ev.token_ids.tolist(),
        "block_size": ev.block_size,
        "lora_id": ev.lora_id,
        "medium": ev.medium,
        "lora_name": ev.lora_name,
        "extra_keys": ev.extra_keys,
        "group_idx": ev.group_idx,
        "kv_cache_spec_kind": ev.kv_cache_spec_kind,
        "cache_salt": ev.cache_salt,
    }
    return vals


def _removed_values(ev: BlockRemoved, lay: Layout) -> dict[str, Any]:
    return {
        "block_hashes": [_wire_hash(h, lay.signed_hashes) for h in ev.block_hashes],
        "medium": ev.medium,
        "group_idx": ev.group_idx,
    }


def _pack(obj: Any) -> bytes:
    out = msgpack.packb(obj, use_bin_type=True)
    assert isinstance(out, bytes)
    return out


def _encode_event(item: KvEvent | Wire, lay: Layout) -> bytes:
    ev, overrides = (item.event, item.fields) if isinstance(item, Wire) else (item, {})
    metadata: dict[str, Any] | None = None
    if isinstance(ev, BlockStored):
        tag, names, vals = "BlockStored", lay.stored, _stored_values(ev, lay)
        if lay.salt_metadata and ev.cache_salt is not None:
            metadata = {"cache_salt": ev.cache_salt}
            vals["cache_salt"] = None
    elif isinstance(ev, BlockRemoved):
        tag, names, vals = "BlockRemoved", lay.removed, _removed_values(ev, lay)
    elif isinstance(ev, AllBlocksCleared):
        tag, names, vals = "AllBlocksCleared", (), {}
    else:
        raise ValueError(f"{lay.engine} has no {type(ev).__name__} event")
    for name, value in vals.items():
        if value is not None and name not in names:
            raise ValueError(f"{lay.engine} {_vstr(lay)} {tag} cannot carry {name}")
    for name, value in overrides.items():
        if name not in names:
            raise ValueError(f"{lay.engine} {_vstr(lay)} {tag} has no field {name}")
        vals[name] = value
    if not lay.map_events:
        row = [tag, *(vals.get(n) for n in names)]
        if metadata is not None:
            row.append(metadata)
        return _pack(row)
    obj: dict[str, Any] = {"type": tag}
    for n in names:
        value = vals.get(n)
        if value is not None or n in lay.required:
            obj[n] = value
    packed = _pack(obj)
    if len(names) + 1 > 15 and len(obj) <= 15:
        # msgspec: a struct that may write 16+ keys always gets a map16 header (§7.3).
        packed = b"\xde" + len(obj).to_bytes(2, "big") + packed[1:]
    return packed


def _vstr(lay: Layout) -> str:
    return ".".join(map(str, lay.version))


def encode_vllm_event(item: KvEvent | Wire, version: str = "0.33") -> bytes:
    """One vLLM event exactly as that release's msgspec encoder writes it."""
    return _encode_event(item, vllm_layout(version))


def encode_sglang_event(item: KvEvent | Wire, version: str = "0.5.23") -> bytes:
    """One SGLang event exactly as that release's msgspec encoder writes it."""
    return _encode_event(item, sglang_layout(version))


def _array_header(n: int) -> bytes:
    if n <= 15:
        return bytes([0x90 | n])
    if n <= 0xFFFF:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def assemble_batch(
    ts: float, events: Sequence[bytes], dp_rank: int | None = 0, *, two_elements: bool = False
) -> bytes:
    """`[ts, [events...], dp_rank]` from already encoded events (lets tests mix layouts).
    `two_elements=True` writes vLLM 0.9.0's `[ts, events]`."""
    head = b"\x92" if two_elements else b"\x93"
    body = head + _pack(float(ts)) + _array_header(len(events)) + b"".join(events)
    return body if two_elements else body + _pack(dp_rank)


def encode_vllm_batch(
    events: Sequence[KvEvent | Wire], *, ts: float, dp_rank: int | None = 0, version: str = "0.33"
) -> bytes:
    """A vLLM `KVEventBatch` payload (frame 2 of the ZMQ message) of release `version`."""
    lay = vllm_layout(version)
    return assemble_batch(
        ts, [_encode_event(e, lay) for e in events], dp_rank, two_elements=lay.batch_len == 2
    )


def encode_sglang_batch(
    events: Sequence[KvEvent | Wire], *, ts: float, dp_rank: int | None = 0, version: str = "0.5.23"
) -> bytes:
    """An SGLang `EventBatch` payload (`attn_dp_rank` third) of release `version`."""
    lay = sglang_layout(version)
    return assemble_batch(ts, [_encode_event(e, lay) for e in events], dp_rank)


# --- TRT-LLM ---------------------------------------------------------------------------------


def _cache_level(medium: str | None) -> int:
    if medium is None or medium == MEDIUM_GPU:
        return 0
    if medium == MEDIUM_TRTLLM_HOST:
        return 1
    if medium.startswith("CACHE_LEVEL_") and medium[12:].isdigit():
        return int(medium[12:])
    raise ValueError(f"TRT-LLM has no cache level for medium {medium!r}")


def _trt_data(events: tuple[KvEvent, ...], priority: int, block_extras: bool) -> dict[str, Any]:
    first = events[0] if events else None
    if isinstance(first, BlockStored):
        blocks = []
        prev = first.parent_hash
        for ev in events:
            if not isinstance(ev, BlockStored) or len(ev.block_hashes) != 1:
                raise ValueError("a TRT-LLM stored record holds single-hash BlockStored events")
            if ev.parent_hash != prev or ev.block_size != len(ev.token_ids):
                raise ValueError("TRT-LLM stored blocks must chain and hold block_size tokens")
            block: dict[str, Any] = {
                "type": "stored_block",
                "block_hash": ev.block_hashes[0],
                "tokens": [
                    {"type": "unique_token", "token_id": t, "token_extra_id": 0}
                    for t in ev.token_ids
                ],
                "cache_level": _cache_level(ev.medium),
                "priority": priority,
            }
            if block_extras:  # mm_keys and cache_salt (PR #13051) in newer serializers
                block["mm_keys"] = []
                block["cache_salt"] = ev.cache_salt
            elif ev.cache_salt is not None:
                raise ValueError("cache_salt needs block_extras=True")
            blocks.append(block)
            prev = ev.block_hashes[0]
        return {"type": "stored", "parent_hash": first.parent_hash, "blocks": blocks}
    if len(events) != 1:
        raise ValueError("a TRT-LLM record holds one created/removed/updated event")
    if isinstance(first, CacheCreated):
        return {"type": "created", "num_blocks_per_cache_level": list(first.num_blocks_per_cache_level)}
    if isinstance(first, BlockRemoved):
        if first.medium is not None or first.group_idx is not None:
            raise ValueError("TRT-LLM removed events carry no medium or group")
        return {"type": "removed", "block_hashes": list(first.block_hashes)}
    if isinstance(first, BlockUpdated):
        return {
            "type": "updated",
            "block_hash": first.block_hash,
            "cache_level": {
                "type": "event_diff",
                "new_value": _cache_level(first.new_medium),
                "old_value": _cache_level(first.old_medium),
            },
            "priority": {"type": "event_diff", "new_value": priority, "old_value": priority},
        }
    raise ValueError(f"TRT-LLM has no {type(first).__name__} event")


def encode_trtllm_events(
    records: Sequence[TrtllmRecord], *, priority: int = 35, block_extras: bool = True
) -> bytes:
    """A `trtllm-serve` `POST /kv_cache_events` JSON body (KVCacheEventSerializer's shape).

    Each record's `events` is one CacheCreated / BlockRemoved / BlockUpdated, or a chain of
    single-block BlockStored (one `stored` event). `window_size` / `attention_dp_rank` are
    written when not None; `block_extras=False` omits the newer per-block `mm_keys` and
    `cache_salt` keys (older serializers).
    """
    out = []
    for rec in records:
        item: dict[str, Any] = {
            "event_id": rec.event_id,
            "data": _trt_data(rec.events, priority, block_extras),
        }
        if rec.window_size is not None:
            item["window_size"] = rec.window_size
        if rec.dp_rank is not None:
            item["attention_dp_rank"] = rec.dp_rank
        out.append(item)
    return json.dumps(out, separators=(",", ":")).encode()


# --- normalized JSON (fixtures' *.expected.json) ----------------------------------------------


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    if isinstance(value, bytes):
        return {"bytes_hex": value.hex()}
    if hasattr(value, "tolist"):  # array('I')
        return value.tolist()
    return value


def event_to_jsonable(ev: KvEvent) -> dict[str, Any]:
    """Every field of a model event as JSON values (tuples/arrays -> lists, bytes -> hex)."""
    out: dict[str, Any] = {"type": type(ev).__name__}
    for name in ev.__struct_fields__:
        out[name] = _jsonable(getattr(ev, name))
    return out


def decoded_to_jsonable(decoded: DecodedBatch) -> dict[str, Any]:
    b = decoded.batch
    return {
        "ts": b.ts,
        "dp_rank": b.dp_rank,
        "seq": b.seq,
        "raw_events": decoded.raw_events,
        "drops": {str(k): v for k, v in sorted(decoded.drops.items()) if v},
        "events": [event_to_jsonable(e) for e in b.events],
    }


def trtllm_to_jsonable(decoded: DecodedTrtllm) -> dict[str, Any]:
    return {
        "raw_events": decoded.raw_events,
        "drops": {str(k): v for k, v in sorted(decoded.drops.items()) if v},
        "records": [
            {
                "event_id": r.event_id,
                "window_size": r.window_size,
                "dp_rank": r.dp_rank,
                "events": [event_to_jsonable(e) for e in r.events],
            }
            for r in decoded.records
        ],
    }
