"""Decoders (core/decode.py) and the simulated engine encoders (sim/encode.py).

Golden frames under fixtures/frames are decoded and compared to their expected JSON (written from
the ground truth the generator encoded); the wire note's §7 vectors are its `vec-*` frames, which
the generator writes from the note's hex text; payloads for drop reasons are built by hand with
plain msgpack; the encoder is checked against msgspec structs declared as the note's §7.8
describes (what the engines use).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest

from kv_listener.core.decode import (
    DecodedBatch,
    DecodeError,
    DropReason,
    TrtllmRecord,
    decode_trtllm_events,
    decode_zmq_payload,
    trtllm_cache_level_medium,
    vllm_salt_candidates,
)
from kv_listener.core.model import (
    MEDIUM_TRTLLM_HOST,
    U64_MASK,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    BlockUpdated,
    CacheCreated,
    Engine,
    normalize_hash,
)
from kv_listener.sim.encode import (
    SGLANG_VERSIONS,
    VLLM_VERSIONS,
    Layout,
    Wire,
    decoded_to_jsonable,
    encode_sglang_batch,
    encode_trtllm_events,
    encode_vllm_batch,
    sglang_layout,
    trtllm_to_jsonable,
    vllm_layout,
)

ROOT = Path(__file__).resolve().parent.parent
FRAMES = ROOT / "fixtures" / "frames"
TS = 1700000000.5
H1 = 15760518052499183552
H2 = 1234567890123456789

# --- golden fixtures ---------------------------------------------------------------------------

FIXTURE_NAMES = sorted(p.name[: -len(".expected.json")] for p in FRAMES.glob("*.expected.json"))


def test_fixture_set_covers_every_layout() -> None:
    names = set(FIXTURE_NAMES)
    assert len(names) >= 40
    # one file per vLLM array length and map era, every SGLang shape, TRT-LLM kinds
    for prefix in ("vllm-0.9.0-array6-batch2", "vllm-0.10.2-array7", "vllm-0.14.0-array8",
                   "vllm-0.17.0-array9", "vllm-0.20.0-array10", "vllm-0.22.0-array12",
                   "vllm-0.24.0-map", "vllm-0.26.0-map", "vllm-0.29.0-map", "vllm-0.30.0-map",
                   "vllm-0.33.0-map16", "sglang-0.4.7-array6", "sglang-0.5.9-array7",
                   "sglang-0.5.18-array8", "sglang-0.5.20-map", "sglang-0.5.22-map",
                   "sglang-0.5.23-map-eagle-bigram", "trtllm-created-stored",
                   "trtllm-removed-updated", "vec-7.2a", "vec-7.3b", "vec-7.6-sglang-map"):
        assert any(n.startswith(prefix) for n in names), prefix


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_fixture_decodes_to_expected(name: str) -> None:
    expected = json.loads((FRAMES / f"{name}.expected.json").read_text())
    engine = Engine(expected.pop("engine"))
    body = FRAMES / f"{name}.json"
    if body.exists():
        got = trtllm_to_jsonable(decode_trtllm_events(body.read_bytes()))
    else:
        decoded = decode_zmq_payload(engine, (FRAMES / f"{name}.msgpack").read_bytes())
        got = decoded_to_jsonable(decoded)
        _check_batch_invariants(decoded)
    assert got == expected


def test_fixtures_are_what_the_generator_writes() -> None:
    """The generator (which also asserts the §7 vectors byte for byte and the §7.7 hash values)
    reproduces every file on disk, and nothing else lies in fixtures/frames."""
    spec = importlib.util.spec_from_file_location("generate_frames", ROOT / "fixtures" /
                                                  "generate_frames.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve annotations through sys.modules
    try:
        spec.loader.exec_module(module)
        files: dict[str, bytes] = module.build()
    finally:
        del sys.modules[spec.name]
    on_disk = {p.name for p in FRAMES.iterdir()}
    assert on_disk == set(files)
    for name, data in files.items():
        assert (FRAMES / name).read_bytes() == data, name


def _check_batch_invariants(decoded: DecodedBatch) -> None:
    assert decoded.raw_events == len(decoded.batch.events) + sum(decoded.drops.values())
    for ev in decoded.batch.events:
        if isinstance(ev, BlockStored):
            assert ev.token_ids.typecode == "I" and ev.token_ids.itemsize == 4
            assert all(0 <= h <= U64_MASK for h in ev.block_hashes)
            assert ev.parent_hash is None or 0 <= ev.parent_hash <= U64_MASK


# --- the wire note's §7 vectors, from the fixtures (the note's hex, byte for byte) ---------------


def vector(name: str) -> bytes:
    """A §7 vector as `fixtures/generate_frames.py` writes it from the note's hex text (its
    `--check`, run by test_fixtures_are_what_the_generator_writes, keeps the two equal)."""
    return (FRAMES / f"vec-{name}.msgpack").read_bytes()


VEC_7_2_ARRAY12 = vector("7.2a-vllm-array12")
VEC_7_2_TWO_BLOCKS = vector("7.2b-vllm-array12-2blocks")
VEC_7_3_MAP16 = vector("7.3a-vllm-map16")
VEC_7_3_SALT = vector("7.3b-vllm-map16-salt")
VEC_7_4_ARRAY = vector("7.4-vllm-array-removed-cleared")
VEC_7_4_MAP = vector("7.4-vllm-map-removed-cleared")
VEC_7_6_SGLANG_MAP = vector("7.6-sglang-map")
VEC_7_6_SGLANG_META = vector("7.6-sglang-array8-metadata")


def test_vector_lengths_match_the_note() -> None:
    assert [len(v) for v in (VEC_7_2_ARRAY12, VEC_7_2_TWO_BLOCKS, VEC_7_3_MAP16, VEC_7_3_SALT,
                             VEC_7_4_ARRAY, VEC_7_4_MAP, VEC_7_6_SGLANG_MAP,
                             VEC_7_6_SGLANG_META)] == [52, 81, 132, 213, 59, 99, 132, 68]


@pytest.mark.parametrize("payload", [VEC_7_2_ARRAY12, VEC_7_3_MAP16], ids=["array12", "map16"])
def test_vector_single_block(payload: bytes) -> None:
    d = decode_zmq_payload(Engine.VLLM, payload, seq=5)
    assert d.batch.ts == TS and d.batch.dp_rank == 0 and d.batch.seq == 5
    assert d.raw_events == 1 and not d.drops
    (ev,) = d.batch.events
    assert ev == BlockStored((H1,), None, array("I", [1, 2, 3, 4]), 4, medium="GPU")


def test_vector_two_blocks_array() -> None:
    (ev,) = decode_zmq_payload(Engine.VLLM, VEC_7_2_TWO_BLOCKS).batch.events
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == (H1, H2)
    assert ev.token_ids.tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert (ev.extra_keys, ev.group_idx, ev.kv_cache_spec_kind) == ((None, None), 0,
                                                                    "full_attention")


def test_vector_map_salt_extra_key() -> None:
    (ev,) = decode_zmq_payload(Engine.VLLM, VEC_7_3_SALT).batch.events
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == (H1, H2) and ev.medium == "GPU"
    assert ev.extra_keys == (("tenant-a",), None)
    assert ev.cache_salt is None  # vLLM carries the salt in extra_keys only
    assert vllm_salt_candidates(ev) == ("tenant-a",)


@pytest.mark.parametrize("payload", [VEC_7_4_ARRAY, VEC_7_4_MAP], ids=["array", "map"])
def test_vector_removed_and_cleared(payload: bytes) -> None:
    d = decode_zmq_payload(Engine.VLLM, payload)
    assert d.batch.events == (BlockRemoved((H1,), "GPU", 0), AllBlocksCleared())


def test_vector_sglang_map_negative_int64() -> None:
    (ev,) = decode_zmq_payload(Engine.SGLANG, VEC_7_6_SGLANG_MAP).batch.events
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == (-3488128144981237669 + (1 << 64), 5674439469042975057)
    assert ev.block_size * len(ev.block_hashes) == len(ev.token_ids) == 8


def test_vector_sglang_metadata_salt() -> None:
    (ev,) = decode_zmq_payload(Engine.SGLANG, VEC_7_6_SGLANG_META).batch.events
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == (3718046898735569995,) and ev.cache_salt == "tenant-a"
    assert ev.medium == "GPU" and ev.lora_id is None


def test_map_header_fixmap_and_map16_decode_alike() -> None:
    """0.24-0.32 write a fixmap (88) where 0.33 writes map16 (de 00 08), same content."""
    fixmap = VEC_7_3_MAP16.replace(b"\xde\x00\x08", b"\x88", 1)
    assert len(fixmap) == len(VEC_7_3_MAP16) - 2
    a = decode_zmq_payload(Engine.VLLM, fixmap).batch.events
    assert a == decode_zmq_payload(Engine.VLLM, VEC_7_3_MAP16).batch.events


# --- shapes built by hand ----------------------------------------------------------------------


def pack_batch(events: list[Any], dp: Any = 0, ts: Any = TS) -> bytes:
    out = msgpack.packb([ts, events, dp])
    assert isinstance(out, bytes)
    return out


def good_array(h: int = 11) -> list[Any]:
    return ["BlockStored", [h], None, [1, 2, 3, 4], 4, None, "GPU"]


def good_map(h: int = 12, parent: int | None = 11) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": parent,
            "token_ids": [5, 6, 7, 8], "block_size": 4, "lora_id": None, "medium": "GPU"}


def test_every_historical_vllm_array_length() -> None:
    """6..12 elements, plus a longer array from a future release (extra elements ignored)."""
    full = ["BlockStored", [1, 2], 9, list(range(8)), 4, 3, "CPU", "ad", [["s"], None], 1,
            "sliding_window", 128, "future", "fields"]
    expected_fields = ["lora_id", "medium", "lora_name", "extra_keys", "group_idx",
                       "kv_cache_spec_kind"]
    expected_values = [3, "CPU", "ad", (("s",), None), 1, "sliding_window"]
    for n in range(6, 15):
        (ev,) = decode_zmq_payload(Engine.VLLM, pack_batch([full[:n]])).batch.events
        assert isinstance(ev, BlockStored)
        assert (ev.block_hashes, ev.parent_hash, ev.block_size) == ((1, 2), 9, 4)
        for i, (f, v) in enumerate(zip(expected_fields, expected_values, strict=True)):
            assert getattr(ev, f) == (v if 5 + i < n else None), (n, f)


def test_two_element_batch_and_map_batch() -> None:
    d = decode_zmq_payload(Engine.VLLM, msgpack.packb([TS, [good_array()]]))
    assert d.batch.dp_rank is None and len(d.batch.events) == 1
    for key in ("data_parallel_rank", "attn_dp_rank"):
        d = decode_zmq_payload(Engine.SGLANG, msgpack.packb({"ts": TS, "events": [good_map()],
                                                            key: 4, "extra": 1}))
        assert d.batch.dp_rank == 4 and d.batch.ts == TS and len(d.batch.events) == 1


def test_integer_ts_is_a_float() -> None:
    d = decode_zmq_payload(Engine.VLLM, pack_batch([], ts=1700000000))
    assert d.batch.ts == 1700000000.0 and isinstance(d.batch.ts, float)


def test_mixed_array_and_map_events_in_one_batch() -> None:
    events = [good_array(11), good_map(12, 11), ["BlockRemoved", [12], "GPU", 0],
              {"type": "BlockRemoved", "block_hashes": [11], "medium": "GPU"},
              {"type": "AllBlocksCleared"}, ["AllBlocksCleared"]]
    d = decode_zmq_payload(Engine.VLLM, pack_batch(events))
    assert [type(e).__name__ for e in d.batch.events] == [
        "BlockStored", "BlockStored", "BlockRemoved", "BlockRemoved", "AllBlocksCleared",
        "AllBlocksCleared"]
    assert d.batch.events[1] == BlockStored((12,), 11, array("I", [5, 6, 7, 8]), 4, medium="GPU")
    assert d.batch.events[2] == BlockRemoved((12,), "GPU", 0)


def test_unknown_map_keys_and_lookahead_are_ignored() -> None:
    ev = good_map() | {"lookahead_token_ids": [[1, 2]], "locality": "LOCAL",
                       "ownership": "x", "session_id": "s", "brand_new": {"a": [1]}}
    (got,) = decode_zmq_payload(Engine.VLLM, pack_batch([ev])).batch.events
    assert got == BlockStored((12,), 11, array("I", [5, 6, 7, 8]), 4, medium="GPU")


def test_missing_nullable_map_fields_read_as_none() -> None:
    ev = {"type": "BlockStored", "block_hashes": [1], "token_ids": [], "block_size": 0}
    (got,) = decode_zmq_payload(Engine.VLLM, pack_batch([ev])).batch.events
    assert got == BlockStored((1,), None, array("I"), 0)


def test_hash_forms_normalize_like_the_model() -> None:
    digest32 = bytes(range(32))
    digest64 = bytes(range(100, 164))
    hashes: list[Any] = [-1, -(1 << 63), (1 << 64) - 1, 0, digest32, digest64]
    (ev,) = decode_zmq_payload(Engine.VLLM, pack_batch(
        [["BlockStored", hashes, digest32, [], 0, None, "CPU"]])).batch.events
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == tuple(normalize_hash(h) for h in hashes)
    assert ev.block_hashes[:4] == (U64_MASK, 1 << 63, U64_MASK, 0)
    assert ev.block_hashes[4] == int.from_bytes(digest32[-8:], "big")
    assert ev.parent_hash == int.from_bytes(digest32[-8:], "big")


def test_media_are_kept_as_sent() -> None:
    media = ["GPU", "CPU", "STORAGE", "CPU_PINNED", "DISK", "EXTERNAL", "FS"]
    events = [["BlockRemoved", [i], m] for i, m in enumerate(media)]
    d = decode_zmq_payload(Engine.SGLANG, pack_batch(events))
    assert [e.medium for e in d.batch.events if isinstance(e, BlockRemoved)] == media


def test_extra_keys_become_nested_tuples() -> None:
    ev = [*good_array(), "ad", [["ad", ["img", 3], b"\x01\x02"], None, []]]
    (got,) = decode_zmq_payload(Engine.VLLM, pack_batch([ev])).batch.events
    assert isinstance(got, BlockStored)
    assert got.extra_keys == (("ad", ("img", 3), b"\x01\x02"), None, ())
    hash(got.extra_keys)  # tuples all the way down: usable as a key


def test_sglang_eagle_bigram_pairs_keep_the_first_token() -> None:
    tokens = [10, 11, 12, 13, 14]
    pairs = [[tokens[i], tokens[i + 1]] for i in range(4)]
    ev = {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
          "token_ids": pairs, "block_size": 2, "lora_id": None}
    (got,) = decode_zmq_payload(Engine.SGLANG, pack_batch([ev])).batch.events
    assert isinstance(got, BlockStored)
    assert got.token_ids.tolist() == tokens[:4]
    # vLLM never sends pairs: the same event is bad tokens there
    d = decode_zmq_payload(Engine.VLLM, pack_batch([ev]))
    assert not d.batch.events and d.drops == {DropReason.BAD_TOKENS: 1}


def test_sglang_array_metadata_and_map_salt() -> None:
    arr = ["BlockStored", [5], None, [1, 2], 2, None, "GPU", {"cache_salt": "t", "other": 1}]
    mp = good_map() | {"cache_salt": "u", "lora_name": "ad", "session_id": "s"}
    a, m = decode_zmq_payload(Engine.SGLANG, pack_batch([arr, mp])).batch.events
    assert isinstance(a, BlockStored) and isinstance(m, BlockStored)
    assert (a.cache_salt, m.cache_salt, m.lora_name) == ("t", "u", "ad")


def test_trtllm_engine_on_zmq_reads_vllm_shaped_events() -> None:
    d = decode_zmq_payload(Engine.TRTLLM, pack_batch([good_map() | {"lora_name": None}]))
    assert d.batch.events == (BlockStored((12,), 11, array("I", [5, 6, 7, 8]), 4, medium="GPU"),)


# --- drop reasons ------------------------------------------------------------------------------

EVENT_DROPS: list[tuple[str, Any, DropReason]] = [
    ("event is an int", 7, DropReason.MALFORMED_EVENT),
    ("event is a string", "BlockStored", DropReason.MALFORMED_EVENT),
    ("empty array", [], DropReason.MALFORMED_EVENT),
    ("tag not a string", [3, [1]], DropReason.MALFORMED_EVENT),
    ("tag unhashable", [["BlockStored"], [1]], DropReason.MALFORMED_EVENT),
    ("map without type", {"block_hashes": [1]}, DropReason.MALFORMED_EVENT),
    ("array too short", ["BlockStored", [1], None, [1]], DropReason.MALFORMED_EVENT),
    ("map missing token_ids", {"type": "BlockStored", "block_hashes": [1], "block_size": 4},
     DropReason.MALFORMED_EVENT),
    ("map missing block_hashes", {"type": "BlockRemoved"}, DropReason.MALFORMED_EVENT),
    ("negative block_size", ["BlockStored", [1], None, [], -1], DropReason.MALFORMED_EVENT),
    ("block_size a float", ["BlockStored", [1], None, [], 4.0], DropReason.MALFORMED_EVENT),
    ("medium an int", ["BlockStored", [1], None, [], 4, None, 0], DropReason.MALFORMED_EVENT),
    ("lora_id a str", ["BlockStored", [1], None, [], 4, "x"], DropReason.MALFORMED_EVENT),
    ("group a str", ["BlockRemoved", [1], "GPU", "g"], DropReason.MALFORMED_EVENT),
    ("unknown tag", ["BlockInactive", [1]], DropReason.UNKNOWN_TAG),
    ("unknown map tag", {"type": "BlockPinned", "block_hashes": [1]}, DropReason.UNKNOWN_TAG),
    ("hash a string", ["BlockRemoved", ["abc"]], DropReason.BAD_HASH),
    ("hash a float", ["BlockRemoved", [1.5]], DropReason.BAD_HASH),
    ("hash a bool", ["BlockRemoved", [True]], DropReason.BAD_HASH),
    ("hash empty bytes", ["BlockRemoved", [b""]], DropReason.BAD_HASH),
    ("hash None", ["BlockRemoved", [None]], DropReason.BAD_HASH),
    ("hashes not a list", ["BlockRemoved", 5], DropReason.BAD_HASH),
    ("parent a string", ["BlockStored", [1], "p", [], 0], DropReason.BAD_HASH),
    ("negative token", ["BlockStored", [1], None, [1, -1], 2], DropReason.BAD_TOKENS),
    ("token >= 2^32", ["BlockStored", [1], None, [1 << 32], 1], DropReason.BAD_TOKENS),
    ("token a float", ["BlockStored", [1], None, [1.0], 1], DropReason.BAD_TOKENS),
    ("token a str", ["BlockStored", [1], None, ["a"], 1], DropReason.BAD_TOKENS),
    ("tokens a map", ["BlockStored", [1], None, {"a": 1}, 1], DropReason.BAD_TOKENS),
]


@pytest.mark.parametrize(("label", "bad", "reason"), EVENT_DROPS,
                         ids=[c[0] for c in EVENT_DROPS])
@pytest.mark.parametrize("engine", [Engine.VLLM, Engine.SGLANG])
def test_bad_event_drops_only_itself(engine: Engine, label: str, bad: Any,
                                     reason: DropReason) -> None:
    payload = pack_batch([good_array(1), bad, good_map(2, 1)])
    d = decode_zmq_payload(engine, payload)
    assert d.drops == {reason: 1}, label
    assert d.raw_events == 3
    assert [e.block_hashes for e in d.batch.events if isinstance(e, BlockStored)] == [(1,), (2,)]


@pytest.mark.parametrize("bad", [[*good_array(), None, [{"a": 1}]], [*good_array(), None, "x"],
                                 [*good_array(), None, None, "g"]],
                         ids=["extra_keys with a map", "extra_keys a str", "group a str"])
def test_vllm_only_fields_are_checked(bad: list[Any]) -> None:
    d = decode_zmq_payload(Engine.VLLM, pack_batch([good_array(1), bad]))
    assert d.drops == {DropReason.MALFORMED_EVENT: 1} and len(d.batch.events) == 1
    # SGLang arrays end at element 7 (metadata); later elements are ignored, not judged
    d = decode_zmq_payload(Engine.SGLANG, pack_batch([good_array(1), bad]))
    assert not d.drops and len(d.batch.events) == 2


@pytest.mark.parametrize("pairs", [[[1, 2], [3]], [[1, 2], 5], [[1, 2], [-1, 2]],
                                   [[1, 2, 3]], [[1.5, 2]]])
def test_sglang_malformed_bigram_pairs(pairs: list[Any]) -> None:
    ev = ["BlockStored", [1], None, pairs, 1, None]
    d = decode_zmq_payload(Engine.SGLANG, pack_batch([ev, good_array(3)]))
    assert d.drops == {DropReason.BAD_TOKENS: 1} and len(d.batch.events) == 1


def test_sglang_metadata_that_is_not_a_map() -> None:
    ev = ["BlockStored", [1], None, [1], 1, None, "GPU", "salt"]
    d = decode_zmq_payload(Engine.SGLANG, pack_batch([ev]))
    assert d.drops == {DropReason.MALFORMED_EVENT: 1}


def test_several_drops_are_counted_per_reason() -> None:
    d = decode_zmq_payload(Engine.VLLM, pack_batch(
        [["X"], ["Y"], ["BlockRemoved", ["h"]], good_array(), 5]))
    assert d.drops == {DropReason.UNKNOWN_TAG: 2, DropReason.BAD_HASH: 1,
                       DropReason.MALFORMED_EVENT: 1}
    assert len(d.batch.events) == 1


BATCH_ERRORS: list[tuple[str, bytes, DropReason]] = [
    ("empty payload", b"", DropReason.INVALID_MSGPACK),
    ("truncated", VEC_7_3_MAP16[:-5], DropReason.INVALID_MSGPACK),
    ("trailing bytes", VEC_7_3_MAP16 + b"\x00", DropReason.INVALID_MSGPACK),
    ("reserved byte", b"\xc1", DropReason.INVALID_MSGPACK),
    ("invalid utf-8 string", b"\x93\xcb" + VEC_7_3_MAP16[2:10] + b"\x91\xa2\xff\xfe\x00",
     DropReason.INVALID_MSGPACK),
    ("an int", msgpack.packb(5), DropReason.MALFORMED_BATCH),
    ("a string", msgpack.packb("batch"), DropReason.MALFORMED_BATCH),
    ("one-element array", msgpack.packb([TS]), DropReason.MALFORMED_BATCH),
    ("ts a string", msgpack.packb(["now", [], 0]), DropReason.MALFORMED_BATCH),
    ("ts a bool", msgpack.packb([True, [], 0]), DropReason.MALFORMED_BATCH),
    ("events a map", msgpack.packb([TS, {"a": 1}, 0]), DropReason.MALFORMED_BATCH),
    ("dp rank a string", msgpack.packb([TS, [], "0"]), DropReason.MALFORMED_BATCH),
    ("map batch without events", msgpack.packb({"ts": TS}), DropReason.MALFORMED_BATCH),
]


@pytest.mark.parametrize(("label", "payload", "reason"), BATCH_ERRORS,
                         ids=[c[0] for c in BATCH_ERRORS])
def test_bad_batch_raises_decode_error(label: str, payload: bytes, reason: DropReason) -> None:
    with pytest.raises(DecodeError) as info:
        decode_zmq_payload(Engine.VLLM, payload)
    assert info.value.reason is reason, label
    assert str(info.value).startswith(reason.value)


def test_decode_error_never_quotes_payload_content() -> None:
    secret = "crs1:secret-salt-do-not-log"
    for payload in (msgpack.packb(secret), msgpack.packb([secret, [], 0]) + b"\x00"):
        with pytest.raises(DecodeError) as info:
            decode_zmq_payload(Engine.VLLM, payload)
        assert secret not in str(info.value) and "secret" not in repr(info.value.args)


def test_drop_reason_values_are_metric_labels() -> None:
    values = [r.value for r in DropReason]
    assert len(values) == len(set(values))
    assert all(v.replace("_", "").isalpha() and v.islower() for v in values)
    # the frame-level and TRT-LLM source reasons the sources count exist
    for name in ("BAD_FRAME_COUNT", "BAD_SEQ", "DUPLICATE_EVENT_ID", "INVALID_JSON"):
        assert name in DropReason.__members__


# --- TRT-LLM -----------------------------------------------------------------------------------


def trt_block(h: int, tokens: list[int], level: int = 0, salt: str | None = None) -> dict[str, Any]:
    return {"type": "stored_block", "block_hash": h,
            "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0}
                       for t in tokens],
            "cache_level": level, "priority": 35, "mm_keys": [], "cache_salt": salt}


def test_trtllm_stored_chains_blocks() -> None:
    body = [{"event_id": 4, "window_size": 32, "attention_dp_rank": 2,
             "data": {"type": "stored", "parent_hash": 100,
                      "blocks": [trt_block(1, [1, 2, 3], salt="s"), trt_block(2, [4, 5], 1),
                                 trt_block(3, [], 2)]}}]
    d = decode_trtllm_events(json.dumps(body))
    (rec,) = d.records
    assert (rec.event_id, rec.window_size, rec.dp_rank) == (4, 32, 2)
    assert rec.events == (
        BlockStored((1,), 100, array("I", [1, 2, 3]), 3, medium="GPU", cache_salt="s"),
        BlockStored((2,), 1, array("I", [4, 5]), 2, medium=MEDIUM_TRTLLM_HOST),
        BlockStored((3,), 2, array("I"), 0, medium="CACHE_LEVEL_2"),
    )
    assert d.raw_events == 1 and not d.drops


def test_trtllm_created_removed_updated() -> None:
    body = [
        {"event_id": 0, "data": {"type": "created", "num_blocks_per_cache_level": [10, 20]}},
        {"event_id": 1, "data": {"type": "removed", "block_hashes": [1, (1 << 64) - 1, -1]}},
        {"event_id": 2, "data": {"type": "updated", "block_hash": 5,
                                 "cache_level": {"type": "event_diff", "new_value": 1,
                                                 "old_value": 0}, "priority": None}},
    ]
    d = decode_trtllm_events(json.dumps(body).encode())
    assert [r.events for r in d.records] == [
        (CacheCreated((10, 20)),),
        (BlockRemoved((1, U64_MASK, U64_MASK)),),
        (BlockUpdated(5, "GPU", MEDIUM_TRTLLM_HOST),),
    ]
    assert all(r.window_size is None and r.dp_rank is None for r in d.records)


@pytest.mark.parametrize("diff", [None, "missing", {"type": "event_diff", "new_value": 1,
                                                    "old_value": 1},
                                  {"type": "event_diff", "new_value": None, "old_value": 0}])
def test_trtllm_update_without_tier_change_is_skipped_and_counted(diff: Any) -> None:
    data: dict[str, Any] = {"type": "updated", "block_hash": 5,
                            "priority": {"type": "event_diff", "new_value": 1, "old_value": 2}}
    if diff != "missing":
        data["cache_level"] = diff
    d = decode_trtllm_events([{"event_id": 3, "data": data}])
    assert d.drops == {DropReason.NO_TIER_CHANGE: 1}
    assert d.records == (TrtllmRecord(3, None, None, ()),)  # event_id kept for continuity


TRT_RECORD_DROPS: list[tuple[str, Any, DropReason, bool]] = [
    ("record not a map", [1, 2], DropReason.MALFORMED_EVENT, False),
    ("empty record", {}, DropReason.MALFORMED_EVENT, False),
    ("event_id a string", {"event_id": "7", "data": {}}, DropReason.MALFORMED_EVENT, False),
    ("event_id a bool", {"event_id": True, "data": {}}, DropReason.MALFORMED_EVENT, False),
    ("data missing", {"event_id": 7}, DropReason.MALFORMED_EVENT, True),
    ("window a string", {"event_id": 7, "window_size": "w",
                         "data": {"type": "removed", "block_hashes": [1]}},
     DropReason.MALFORMED_EVENT, True),
    ("unknown type", {"event_id": 7, "data": {"type": "moved"}}, DropReason.UNKNOWN_TAG, True),
    ("type missing", {"event_id": 7, "data": {"x": 1}}, DropReason.MALFORMED_EVENT, True),
    ("hash too large", {"event_id": 7, "data": {"type": "removed", "block_hashes": [1 << 64]}},
     DropReason.BAD_HASH, True),
    ("hash a string", {"event_id": 7, "data": {"type": "removed", "block_hashes": ["1"]}},
     DropReason.BAD_HASH, True),
    ("removed without list", {"event_id": 7, "data": {"type": "removed"}},
     DropReason.MALFORMED_EVENT, True),
    ("stored without blocks", {"event_id": 7, "data": {"type": "stored", "parent_hash": None}},
     DropReason.MALFORMED_EVENT, True),
    ("stored token negative", {"event_id": 7, "data": {"type": "stored", "parent_hash": None,
                                                       "blocks": [trt_block(1, [-4])]}},
     DropReason.BAD_TOKENS, True),
    ("stored token without id", {"event_id": 7, "data": {"type": "stored", "parent_hash": None,
                                                         "blocks": [trt_block(1, [1]) | {
                                                             "tokens": [{"type": "x"}]}]}},
     DropReason.BAD_TOKENS, True),
    ("stored level negative", {"event_id": 7, "data": {"type": "stored", "parent_hash": None,
                                                       "blocks": [trt_block(1, [1], -1)]}},
     DropReason.MALFORMED_EVENT, True),
    ("created with strings", {"event_id": 7, "data": {"type": "created",
                                                      "num_blocks_per_cache_level": ["a"]}},
     DropReason.MALFORMED_EVENT, True),
]


@pytest.mark.parametrize(("label", "bad", "reason", "kept"), TRT_RECORD_DROPS,
                         ids=[c[0] for c in TRT_RECORD_DROPS])
def test_trtllm_bad_record_drops_only_itself(label: str, bad: Any, reason: DropReason,
                                             kept: bool) -> None:
    good = {"event_id": 1, "data": {"type": "removed", "block_hashes": [9]}}
    d = decode_trtllm_events([good, bad, {**good, "event_id": 8}])
    assert d.drops == {reason: 1}, label
    assert d.raw_events == 3
    ids = [r.event_id for r in d.records]
    assert ids == ([1, 7, 8] if kept else [1, 8])
    assert d.records[0].events == d.records[-1].events == (BlockRemoved((9,)),)
    if kept:
        assert d.records[1].events == ()


@pytest.mark.parametrize(("body", "reason"), [
    (b"[", DropReason.INVALID_JSON), (b"", DropReason.INVALID_JSON),
    (b"\xff\xfe[]", DropReason.INVALID_JSON), ("[1,]", DropReason.INVALID_JSON),
    (b"[" * 100000 + b"]" * 100000, DropReason.INVALID_JSON),
    (b"{}", DropReason.MALFORMED_BATCH), (b'"x"', DropReason.MALFORMED_BATCH),
    (b"null", DropReason.MALFORMED_BATCH),
])
def test_trtllm_bad_body_raises(body: bytes | str, reason: DropReason) -> None:
    with pytest.raises(DecodeError) as info:
        decode_trtllm_events(body)
    assert info.value.reason is reason


def test_trtllm_empty_body_is_no_records() -> None:
    d = decode_trtllm_events(b"[]")
    assert d.records == () and d.raw_events == 0 and not d.drops


def test_trtllm_cache_level_media() -> None:
    assert [trtllm_cache_level_medium(n) for n in (0, 1, 3)] == ["GPU", "HOST", "CACHE_LEVEL_3"]


# --- salt candidates ---------------------------------------------------------------------------


def test_vllm_salt_candidates() -> None:
    def ev(extra: Any, parent: int | None = None, lora: str | None = None) -> BlockStored:
        return BlockStored((1,), parent, array("I"), 0, lora_name=lora, extra_keys=extra)

    assert vllm_salt_candidates(ev((("ad", ("img", 0), "salt"),), lora="ad")) == ("salt",)
    assert vllm_salt_candidates(ev((("ad",),), lora="ad")) == ()
    assert vllm_salt_candidates(ev((("salt",),), parent=5)) == ()  # continuation block
    assert vllm_salt_candidates(ev(None)) == ()
    assert vllm_salt_candidates(ev((None, ("x",)))) == ()


# --- the encoder -------------------------------------------------------------------------------


def test_layout_tables_follow_the_release_history() -> None:
    lengths = {v: len(vllm_layout(v).stored) + 1 for v in
               ("0.9.0", "0.10.1", "0.10.2", "0.13.0", "0.14.0", "0.17.0", "0.19.1", "0.20.0",
                "0.22.0", "0.23.0")}
    assert lengths == {"0.9.0": 6, "0.10.1": 6, "0.10.2": 7, "0.13.0": 7, "0.14.0": 8,
                       "0.17.0": 9, "0.19.1": 9, "0.20.0": 10, "0.22.0": 12, "0.23.0": 12}
    assert [vllm_layout(v).map_events for v in ("0.23.0", "0.24.0", "0.33")] == [False, True,
                                                                                  True]
    assert vllm_layout("0.9.0").batch_len == 2 and vllm_layout("0.9.1").batch_len == 3
    assert len(vllm_layout("0.33").stored) == 15
    assert [len(sglang_layout(v).stored) + 1 for v in ("0.4.7", "0.5.6", "0.5.9", "0.5.19")] == [
        6, 6, 7, 7]
    assert sglang_layout("0.5.18").salt_metadata and not sglang_layout("0.5.20").salt_metadata
    with pytest.raises(ValueError, match="start"):
        vllm_layout("0.8.5")
    with pytest.raises(ValueError, match="MAJOR"):
        vllm_layout("latest")


def test_encoder_refuses_fields_a_release_cannot_carry() -> None:
    ev = BlockStored((1,), None, array("I", [1]), 1, medium="GPU")
    with pytest.raises(ValueError, match="medium"):
        encode_vllm_batch([ev], ts=TS, version="0.10.1")
    with pytest.raises(ValueError, match="cache_salt"):
        encode_vllm_batch([BlockStored((1,), None, array("I"), 0, cache_salt="s")], ts=TS)
    with pytest.raises(ValueError, match="session_id"):
        encode_vllm_batch([Wire(ev, {"session_id": "s"})], ts=TS, version="0.29")
    with pytest.raises(ValueError, match="cache_salt"):
        encode_sglang_batch([BlockStored((1,), None, array("I"), 0, cache_salt="s")], ts=TS,
                            version="0.5.17")
    with pytest.raises(ValueError, match="CacheCreated"):
        encode_vllm_batch([CacheCreated()], ts=TS)


def test_trtllm_encoder_round_trips() -> None:
    records = [
        TrtllmRecord(0, 64, 1, (CacheCreated((4, 2)),)),
        TrtllmRecord(1, 64, 1, (BlockStored((1,), None, array("I", [1, 2]), 2, medium="GPU",
                                            cache_salt="s"),
                                BlockStored((2,), 1, array("I", [3]), 1, medium="HOST"))),
        TrtllmRecord(2, None, None, (BlockUpdated(2, "HOST", "GPU"),)),
        TrtllmRecord(3, None, None, (BlockRemoved((1, 2)),)),
    ]
    assert decode_trtllm_events(encode_trtllm_events(records)).records == tuple(records)
    with pytest.raises(ValueError, match="chain"):
        encode_trtllm_events([TrtllmRecord(0, None, None, (
            BlockStored((1,), None, array("I", [1]), 1),
            BlockStored((2,), 99, array("I", [1]), 1)))])


# msgspec structs as the note's §7.8 describes (own definitions mirroring the engines' field
# lists): the encoder must write exactly what msgspec writes for every release layout. msgspec is
# what the engines use but not a declared dependency of ours (requested for the test extra), so
# only these two tests need it.


def _msgspec_event_types(msgspec: Any, lay: Layout) -> dict[str, Any]:
    def make(tag: str, names: tuple[str, ...], array_like: bool) -> Any:
        required = [n for n in names if n in lay.required]
        optional = [(n, Any, None) for n in names if n not in lay.required]
        fields: list[Any] = [(n, Any) for n in required] + optional
        # msgspec needs required fields first; every release declares them first too
        assert [f[0] for f in fields] == list(names)
        return msgspec.defstruct(tag, fields, tag=True, omit_defaults=True,
                                 array_like=array_like)

    arr = not lay.map_events
    types = {"BlockStored": make("BlockStored", lay.stored, arr),
             "BlockRemoved": make("BlockRemoved", lay.removed, arr),
             "AllBlocksCleared": make("AllBlocksCleared", (), arr)}
    if lay.salt_metadata:
        types["BlockStoredWithMetadata"] = msgspec.defstruct(
            "BlockStoredWithMetadata", [(n, Any) for n in lay.stored] + [("metadata", Any)],
            tag="BlockStored", array_like=True)
    return types


def _msgspec_payload(lay: Layout, events: list[Any], dp: int) -> bytes:
    msgspec = pytest.importorskip("msgspec")
    types = _msgspec_event_types(msgspec, lay)
    signed = lay.signed_hashes

    def wh(h: int) -> int:
        return h - (1 << 64) if signed and h >= 1 << 63 else h

    objs = []
    for ev in events:
        if isinstance(ev, BlockStored):
            vals = {"block_hashes": [wh(h) for h in ev.block_hashes],
                    "parent_block_hash": None if ev.parent_hash is None else wh(ev.parent_hash),
                    "token_ids": ev.token_ids.tolist(), "block_size": ev.block_size,
                    "lora_id": ev.lora_id, "medium": ev.medium, "lora_name": ev.lora_name,
                    "extra_keys": ev.extra_keys, "group_idx": ev.group_idx,
                    "kv_cache_spec_kind": ev.kv_cache_spec_kind, "cache_salt": ev.cache_salt}
            kw = {n: vals.get(n) for n in lay.stored}
            if lay.salt_metadata and ev.cache_salt is not None:
                objs.append(types["BlockStoredWithMetadata"](
                    **kw, metadata={"cache_salt": ev.cache_salt}))
            else:
                objs.append(types["BlockStored"](**kw))
        elif isinstance(ev, BlockRemoved):
            vals = {"block_hashes": [wh(h) for h in ev.block_hashes], "medium": ev.medium,
                    "group_idx": ev.group_idx}
            objs.append(types["BlockRemoved"](**{n: vals.get(n) for n in lay.removed}))
        else:
            objs.append(types["AllBlocksCleared"]())
    if lay.batch_len == 2:
        batch = msgspec.defstruct("EventBatch", [("ts", float), ("events", list[Any])],
                                  array_like=True)(TS, objs)
    else:
        batch = msgspec.defstruct("EventBatch", [("ts", float), ("events", list[Any]),
                                                 ("data_parallel_rank", int | None, None)],
                                  array_like=True, omit_defaults=True)(TS, objs, dp)
    out = msgspec.msgpack.encode(batch)
    assert isinstance(out, bytes)
    return out


def _events_for(lay: Layout) -> list[Any]:
    """Events using every model field the layout can carry (and big/negative hashes)."""
    def has(n: str) -> bool:
        return n in lay.stored

    big = (1 << 64) - 5
    kw: dict[str, Any] = {}
    if has("medium"):
        kw["medium"] = "GPU"
    if has("lora_name"):
        kw["lora_name"] = "ad"
    if has("extra_keys"):
        kw["extra_keys"] = (("s",), None)
    if has("group_idx"):
        kw["group_idx"] = 0
    if has("kv_cache_spec_kind"):
        kw["kv_cache_spec_kind"] = "full_attention"
    if has("cache_salt") or lay.salt_metadata:
        kw["cache_salt"] = "tenant"
    rm: dict[str, Any] = {}
    if "medium" in lay.removed:
        rm["medium"] = "CPU"
    if "group_idx" in lay.removed:
        rm["group_idx"] = 1
    return [
        BlockStored((big, 7), None, array("I", range(32)), 16, lora_id=3, **kw),
        BlockStored((9,), big, array("I", range(16)), 16),
        BlockRemoved((big,), **rm),
        AllBlocksCleared(),
    ]


#: Per engine: its layouts, its encoder, and the dp_rank a batch is encoded with.
ENCODERS: dict[Engine, tuple[Callable[[str], Layout], Callable[..., bytes], int]] = {
    Engine.VLLM: (vllm_layout, encode_vllm_batch, 1),
    Engine.SGLANG: (sglang_layout, encode_sglang_batch, 2),
}


@pytest.mark.parametrize(("engine", "version"), [
    *((Engine.VLLM, v) for v in VLLM_VERSIONS), *((Engine.SGLANG, v) for v in SGLANG_VERSIONS)])
def test_encoder_matches_msgspec(engine: Engine, version: str) -> None:
    layout_of, encode, dp = ENCODERS[engine]
    lay = layout_of(version)
    events = _events_for(lay)
    assert encode(events, ts=TS, dp_rank=dp, version=version) == _msgspec_payload(lay, events, dp)
    # and the decoder reads back what was encoded
    d = decode_zmq_payload(engine, encode(events, ts=TS, version=version))
    assert d.batch.events == tuple(events)
    if engine is Engine.SGLANG:  # always has one (vLLM's older layouts have none)
        assert d.batch.dp_rank == 0


# --- caps on hostile events (issue #11, finding 3) ----------------------------------------------


def test_an_event_over_the_token_or_hash_cap_drops_alone() -> None:
    def ev(n_hashes: int, n_tokens: int, first: int) -> BlockStored:
        return BlockStored(block_hashes=tuple(range(first, first + n_hashes)), parent_hash=None,
                           token_ids=array("I", [5] * n_tokens), block_size=16)

    payload = encode_vllm_batch([ev(1, 16, 1), ev(1, 160, 10), ev(20, 0, 100)], ts=1.0)
    out = decode_zmq_payload(Engine.VLLM, payload, 0, max_event_tokens=100, max_event_hashes=10)
    assert [e.block_hashes[0] for e in out.batch.events] == [1]  # type: ignore[union-attr]
    assert out.drops == {"too_many_tokens": 1, "too_many_hashes": 1}


def test_a_msgpack_bomb_is_refused_before_it_is_built() -> None:
    # one event claiming 10M token IDs: refused by the array-length cap, not materialized
    bomb = msgpack.packb([1.0, [["BlockStored", [1], None, list(range(3000)), 16]]])
    with pytest.raises(DecodeError) as info:
        decode_zmq_payload(Engine.VLLM, bomb, 0, max_event_tokens=1000, max_event_hashes=10)
    assert info.value.reason is DropReason.OVERSIZED_ARRAY
    header = b"\x92\xcb" + b"\x3f\xf0" + b"\x00" * 6 + b"\x91\x95\xabBlockStored\x91\x01\xc0" \
        + b"\xdd" + (10_000_000).to_bytes(4, "big")  # array32 header of 10M elements, no body
    with pytest.raises(DecodeError) as info:
        decode_zmq_payload(Engine.VLLM, header, 0)
    assert info.value.reason in (DropReason.OVERSIZED_ARRAY, DropReason.INVALID_MSGPACK)
