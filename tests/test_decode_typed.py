"""The typed fast path of `decode_zmq_payload` (core/wire.py) decodes exactly as the reference
decoder: same events, same drops, same errors, for golden frames of every engine release,
frames the simulated engines write, hostile events and mutated frames; and it really is the path
taken for well-formed frames."""

from __future__ import annotations

from array import array
from pathlib import Path
from typing import Any

import msgpack
import msgspec
import pytest
from hypothesis import given, reject
from hypothesis import strategies as st

from kv_listener.core import decode, decode_events, wire
from kv_listener.core.decode import DecodeError, decode_zmq_payload
from kv_listener.core.model import BlockRemoved, BlockStored, Engine
from kv_listener.sim.encode import (
    SGLANG_VERSIONS,
    VLLM_VERSIONS,
    encode_sglang_batch,
    encode_vllm_batch,
)
from tests.test_decode_fuzz import FUZZ, batches, events

FRAMES = Path(__file__).resolve().parent.parent / "fixtures" / "frames"
GOLDEN = sorted(FRAMES.glob("*.msgpack"))


def engine_of(path: Path) -> Engine:
    return Engine.SGLANG if "sglang" in path.name else \
        Engine.TRTLLM if "trtllm" in path.name else Engine.VLLM


def outcome(fn: Any, engine: Engine, payload: bytes, **caps: int) -> Any:
    try:
        return fn(engine, payload, 7, **caps)
    except DecodeError as exc:
        return exc.reason


def reference(engine: Engine, payload: bytes, seq: int | None = 7, *,
              max_event_tokens: int = decode.DEFAULT_MAX_EVENT_TOKENS,
              max_event_hashes: int = decode.DEFAULT_MAX_EVENT_HASHES) -> Any:
    return decode._decode_reference(engine, payload, seq, max_event_tokens, max_event_hashes,
                                    2 * max(max_event_tokens, max_event_hashes))


def same(engine: Engine, payload: bytes, **caps: int) -> None:
    fast = outcome(decode_zmq_payload, engine, payload, **caps)
    ref = outcome(reference, engine, payload, **caps)
    if repr(fast) != repr(ref):  # repr: NaN timestamps compare unequal
        # The one intended difference (see the last test): invalid UTF-8 in a key or value the
        # model does not read sinks the batch for the reference decoder only.
        assert ref is decode.DropReason.INVALID_MSGPACK, (fast, ref)
        msgpack.unpackb(payload, raw=True, strict_map_key=False)  # well-formed but for UTF-8
        with pytest.raises(UnicodeDecodeError):
            msgpack.unpackb(payload, raw=False, strict_map_key=False)


@pytest.mark.parametrize("path", GOLDEN, ids=lambda p: p.name)
def test_golden_frames_take_the_fast_path_when_well_formed(path: Path) -> None:
    payload = path.read_bytes()
    engine = engine_of(path)
    same(engine, payload)
    ref = outcome(reference, engine, payload)
    # Left to the reference decoder by design: EAGLE token pairs, bytes hashes, a map envelope,
    # array and map events mixed in one batch, and any batch with an event it drops.
    by_design = any(s in path.name for s in ("eagle", "bytes", "batch-as-map", "mixed"))
    if not by_design and not isinstance(ref, decode.DropReason) and not ref.drops:
        assert wire.typed_batch(engine, payload) is not None, "fast path refused a golden frame"


hashes_st = st.lists(st.integers(0, (1 << 64) - 1), min_size=1, max_size=4)


@st.composite
def model_events(draw: st.DrawFn) -> list[Any]:
    out: list[Any] = []
    for _ in range(draw(st.integers(1, 5))):
        hs = tuple(draw(hashes_st))
        if draw(st.booleans()):
            n = len(hs) * 4
            out.append(BlockStored(
                hs, draw(st.one_of(st.none(), st.integers(0, (1 << 64) - 1))),
                array("I", draw(st.lists(st.integers(0, (1 << 32) - 1), min_size=n, max_size=n))),
                4, lora_id=draw(st.one_of(st.none(), st.integers(0, 5))),
                medium=draw(st.sampled_from([None, "GPU", "CPU"])),
                lora_name=draw(st.sampled_from([None, "ad"])),
                cache_salt=draw(st.sampled_from([None, "crs1:x"]))))
        else:
            out.append(BlockRemoved(hs, medium=draw(st.sampled_from([None, "GPU"]))))
    return out


LAYOUTS = [(encode_vllm_batch, v, (Engine.VLLM, Engine.TRTLLM)) for v in VLLM_VERSIONS] + \
    [(encode_sglang_batch, v, (Engine.SGLANG,)) for v in SGLANG_VERSIONS]


@FUZZ
@given(model_events(), st.sampled_from(LAYOUTS))
def test_every_release_layout(evs: list[Any], layout: tuple[Any, str, tuple[Engine, ...]]) -> None:
    """Every vLLM and SGLang release's layout (TRT-LLM's ZMQ publisher writes vLLM's) takes the
    fast path and decodes as the reference decoder does."""
    encode, version, engines = layout
    try:
        payload = encode(evs, ts=3.5, version=version)
    except ValueError:  # a field that release cannot carry
        reject()
    for engine in engines:
        same(engine, payload)
        assert wire.typed_batch(engine, payload) is not None


@FUZZ
@given(st.sampled_from(list(Engine)), st.lists(events, min_size=1, max_size=6))
def test_hostile_events_in_a_good_envelope(engine: Engine, evs: list[Any]) -> None:
    same(engine, msgpack.packb([1.5, evs, 0], use_bin_type=True))


@FUZZ
@given(st.sampled_from(list(Engine)), batches)
def test_random_batches(engine: Engine, batch: Any) -> None:
    same(engine, msgpack.packb(batch, use_bin_type=True))


@FUZZ
@given(st.sampled_from(range(len(GOLDEN))), st.data())
def test_mutated_golden_frames(index: int, data: st.DataObject) -> None:
    frame = bytearray(GOLDEN[index].read_bytes())
    for _ in range(data.draw(st.integers(1, 3))):
        pos = data.draw(st.integers(0, max(0, len(frame) - 1)))
        op = data.draw(st.sampled_from(["set", "delete", "truncate"]))
        if op == "set" and frame:
            frame[pos] = data.draw(st.integers(0, 255))
        elif op == "delete" and frame:
            del frame[pos]
        else:
            del frame[pos:]
    same(engine_of(GOLDEN[index]), bytes(frame))


@given(st.integers(1, 12), st.integers(1, 12))
def test_caps_count_the_same_drops(max_tokens: int, max_hashes: int) -> None:
    evs = [BlockStored(tuple(range(1, 1 + n)), None, array("I", range(4 * n)), 4)
           for n in (1, 2, 3)] + [BlockRemoved(tuple(range(1, 9)))]
    payload = encode_vllm_batch(evs, ts=1.0, version="0.33")
    same(Engine.VLLM, payload, max_event_tokens=max_tokens, max_event_hashes=max_hashes)


def test_a_field_nobody_reads_does_not_sink_the_batch() -> None:
    """The one intended difference: invalid UTF-8 in a field the model does not read (key or
    value) is never parsed by the typed path, so its batch is kept; the reference decoder, which builds every
    string, drops the whole payload."""
    good = msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [1], "zz": "ab"}], 0])
    bad = good.replace(b"\xa2ab", b"\xa2\xff\xfe")
    assert decode_zmq_payload(Engine.VLLM, bad).batch.events == (BlockRemoved((1,)),)
    assert outcome(reference, Engine.VLLM, bad) is decode.DropReason.INVALID_MSGPACK


@pytest.mark.parametrize("bad", [1 << 32, -1])
@pytest.mark.parametrize("layout", ["array", "map"])
def test_a_token_outside_u32_is_bad_tokens_even_in_an_event_over_the_token_cap(
        bad: int, layout: str) -> None:
    """The typed layouts take token IDs as plain ints (`array("I")` checks their range): the
    event must still count as the reference decoder counts it, BAD_TOKENS before any cap."""
    toks = [1, 2, bad, 4]
    ev: Any = (["BlockStored", [5], None, toks, 4] if layout == "array" else
               {"type": "BlockStored", "block_hashes": [5], "token_ids": toks, "block_size": 4})
    good: Any = ["BlockRemoved", [9]] if layout == "array" else {"type": "BlockRemoved",
                                                                 "block_hashes": [9]}
    payload = msgpack.packb([1.0, [ev, good], 0])
    for cap in (2, 100):
        same(Engine.VLLM, payload, max_event_tokens=cap)
        got = decode_zmq_payload(Engine.VLLM, payload, max_event_tokens=cap)
        assert got.drops == {decode.DropReason.BAD_TOKENS: 1}
        assert got.batch.events == (BlockRemoved((9,)),)


# --- token IDs read in C (core._wiretok) -----------------------------------------------------

_U32 = decode_events._U32_ARRAY
needs_wiretok = pytest.mark.skipif(_U32 is None, reason="_wiretok not built")


def msgpack_int(v: int, form: int) -> bytes:
    """`v` in one of the msgpack encodings that can hold it (`form` picks among them): a tool
    may write a small ID as uint32 or int64, all of which mean the same token."""
    forms = []
    if 0 <= v <= 0x7F:
        forms.append(bytes([v]))
    if -32 <= v < 0:
        forms.append(bytes([v & 0xFF]))
    for tag, size in ((0xCC, 1), (0xCD, 2), (0xCE, 4), (0xCF, 8)):
        if 0 <= v < 1 << (8 * size):
            forms.append(bytes([tag]) + v.to_bytes(size, "big"))
    for tag, size in ((0xD0, 1), (0xD1, 2), (0xD2, 4), (0xD3, 8)):
        if -(1 << (8 * size - 1)) <= v < 1 << (8 * size - 1):
            forms.append(bytes([tag]) + v.to_bytes(size, "big", signed=True))
    return forms[form % len(forms)]


def msgpack_array_head(n: int, form: int) -> bytes:
    forms = [b"\xdd" + n.to_bytes(4, "big")]
    if n < 1 << 16:
        forms.append(b"\xdc" + n.to_bytes(2, "big"))
    if n <= 15:
        forms.append(bytes([0x90 | n]))
    return forms[form % len(forms)]


def general_u32(data: bytes) -> array[int] | None:
    """What the C reader must give: the array of one msgpack array of ints in 0 .. 2^32 - 1,
    else None (decoded by msgpack itself)."""
    try:
        v = msgpack.unpackb(data, strict_map_key=False)
    except Exception:  # truncated, extra bytes, not msgpack: the general path's to judge
        return None
    if type(v) is not list or not all(type(x) is int and 0 <= x < 1 << 32 for x in v):
        return None
    return array("I", v)


_IDS = st.one_of(st.integers(0, 1 << 32), st.sampled_from([0, 127, 128, 255, 65535, 65536,
                                                             (1 << 32) - 1, 1 << 32, -1, -32,
                                                             -33, (1 << 64) - 1, -(1 << 63)]))


@needs_wiretok
@given(st.lists(st.tuples(_IDS, st.integers(0, 7)), max_size=40), st.integers(0, 2),
       st.sampled_from(["whole", "cut", "extra", "other"]), st.integers(0, 1000))
def test_token_ids_read_in_c_are_what_msgpack_decodes(
    items: list[tuple[int, int]], head: int, damage: str, at: int,
) -> None:
    """Every msgpack encoding of an ID, every array header, and truncated, extended or
    otherwise typed bytes: the C reader gives msgpack's own array of the same IDs, or declines
    (None) where the general path must judge."""
    data = msgpack_array_head(len(items), head) + b"".join(msgpack_int(v, f) for v, f in items)
    if damage == "cut":
        data = data[:at % max(len(data), 1)]
    elif damage == "extra":
        data += b"\x01"
    elif damage == "other" and items:
        data = data[:len(msgpack_array_head(len(items), head))] + msgpack.packb(1.5) + \
            data[len(msgpack_array_head(len(items), head)) + len(msgpack_int(*items[0])):]
    got = _U32(msgspec.Raw(data))
    assert got == general_u32(data)
    assert got is None or got.typecode == "I"


@needs_wiretok
def test_token_ids_read_in_c_decline_what_is_not_an_array_of_ids() -> None:
    for value in (1, "ids", None, [True], [None], [1.0], [[1, 2]], {"a": 1}, [b"x"], [-1],
                  [1 << 32]):
        assert _U32(msgspec.Raw(msgpack.packb(value))) is None, value
    bomb = b"\xdd\xff\xff\xff\xff" + b"\x01" * 10  # claims 4 G items: refused, not allocated
    assert _U32(msgspec.Raw(bomb)) is None
    long = list(range(70_000))  # read with the GIL released
    assert _U32(msgspec.Raw(msgpack.packb(long))) == array("I", long)
    with pytest.raises(TypeError):
        _U32("not a buffer")


def test_raw_token_ids_keep_the_general_verdicts() -> None:
    """`raw_tokens` (C where built, else msgspec and wire_tokens): an ID out of range is the
    event's BAD_TOKENS; anything but a list of ints goes to the reference decoder (None)."""
    assert decode_events.raw_tokens(msgspec.Raw(msgpack.packb([1, 2]))) == array("I", [1, 2])
    for bad in ([-1], [1 << 32], [(1 << 64) - 1]):
        with pytest.raises(decode_events.EventDrop):
            decode_events.raw_tokens(msgspec.Raw(msgpack.packb(bad)))
    for other in ([1.0], [True], "x", [[1, 2]], None):
        assert decode_events.raw_tokens(msgspec.Raw(msgpack.packb(other))) is None
