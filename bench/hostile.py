"""Peak memory of the real listener daemon under a hostile publisher (issue #11, finding 3).

One vLLM source, `zmq_mode: connect` to our publisher, a `/detokenize` that accepts requests and
never answers (so every unsalted chain stays pending), and small limits
(`max_tracked_blocks: 20000`, `max_retained_tokens: 1000000`). Phases, each followed by a probe
batch that must still come through (the daemon is alive and in order):

1. giant: a 28.6 MiB frame holding one BlockStored of 10M token IDs (over twice
   `max_message_bytes`: refused by libzmq, ZMQ_MAXMSGSIZE, which drops the connection; the
   listener connects again), and the same frame again;
2. hashes: 625,000 block hashes in one frame (dropped: `oversized_array` / `too_many_hashes`);
3. bomb: an array32 header claiming 10M elements with no body (`oversized_array`);
4. flood: 30,000 distinct two-block chains, each a pending chain whose request never returns;
5. burst: 120 legal 3.7 MiB frames (800 removals of 1,000 hashes each) back to back, faster
   than the listener decodes them: what waits is libzmq's receive queue (counted in frames: 4
   of the 16 MiB socket cap) and then the publisher's;
6. behind: one legal frame of 3,750 16-block chains (960,000 tokens), which the tracker applies
   in pieces, yielding every 5 ms, and 40 of the burst's removal frames right behind it: the
   source decodes them while the pump is busy, so they wait in the source's queue, which holds
   at most 262,144 block hashes (beyond: dropped, counted, an overflow clear).

Printed: the daemon's RSS (VmRSS) and peak RSS (VmHWM) after each phase, the baseline, and the
per-source bound the man page states (max_tracked_blocks x 550 B at worst + max_retained_tokens x 4 B +
44 MiB of queues + one frame being received, 2 x max_message_bytes, + its decoded form, at most 8 x
max_message_bytes, + 64 MiB + 14 x max_message_bytes of frames received and not handled yet:
libzmq's queues (SUB and replay DEALER), a replay's backlog and its answer). Not a test:
figures, measured in one run.

Run: .venv/bin/python bench/hostile.py
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from array import array
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from quiet import quiet_libraries

from kv_listener.core.model import BlockStored
from kv_listener.sim.encode import encode_vllm_batch
from kv_listener.sim.publisher import SimPublisher
from kv_listener.sources.zmq import RECEIVE_BUDGET_BYTES
from tests.conftest import free_port
from tests.support.daemon import Daemon

MAX_BLOCKS = 20_000
MAX_TOKENS = 1_000_000
MAX_MESSAGE = 8 << 20
BURST_FRAMES = 120
BEHIND_FRAMES = 40
#: frames received and not handled yet: libzmq's receive queue (the budget, or 4 frames of the
#: 2 x max_message_bytes socket cap), its replay DEALER's (the budget, or 1 frame), a replay's
#: backlog and its answer (the budget and a frame each)
RECEIVED_MIB = 4 * RECEIVE_BUDGET_BYTES / 2**20 + 14 * MAX_MESSAGE / 2**20


def mem_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of `pid` in KiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0])
    return fields["VmRSS"], fields["VmHWM"]


class Hung:
    """A /detokenize (and /health) that accepts requests and never answers /detokenize."""

    def __init__(self) -> None:
        self.arrived = 0
        self._never = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def _detokenize(self, _: web.Request) -> web.StreamResponse:
        self.arrived += 1
        await self._never.wait()
        return web.Response(status=500)

    async def _health(self, _: web.Request) -> web.StreamResponse:
        return web.Response(status=200)

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/detokenize", self._detokenize)
        app.router.add_post("/tokenize", self._detokenize)
        app.router.add_get("/health", self._health)
        app.router.add_get("/tokenizer_info", lambda _: web.json_response({}, status=404))
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = int(self._runner.addresses[0][1])

    async def close(self) -> None:
        self._never.set()
        if self._runner is not None:
            await self._runner.cleanup()


def chain(first_hash: int, n_blocks: int, tokens_per_block: int = 16, seed: int = 0) -> BlockStored:
    toks = array("I", [(seed * 7919 + i) % 50000 for i in range(n_blocks * tokens_per_block)])
    return BlockStored(block_hashes=tuple(range(first_hash, first_hash + n_blocks)), parent_hash=None,
                       token_ids=toks, block_size=tokens_per_block, medium="GPU")


async def probe(daemon: Daemon, pub: SimPublisher, session: aiohttp.ClientSession, h: int) -> None:
    """Publish one small batch and wait until the daemon counted it (bounded)."""
    async with session.get(f"{daemon.base}/stats") as resp:
        before = (await resp.json())["sources"]["hostile"]["events_decoded"]
    pub.publish(encode_vllm_batch([chain(h, 1)], ts=1.0))
    async with asyncio.timeout(60):
        while True:
            async with session.get(f"{daemon.base}/stats") as resp:
                st = (await resp.json())["sources"]["hostile"]
            if st["events_decoded"] > before:
                return
            await asyncio.sleep(0.1)


async def main() -> None:
    hung = Hung()
    await hung.start()
    zport = free_port()
    workdir = Path(tempfile.mkdtemp(prefix="kvl-hostile-"))
    cfg: dict[str, Any] = {
        "listen": f"127.0.0.1:{free_port()}",
        "limits": {"max_tracked_blocks": MAX_BLOCKS, "max_retained_tokens": MAX_TOKENS},
        "sources": [{"backend_name": "hostile", "engine": "vllm", "model": "m",
                     "zmq_endpoint": f"tcp://127.0.0.1:{zport}", "zmq_mode": "connect",
                     "detokenize_endpoint": f"http://127.0.0.1:{hung.port}/detokenize"}]}
    rows: list[tuple[str, int, int]] = []
    async with SimPublisher(f"tcp://127.0.0.1:{zport}", mode="bind", hwm=1_000_000) as pub, \
            Daemon(cfg, workdir) as daemon, aiohttp.ClientSession() as session:
        assert daemon.proc is not None
        pid = daemon.proc.pid
        await pub.wait_for_subscriber()
        await probe(daemon, pub, session, 1)
        rows.append(("baseline", *mem_kib(pid)))

        giant = encode_vllm_batch([chain(10, 1, tokens_per_block=10_000_000)], ts=1.0)
        for _ in range(2):
            # Over 2 x max_message_bytes: libzmq refuses it and drops the connection, which the
            # listener opens again (a new subscription) without reading the frame whole.
            subscribed = pub.subscribed
            pub.publish(giant)
            await pub.wait_for_subscriber(count=subscribed + 1, timeout_s=30)
        del giant
        await probe(daemon, pub, session, 2)
        rows.append(("giant frame x2 (10M tokens)", *mem_kib(pid)))

        hashes = msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": list(range(625_000)),
                                       "medium": "GPU"}], 0])
        pub.publish(hashes)
        del hashes
        await probe(daemon, pub, session, 3)
        rows.append(("625,000 hashes in one frame", *mem_kib(pid)))

        bomb = b"\x93\xcb" + b"\x3f\xf0" + b"\x00" * 6 + b"\xdd" + (10_000_000).to_bytes(4, "big")
        pub.publish(bomb)
        await probe(daemon, pub, session, 4)
        rows.append(("msgpack bomb (10M-element header)", *mem_kib(pid)))

        for i in range(30_000):
            pub.publish(encode_vllm_batch([chain(1_000_000 + 2 * i, 2, seed=i)], ts=1.0))
            if i % 1000 == 999:
                await asyncio.sleep(0)
        await probe(daemon, pub, session, 5)
        rows.append(("30,000 pending chains, /detokenize hung", *mem_kib(pid)))

        burst = msgpack.packb([1.0, [{"type": "BlockRemoved", "medium": "GPU",
                                      "block_hashes": list(range(i * 1000, i * 1000 + 1000))}
                                     for i in range(800)], 0])
        for _ in range(BURST_FRAMES):
            pub.publish(burst)
        await probe(daemon, pub, session, 6)
        rows.append((f"{BURST_FRAMES} x 3.7 MiB frames back to back", *mem_kib(pid)))

        pub.publish(encode_vllm_batch([chain(10_000_000 + 16 * i, 16, seed=i) for i in range(3_750)],
                                      ts=1.0))
        for _ in range(BEHIND_FRAMES):
            pub.publish(burst)
        del burst
        await probe(daemon, pub, session, 7)
        rows.append((f"{BEHIND_FRAMES} removal frames behind 60,000 blocks", *mem_kib(pid)))
        async with asyncio.timeout(60):  # the queue drained: every clear owed is counted
            while True:
                async with session.get(f"{daemon.base}/stats") as resp:
                    st = (await resp.json())["sources"]["hostile"]
                if st["queue_depth"] == 0 and st["queued_hashes"] == 0:
                    break
                await asyncio.sleep(0.1)
    await hung.close()

    # tracker + queue and resolver budgets + one frame received (2x) + its decoded form (8x: a
    # msgpack fixint is 1 byte, its list slot 8) + the frames received and not handled yet
    bound_mib = ((MAX_BLOCKS * 550 + MAX_TOKENS * 4) / 2**20 + 44 + 10 * MAX_MESSAGE / 2**20
                 + RECEIVED_MIB)
    base = rows[0][1]
    print(f"listener under a hostile publisher (limits: {MAX_BLOCKS} blocks, {MAX_TOKENS} tokens, "
          f"{MAX_MESSAGE >> 20} MiB messages)")
    print(f"{'phase':<42} {'RSS MiB':>8} {'peak MiB':>9} {'over baseline':>14}")
    for name, rss, hwm in rows:
        print(f"{name:<42} {rss / 1024:8.1f} {hwm / 1024:9.1f} {(hwm - base) / 1024:14.1f}")
    print(f"stated per-source bound above the baseline: {bound_mib:.1f} MiB; "
          f"peak over baseline: {(max(r[2] for r in rows) - base) / 1024:.1f} MiB")
    print(f"dropped: {st['events_dropped']}; clears {st['clears_by_reason']}; "
          f"blocks_tracked {st['blocks_tracked']}, tokens_retained {st['tokens_retained']}, "
          f"detokenize requests seen {hung.arrived}")


if __name__ == "__main__":
    # No options, but `--help` must say what this does instead of running it.
    argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0]).parse_args()
    quiet_libraries()
    asyncio.run(main())
