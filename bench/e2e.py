"""End-to-end figures of the running daemon: ZMQ publish -> `python -m kv_listener` -> SSE receipt.
Prints figures; asserts nothing.

    .venv/bin/python bench/e2e.py [--duration 10] [--rate 5000] [--step-ms 10] [--window 4000]

The real daemon runs as a subprocess (config in a temp dir, free ports, one vLLM source with salt
verification, no detokenize); in this process a `SimPublisher` (vLLM 0.33 map encoding) plays the
engine and an aiohttp client reads `GET /events/{backend}`, parsing every byte with
`core.sse.SseParser`.

Workload: every stored block is the root of a new salted chain (16 tokens, its own valid
`cache_salt` in `extra_keys`, SPEC §3), so each block is one new prefix and one `cache_created`
record that goes out at once (`update_interval` only coalesces token-count updates). Like an
engine at steady state, the publisher also evicts its oldest chains once `--live` are cached
(one `cache_evicted` each), so the daemon's tracker and live set stay bounded.

(a) sustained throughput: batches of `--batch` blocks as fast as the daemon keeps up (at most
    `--window` blocks published and not yet seen over SSE: 2 records each, so everything in
    flight stays below the default `max_lag` of 10,000 records; a smaller window leaves the
    daemon idle between round trips, a larger one risks buffer_overflow); prints
    blocks/s whose `cache_created` reached the consumer, SSE records/s, and CPU of both processes.
(b) fixed rate: `--rate` blocks/s in one batch per `--step-ms` (a vLLM scheduler step); the
    publish time of each chain is kept here (prefix -> perf_counter) and compared with the
    arrival of its `cache_created`; prints p50/p90/p99/max latency publish -> SSE receipt.

The machine is shared (2 cores, other work may run): the figures are what this run saw.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import random
import resource
import sys
import tempfile
import time
from array import array
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from quiet import quiet_libraries

from kv_listener.core.model import BlockRemoved, BlockStored, KvEvent
from kv_listener.core.salt import issue_cache_salt
from kv_listener.core.sse import SseParser
from kv_listener.sim.encode import encode_vllm_batch
from kv_listener.sim.publisher import SimPublisher
from tests.conftest import free_port
from tests.support.daemon import Daemon

BACKEND = "vllm-1"
MODEL = "bench-model"
SECRET = b"bench-secret"
BLOCK = 16
_HASH_KEY = '"prefix_hash":"'


@dataclass
class Consumer:
    """Reads the SSE stream; per prefix, when its `cache_created` arrived (perf_counter)."""

    resp: aiohttp.ClientResponse
    parser: SseParser = field(default_factory=SseParser)
    created: dict[str, float] = field(default_factory=dict)
    records: int = 0
    overflow: bool = False
    progress: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        while True:
            chunk = await self.resp.content.readany()
            if not chunk:
                return
            now = time.perf_counter()
            for ev in self.parser.feed(chunk):
                self.records += 1
                if ev.event == "cache_created":
                    i = ev.data.find(_HASH_KEY) + len(_HASH_KEY)
                    self.created[ev.data[i:i + 64]] = now
                elif ev.event == "buffer_overflow":
                    self.overflow = True
            self.progress.set()


class Engine:
    """Salted single-block chains, newest last; evicts the oldest beyond `live` chains."""

    def __init__(self, live: int, seed: int = 1) -> None:
        self.rng = random.Random(seed)
        self.live = live
        self.cached: deque[tuple[str, int]] = deque()  # (prefix_hash, block hash)
        self.n = 0
        self.tokens = array("I", range(1000, 1000 + BLOCK))

    def step(self, blocks: int) -> tuple[list[str], bytes]:
        """One batch: `blocks` new chains (and evictions); returns (new prefixes, payload)."""
        events: list[KvEvent] = []
        prefixes = []
        for _ in range(blocks):
            self.n += 1
            key = hashlib.sha256(b"%s\x00Sbench system prompt %d" % (MODEL.encode(), self.n)).digest()
            prefix = key.hex()
            h = self.rng.getrandbits(64)
            salt = issue_cache_salt(SECRET, BACKEND, key)
            events.append(BlockStored(block_hashes=(h,), parent_hash=None, token_ids=self.tokens,
                                      block_size=BLOCK, medium="GPU", extra_keys=((salt,),)))
            self.cached.append((prefix, h))
            prefixes.append(prefix)
        old = []
        while len(self.cached) > self.live:
            old.append(self.cached.popleft()[1])
        if old:
            # an engine frees blocks to make room, then stores: the evictions go first (and the
            # creations, which the bench waits for, come last)
            events.insert(0, BlockRemoved(block_hashes=tuple(old), medium="GPU"))
        return prefixes, encode_vllm_batch(events, ts=time.time(), version="0.33")


class Sent:
    """Prefixes published, in order, and how many of them have arrived: the records of one
    backend arrive in publish order, so that is the index of the first one not received yet."""

    def __init__(self, consumer: Consumer) -> None:
        self.consumer = consumer
        self.prefixes: list[str] = []
        self._seen = 0

    def outstanding(self) -> int:
        created, prefixes = self.consumer.created, self.prefixes
        i = self._seen
        while i < len(prefixes) and prefixes[i] in created:
            i += 1
        self._seen = i
        return len(prefixes) - i

    async def wait_below(self, n: int, timeout_s: float = 30.0) -> None:
        """Wait until fewer than `n` are outstanding (n=1: all arrived)."""
        async with asyncio.timeout(timeout_s):
            while self.outstanding() >= n:
                self.consumer.progress.clear()
                await self.consumer.progress.wait()


async def publish_windowed(engine: Engine, pub: SimPublisher, sent: Sent, args: argparse.Namespace,
                           until: float | None = None, blocks: int | None = None) -> None:
    """Publish batches as fast as the daemon keeps up: at most `--window` blocks in flight."""
    while (until is None or time.perf_counter() < until) and \
            (blocks is None or len(sent.prefixes) < blocks):
        await sent.wait_below(args.window)
        prefixes, payload = engine.step(args.batch)
        pub.publish(payload)
        sent.prefixes += prefixes
    await sent.wait_below(1)


def cpu_s(pid: int | None = None) -> float:
    """CPU seconds (user + system) of `pid`, or of this process."""
    if pid is None:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return ru.ru_utime + ru.ru_stime
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def throughput(args: argparse.Namespace, engine: Engine, pub: SimPublisher,
                     consumer: Consumer, pid: int) -> None:
    sent = Sent(consumer)
    base_records = consumer.records
    t0 = time.perf_counter()
    c0, b0 = cpu_s(pid), cpu_s()
    # the clock stops when the blocks published in time have all arrived
    await publish_windowed(engine, pub, sent, args, until=t0 + args.duration)
    published = sent.prefixes
    elapsed = time.perf_counter() - t0
    c1, b1 = cpu_s(pid), cpu_s()
    records = consumer.records - base_records
    print(f"(a) sustained: {len(published):,} blocks in {elapsed:.2f} s "
          f"(batches of {args.batch}, window {args.window})")
    print(f"    {len(published) / elapsed:,.0f} blocks/s published -> cache_created received over SSE")
    print(f"    {records / elapsed:,.0f} SSE records/s ({records:,} records: created + evicted)")
    print(f"    CPU: daemon {100 * (c1 - c0) / elapsed:.0f}%, bench (publisher + consumer) "
          f"{100 * (b1 - b0) / elapsed:.0f}% of one core")


async def fixed_rate(args: argparse.Namespace, engine: Engine, pub: SimPublisher,
                     consumer: Consumer, pid: int) -> None:
    step_s = args.step_ms / 1000
    per_step = max(1, round(args.rate * step_s))
    sent: dict[str, float] = {}
    progress = Sent(consumer)
    published = progress.prefixes
    late_steps = 0
    t0 = time.perf_counter()
    c0, b0 = cpu_s(pid), cpu_s()
    steps = round(args.duration / step_s)
    for k in range(steps):
        due = t0 + k * step_s
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        elif delay < -step_s:
            late_steps += 1
        prefixes, payload = engine.step(per_step)
        now = time.perf_counter()
        pub.publish(payload)
        for p in prefixes:
            sent[p] = now
        published += prefixes
    sent_elapsed = time.perf_counter() - t0
    await progress.wait_below(1)
    c1, b1 = cpu_s(pid), cpu_s()
    elapsed = time.perf_counter() - t0
    warm = t0 + 0.5  # the first half second is warm-up
    lat = sorted((consumer.created[p] - t) * 1000 for p, t in sent.items() if t >= warm)
    print(f"(b) fixed rate: {len(published):,} blocks in {sent_elapsed:.2f} s = "
          f"{len(published) / sent_elapsed:,.0f} blocks/s offered ({per_step} per {args.step_ms:g} ms "
          f"step; {late_steps} steps more than one step late)")

    def q(f: float) -> float:
        return lat[min(len(lat) - 1, int(f * len(lat)))]

    print(f"    latency publish -> SSE receipt over {len(lat):,} blocks (after 0.5 s warm-up): "
          f"p50 {q(0.50):.2f} ms, p90 {q(0.90):.2f} ms, p99 {q(0.99):.2f} ms, max {lat[-1]:.2f} ms")
    print(f"    CPU: daemon {100 * (c1 - c0) / elapsed:.0f}%, bench {100 * (b1 - b0) / elapsed:.0f}% "
          "of one core")


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="kv-e2e-bench-") as tmp:
        work = Path(tmp)
        secret = work / "salt.secret"
        secret.write_bytes(SECRET + b"\n")
        zport = free_port()
        cfg = {"listen": f"127.0.0.1:{free_port()}", "log": {"level": "info"},
               "cache_salt": {"secret_file": str(secret)},
               "sources": [{"backend_name": BACKEND, "engine": "vllm", "model": MODEL,
                            "zmq_endpoint": f"tcp://127.0.0.1:{zport}"}]}
        async with Daemon(cfg, work) as daemon, \
                SimPublisher(f"tcp://127.0.0.1:{zport}", mode="connect") as pub, \
                aiohttp.ClientSession() as session:
            assert daemon.proc is not None
            pid = daemon.proc.pid
            resp = await session.get(f"{daemon.base}/events/{BACKEND}",
                                     timeout=aiohttp.ClientTimeout(total=None))
            consumer = Consumer(resp)
            reader = asyncio.create_task(consumer.run())
            try:
                await pub.wait_for_subscriber()
                print(f"daemon pid {pid}, {os.cpu_count()} CPUs, load average "
                      f"{os.getloadavg()[0]:.2f}; vLLM 0.33 map encoding, salted single-block chains, "
                      f"{args.live:,} chains cached at steady state")
                engine = Engine(args.live)
                # warm-up: fill the cache to its steady state
                await publish_windowed(engine, pub, Sent(consumer), args, blocks=args.live)
                await throughput(args, engine, pub, consumer, pid)
                await fixed_rate(args, engine, pub, consumer, pid)
                async with session.get(f"{daemon.base}/stats") as r:
                    st = (await r.json())["sources"][BACKEND]
                print(f"daemon /stats: events_received {st['events_received']:,}, gaps {st['gaps']}, "
                      f"events_dropped {st['events_dropped']}, salt_rejected {st['salt_rejected']}, "
                      f"prefixes_live {st['prefixes_live']:,}, last_event_id {st['last_event_id']}")
                if consumer.overflow or st["gaps"] or st["events_dropped"]:
                    print("!! drops, gaps or buffer_overflow: the figures are not valid")
            finally:
                reader.cancel()
                resp.close()
                await asyncio.gather(reader, return_exceptions=True)


if __name__ == "__main__":
    quiet_libraries()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per phase")
    ap.add_argument("--rate", type=float, default=5000.0, help="blocks/s of phase (b)")
    ap.add_argument("--step-ms", type=float, default=10.0, help="one batch per step in phase (b)")
    ap.add_argument("--batch", type=int, default=100, help="blocks per batch in phase (a)")
    ap.add_argument("--window", type=int, default=4000,
                    help="phase (a): most blocks published and not yet received")
    ap.add_argument("--live", type=int, default=20000, help="chains cached before evicting")
    asyncio.run(main(ap.parse_args()))
