"""Hostile input never crashes the decoders (core/decode.py): property tests with Hypothesis.

Random bytes, random msgpack/JSON objects, structurally plausible events with random field values
and mutated golden frames: the decoders either return a result whose counts add up and whose
events are well-typed, or raise `DecodeError`, never anything else.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kv_listener.core import decode, model
from kv_listener.core.decode import (
    DecodedBatch,
    DecodedTrtllm,
    DecodeError,
    DropReason,
    decode_trtllm_events,
    decode_zmq_payload,
)

FRAMES = Path(__file__).resolve().parent.parent / "fixtures" / "frames"
MSGPACK_FRAMES = [p.read_bytes() for p in sorted(FRAMES.glob("*.msgpack"))]
JSON_BODIES = [p.read_bytes() for p in sorted(FRAMES.glob("*.json"))
               if not p.name.endswith(".expected.json")]

FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
ENGINES = st.sampled_from(list(model.Engine))

# --- value strategies ------------------------------------------------------------------------

msgpack_ints = st.one_of(
    st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1),
    st.sampled_from([0, 1, -1, (1 << 32) - 1, 1 << 32, (1 << 63), -(1 << 63), (1 << 64) - 1]),
)
scalars = st.one_of(
    st.none(), st.booleans(), msgpack_ints, st.floats(allow_nan=True),
    st.text(max_size=8), st.binary(max_size=40),
)
msgpack_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.dictionaries(st.one_of(st.text(max_size=6), msgpack_ints), inner, max_size=5),
    ),
    max_leaves=25,
)
TAGS = ["BlockStored", "BlockRemoved", "AllBlocksCleared", "BlockInactive", ""]
FIELDS = ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
          "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "cache_salt",
          "session_id", "lookahead_token_ids", "type"]
plausible_values = st.one_of(
    msgpack_values,
    st.lists(msgpack_ints, max_size=6),
    st.lists(st.lists(msgpack_ints, min_size=1, max_size=3), max_size=4),  # bigram-like pairs
    st.lists(st.one_of(msgpack_ints, st.binary(max_size=40)), max_size=4),
    st.sampled_from(["GPU", "CPU", "CPU_PINNED", None, 0, 16]),
)
array_events = st.builds(lambda tag, rest: [tag, *rest], st.sampled_from(TAGS),
                         st.lists(plausible_values, max_size=13))
map_events = st.builds(lambda tag, rest: {"type": tag, **rest}, st.sampled_from(TAGS),
                       st.dictionaries(st.sampled_from(FIELDS), plausible_values, max_size=10))
events = st.one_of(array_events, map_events, msgpack_values)
batches = st.one_of(
    st.builds(lambda ts, evs, dp: [ts, evs, dp], st.one_of(st.floats(), msgpack_ints),
              st.lists(events, max_size=6), st.one_of(st.none(), msgpack_ints, st.text())),
    st.builds(lambda ts, evs: [ts, evs], st.floats(), st.lists(events, max_size=6)),
    st.builds(lambda ts, evs, dp: {"ts": ts, "events": evs, "attn_dp_rank": dp}, st.floats(),
              st.lists(events, max_size=6), st.one_of(st.none(), msgpack_ints)),
    msgpack_values,
)


# --- invariants --------------------------------------------------------------------------------


def check_batch(d: DecodedBatch) -> None:
    assert isinstance(d, DecodedBatch)
    assert d.raw_events == len(d.batch.events) + sum(d.drops.values())
    assert all(isinstance(r, DropReason) and n > 0 for r, n in d.drops.items())
    assert isinstance(d.batch.ts, float)
    assert d.batch.dp_rank is None or type(d.batch.dp_rank) is int
    for ev in d.batch.events:
        if isinstance(ev, model.BlockStored):
            assert all(type(h) is int and 0 <= h <= model.U64_MASK for h in ev.block_hashes)
            assert ev.parent_hash is None or 0 <= ev.parent_hash <= model.U64_MASK
            assert ev.token_ids.typecode == "I" and ev.block_size >= 0
            for v in (ev.medium, ev.lora_name, ev.cache_salt, ev.kv_cache_spec_kind):
                assert v is None or type(v) is str
            assert ev.extra_keys is None or isinstance(ev.extra_keys, tuple)
            hash(ev.extra_keys)  # nested lists became tuples
        elif isinstance(ev, model.BlockRemoved):
            assert all(type(h) is int and 0 <= h <= model.U64_MASK for h in ev.block_hashes)
            assert ev.medium is None or type(ev.medium) is str
        else:
            assert isinstance(ev, model.AllBlocksCleared)


def decode_zmq_or_error(engine: model.Engine, payload: bytes) -> None:
    try:
        decoded = decode_zmq_payload(engine, payload)
    except DecodeError as exc:
        assert isinstance(exc.reason, DropReason)
        return
    check_batch(decoded)


def check_trtllm(d: DecodedTrtllm) -> None:
    assert d.raw_events >= len(d.records)
    assert sum(d.drops.values()) >= d.raw_events - len(d.records)
    for rec in d.records:
        assert type(rec.event_id) is int
        for ev in rec.events:
            assert isinstance(ev, model.BlockStored | model.BlockRemoved | model.BlockUpdated
                              | model.CacheCreated)
            if isinstance(ev, model.BlockStored):
                assert len(ev.block_hashes) == 1 and ev.block_size == len(ev.token_ids)
                assert 0 <= ev.block_hashes[0] <= model.U64_MASK


def decode_trtllm_or_error(body: Any) -> None:
    try:
        decoded = decode_trtllm_events(body)
    except DecodeError as exc:
        assert exc.reason in (DropReason.INVALID_JSON, DropReason.MALFORMED_BATCH)
        return
    check_trtllm(decoded)


# --- ZMQ payloads ------------------------------------------------------------------------------


@FUZZ
@given(ENGINES, st.binary(max_size=300))
def test_random_bytes(engine: model.Engine, payload: bytes) -> None:
    decode_zmq_or_error(engine, payload)


@FUZZ
@given(ENGINES, batches)
def test_random_msgpack_batches(engine: model.Engine, batch: Any) -> None:
    decode_zmq_or_error(engine, msgpack.packb(batch, use_bin_type=True))


@FUZZ
@given(ENGINES, st.lists(events, min_size=1, max_size=6))
def test_plausible_events_in_a_good_envelope(engine: model.Engine, evs: list[Any]) -> None:
    """A valid envelope never raises, whatever its events hold: bad events are only counted."""
    decoded = decode_zmq_payload(engine, msgpack.packb([1.5, evs, 0], use_bin_type=True))
    check_batch(decoded)
    assert decoded.raw_events == len(evs)


@FUZZ
@given(ENGINES, st.sampled_from(range(len(MSGPACK_FRAMES))), st.data())
def test_mutated_golden_frames(engine: model.Engine, index: int, data: st.DataObject) -> None:
    frame = bytearray(MSGPACK_FRAMES[index])
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]))
        pos = data.draw(st.integers(0, max(0, len(frame) - 1)))
        if op == "flip" and frame:
            frame[pos] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "set" and frame:
            frame[pos] = data.draw(st.integers(0, 255))
        elif op == "insert":
            frame[pos:pos] = data.draw(st.binary(min_size=1, max_size=4))
        elif op == "delete" and frame:
            del frame[pos]
        elif op == "truncate":
            del frame[pos:]
    decode_zmq_or_error(engine, bytes(frame))


def test_deeply_nested_extra_keys_are_dropped_not_raised() -> None:
    nested: Any = "x"
    for _ in range(900):
        nested = [nested]
    ev = ["BlockStored", [1], None, [1], 1, None, "GPU", None, [nested]]
    decoded = decode_zmq_payload(model.Engine.VLLM, msgpack.packb([1.0, [ev, ["AllBlocksCleared"]], 0]))
    check_batch(decoded)
    assert len(decoded.batch.events) >= 1  # the cleared event survives either way


# --- TRT-LLM bodies ----------------------------------------------------------------------------

json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(min_value=-(1 << 70), max_value=1 << 70),
              st.floats(allow_nan=False), st.text(max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=20,
)
trt_data = st.fixed_dictionaries(
    {"type": st.sampled_from(["created", "stored", "removed", "updated", "other"])},
    optional={
        "parent_hash": json_values, "blocks": st.lists(st.one_of(
            json_values,
            st.fixed_dictionaries({}, optional={
                "block_hash": json_values, "cache_level": json_values, "cache_salt": json_values,
                "tokens": st.lists(st.one_of(json_values, st.fixed_dictionaries(
                    {"token_id": json_values})), max_size=4)})), max_size=3),
        "block_hashes": json_values, "block_hash": json_values,
        "cache_level": st.one_of(json_values, st.fixed_dictionaries(
            {}, optional={"old_value": json_values, "new_value": json_values})),
        "num_blocks_per_cache_level": json_values,
    },
)
trt_records = st.fixed_dictionaries(
    {}, optional={"event_id": st.one_of(st.integers(), json_values), "data": trt_data,
                  "window_size": json_values, "attention_dp_rank": json_values},
)


@FUZZ
@given(st.binary(max_size=300))
def test_trtllm_random_bytes(body: bytes) -> None:
    decode_trtllm_or_error(body)


@FUZZ
@given(st.one_of(json_values, st.lists(st.one_of(trt_records, json_values), max_size=6)))
def test_trtllm_random_json(obj: Any) -> None:
    decode_trtllm_or_error(json.dumps(obj))
    decode_trtllm_or_error(obj if isinstance(obj, list) else [obj])


@FUZZ
@given(st.sampled_from(range(len(JSON_BODIES))), st.data())
def test_trtllm_mutated_golden_bodies(index: int, data: st.DataObject) -> None:
    body = bytearray(JSON_BODIES[index])
    for _ in range(data.draw(st.integers(1, 3))):
        pos = data.draw(st.integers(0, max(0, len(body) - 1)))
        if data.draw(st.booleans()) and body:
            body[pos] = data.draw(st.sampled_from(b'0123456789-[]{}",:ntfe'))
        else:
            body[pos:pos] = data.draw(st.sampled_from([b"1", b"-", b"null", b",", b'"x"']))
    decode_trtllm_or_error(bytes(body))


# --- stepwise unpacking (large payloads, issue #11 finding 4) --------------------------------

msgpack_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1),
              st.floats(allow_nan=False), st.text(max_size=20), st.binary(max_size=20)),
    lambda inner: st.one_of(st.lists(inner, max_size=30),
                            st.dictionaries(st.text(max_size=6), inner, max_size=6)),
    max_leaves=200,
)


def outcome(payload: bytes, cap: int) -> Any:
    try:
        return ("ok", decode._unpack(payload, cap))
    except DecodeError as exc:
        return ("drop", exc.reason)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=msgpack_values, cut=st.integers(0, 64), tail=st.binary(max_size=3),
       step=st.integers(1, 40), cap=st.sampled_from([4, 30, 1000]))
def test_stepwise_unpacking_equals_unpackb(value: Any, cut: int, tail: bytes, step: int,
                                           cap: int) -> None:
    # Unpacked in steps of `step` bytes (the daemon uses 64 KiB for payloads above it) the
    # result, or the drop reason, is exactly unpackb's, for whole, truncated and padded input.
    whole = msgpack.packb(value, use_bin_type=True)
    for payload in (whole, whole[: max(0, len(whole) - cut)], whole + tail):
        expected = outcome(payload, cap)
        saved = decode.UNPACK_STEP_BYTES
        decode.UNPACK_STEP_BYTES = step
        try:
            got = outcome(payload, cap)
        finally:
            decode.UNPACK_STEP_BYTES = saved
        assert got == expected
