"""Pure decoders of engine KV-cache event payloads into the normalized model (`core.model`).

Owns the batch: the msgpack envelope of vLLM (0.9 .. 0.33) and SGLang (0.4.7 .. 0.5.23) batches,
the caps, and the two paths that turn it into events. The per-event wire knowledge and the drop
reasons (`DropReason`, whose values are metric labels) are in `core.decode_events`; the TRT-LLM
`POST /kv_cache_events` JSON in `core.decode_trtllm`; both are re-exported here.
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

from collections import Counter
from typing import Any, Final

import msgpack
from msgspec.structs import astuple

from kv_listener.core import wire
from kv_listener.core.decode_events import (
    CLEARED,
    EVENT_ERRORS,
    HANDLERS,
    DecodeError,
    DropReason,
    EventDrop,
    raw_tokens,
    wire_extra_keys,
)
from kv_listener.core.decode_trtllm import (
    DecodedTrtllm,
    TrtllmRecord,
    decode_trtllm_events,
    trtllm_cache_level_medium,
)
from kv_listener.core.model import (
    U64_MASK,
    BlockRemoved,
    BlockStored,
    Engine,
    EventBatch,
    KvEvent,
)
from kv_listener.core.structs import FrozenStruct

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


class DecodedBatch(FrozenStruct, frozen=True, gc=False):
    """One decoded vLLM/SGLang batch.

    `raw_events` is the number of events on the wire (decoded + dropped); `drops` maps a
    `DropReason` (a `str`) to how many events were dropped for it. `sum(drops.values()) ==
    raw_events - len(batch.events)`.
    """

    batch: EventBatch
    raw_events: int
    drops: Counter[str]


_M: Final = U64_MASK


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
    array_table, map_table = HANDLERS[engine]
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
        except EventDrop as d:
            drops[d.reason] += 1
            continue
        except EVENT_ERRORS:
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


_STORED_TYPES: Final = frozenset(wire.STORED_TYPES)
_VLLM_STORED_MAP: Final[Any] = wire.VLLM_STORED_MAP
_astuple: Final[Any] = astuple  # compiled: a C static, not a module attribute lookup per call
_REMOVED_TYPES: Final = frozenset(wire.REMOVED_TYPES)


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
                if t is _VLLM_STORED_MAP:
                    # the current vLLM layout, the common case: its fields as one tuple
                    # (compiled, each attribute of a msgspec Struct is a generic lookup, ~160
                    # instructions; `wire.VLLM_STORED_MAP_FIELDS` pins their order)
                    f: tuple[Any, ...] = _astuple(ev)
                    hs, raw, bs, parent, lora_id, medium, lora_name, raw_extra, group, kind = f
                    salt = None
                else:
                    hs, raw, bs, parent, lora_id, medium = (
                        ev.block_hashes, ev.token_ids, ev.block_size, ev.parent_block_hash,
                        ev.lora_id, ev.medium)
                    if not sglang:
                        lora_name, group, raw_extra, salt, kind = (
                            ev.lora_name, ev.group_idx, ev.extra_keys, None, ev.kv_cache_spec_kind)
                    elif t is wire.SglangStoredArray:
                        lora_name, group, raw_extra, kind = None, None, None, None
                        salt = None if ev.meta is None else ev.meta.cache_salt
                    else:
                        lora_name, group, raw_extra, salt, kind = (
                            ev.lora_name, None, None, ev.cache_salt, None)
                # tokens first, as the reference decoder reads them: a value outside u32 is its
                # BAD_TOKENS even in an event too big to keep
                maybe = raw_tokens(raw)  # undecoded so far (core.wire)
                if maybe is None:
                    return None  # not a list of ints: the reference decoder's judgement
                toks = maybe
                if len(toks) > max_event_tokens:
                    drops[DropReason.TOO_MANY_TOKENS] += 1
                    continue
                if len(hs) > max_event_hashes:
                    drops[DropReason.TOO_MANY_HASHES] += 1
                    continue
                out.append(BlockStored(
                    # msgspec gives msgpack ints: -2^63 .. 2^64 - 1; only negatives need the mask
                    tuple([h if h >= 0 else h & _M for h in hs]),
                    None if parent is None else parent if parent >= 0 else parent & _M,
                    toks, bs, lora_id, lora_name, medium, group, wire_extra_keys(raw_extra), salt,
                    kind))
            elif t in _REMOVED_TYPES:
                hs = ev.block_hashes
                if len(hs) > max_event_hashes:
                    drops[DropReason.TOO_MANY_HASHES] += 1
                    continue
                out.append(BlockRemoved(tuple([h if h >= 0 else h & _M for h in hs]), ev.medium,
                                        ev.group_idx))
            else:
                out.append(CLEARED)
    except (EventDrop, *EVENT_ERRORS):
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
