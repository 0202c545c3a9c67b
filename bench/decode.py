"""Decoder throughput: decoded blocks per second next to the bare parse of the same frames.

    .venv/bin/python bench/decode.py [--seconds 1.0] [--blocks 4] [--events 4] [--tokens 16]

Frames are realistic: each event stores `--blocks` chained blocks of `--tokens` tokens (random
ids below 152k, random 64-bit hashes), `--events` events per batch, encoded by
`kv_listener.sim.encode` as the named engine release writes them. The baseline is the bare
`msgpack.unpackb` (ZMQ frames) or `json.loads` (TRT-LLM bodies) of the same bytes, i.e. the floor
any Python decoder pays; the ratio says how much of it the model building costs on top.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from array import array
from collections.abc import Callable

import msgpack
from quiet import quiet_libraries

from kv_listener.core.decode import TrtllmRecord, decode_trtllm_events, decode_zmq_payload
from kv_listener.core.model import BlockStored, Engine
from kv_listener.sim.encode import encode_sglang_batch, encode_trtllm_events, encode_vllm_batch

N_FRAMES = 200


def stored_events(rnd: random.Random, n_events: int, n_blocks: int, n_tokens: int,
                  salt: str | None = None) -> list[BlockStored]:
    out = []
    for _ in range(n_events):
        hashes = tuple(rnd.getrandbits(64) for _ in range(n_blocks))
        tokens = array("I", (rnd.randrange(152_000) for _ in range(n_blocks * n_tokens)))
        out.append(BlockStored(hashes, rnd.getrandbits(64), tokens, n_tokens, medium="GPU",
                               cache_salt=salt))
    return out


def vllm_frames(version: str, args: argparse.Namespace) -> list[bytes]:
    rnd = random.Random(1)
    frames = []
    for _ in range(N_FRAMES):
        evs = stored_events(rnd, args.events, args.blocks, args.tokens)
        if version >= "0.17":  # one extra_keys entry per hash, as vLLM sends
            evs = [BlockStored(e.block_hashes, e.parent_hash, e.token_ids, e.block_size,
                               medium="GPU", extra_keys=(None,) * len(e.block_hashes),
                               group_idx=0, kv_cache_spec_kind="full_attention") for e in evs]
        frames.append(encode_vllm_batch(evs, ts=time.time(), version=version))
    return frames


def sglang_frames(version: str, args: argparse.Namespace) -> list[bytes]:
    rnd = random.Random(2)
    return [encode_sglang_batch(stored_events(rnd, args.events, args.blocks, args.tokens),
                                ts=time.time(), version=version) for _ in range(N_FRAMES)]


def trtllm_bodies(args: argparse.Namespace) -> list[bytes]:
    """TRT-LLM sends one BlockStored per block, chained, inside one `stored` record."""
    rnd = random.Random(3)
    bodies = []
    event_id = 0
    for _ in range(N_FRAMES):
        records = []
        for _ in range(args.events):
            prev: int | None = None
            chain = []
            for _ in range(args.blocks):
                h = rnd.getrandbits(64)
                toks = array("I", (rnd.randrange(152_000) for _ in range(args.tokens)))
                chain.append(BlockStored((h,), prev, toks, args.tokens, medium="GPU"))
                prev = h
            records.append(TrtllmRecord(event_id, 4096, None, tuple(chain)))
            event_id += 1
        bodies.append(encode_trtllm_events(records))
    return bodies


def rate(fn: Callable[[bytes], object], frames: list[bytes], blocks_per_frame: int,
         seconds: float) -> float:
    for f in frames[:20]:  # warm up
        fn(f)
    n = 0
    start = time.perf_counter()
    deadline = start + seconds
    while time.perf_counter() < deadline:
        for f in frames:
            fn(f)
        n += len(frames)
    return n * blocks_per_frame / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--blocks", type=int, default=4, help="blocks per event")
    parser.add_argument("--events", type=int, default=4, help="events per batch")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per block")
    args = parser.parse_args()
    per_frame = args.blocks * args.events

    cases: list[tuple[str, list[bytes], Callable[[bytes], object], str, Callable[[bytes], object]]]
    cases = [
        ("vLLM 0.33 map", vllm_frames("0.33", args),
         lambda p: decode_zmq_payload(Engine.VLLM, p), "msgpack.unpackb", msgpack.unpackb),
        ("vLLM 0.23 array", vllm_frames("0.23", args),
         lambda p: decode_zmq_payload(Engine.VLLM, p), "msgpack.unpackb", msgpack.unpackb),
        ("vLLM 0.13 array", vllm_frames("0.13", args),
         lambda p: decode_zmq_payload(Engine.VLLM, p), "msgpack.unpackb", msgpack.unpackb),
        ("SGLang 0.5.23 map", sglang_frames("0.5.23", args),
         lambda p: decode_zmq_payload(Engine.SGLANG, p), "msgpack.unpackb", msgpack.unpackb),
        ("SGLang 0.5.17 array", sglang_frames("0.5.17", args),
         lambda p: decode_zmq_payload(Engine.SGLANG, p), "msgpack.unpackb", msgpack.unpackb),
        ("TRT-LLM JSON", trtllm_bodies(args), decode_trtllm_events, "json.loads", json.loads),
    ]
    print(f"{per_frame} blocks per frame ({args.events} events x {args.blocks} blocks x "
          f"{args.tokens} tokens), {args.seconds:.1f} s per figure")
    print(f"{'frames':<22}{'bytes/frame':>12}{'decode blocks/s':>18}{'baseline':>18}"
          f"{'baseline blocks/s':>19}{'ratio':>8}")
    for name, frames, decode, base_name, base in cases:
        size = sum(map(len, frames)) / len(frames)
        ours = rate(decode, frames, per_frame, args.seconds)
        floor = rate(base, frames, per_frame, args.seconds)
        print(f"{name:<22}{size:>12.0f}{ours:>18,.0f}{base_name:>18}{floor:>19,.0f}"
              f"{ours / floor:>8.2f}")


if __name__ == "__main__":
    quiet_libraries()
    main()
