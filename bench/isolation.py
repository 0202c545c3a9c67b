"""One source's large batches must not delay another's records (issue #11, finding 4).

The real listener daemon with two salted vLLM sources. `honest` gets a new single-block salted
chain every 10 ms (each is one `cache_created` on its stream); the bench times each from its
publish to its arrival on `GET /events/honest`. Phase `alone`: nothing else happens. Phase
`neighbour`: meanwhile `hostile` publishes large but legal batches back to back: one
`BlockStored` of 60,000 blocks (960,000 tokens, ~1.5 MB), and frames of 20,000 one-block events.
Frames are encoded before the phase, so the bench's own loop only sends them.

Printed per phase: publish -> SSE latency p50 / p99 / max (ms) of the honest records, the
round trip of `/healthz` probed every 10 ms meanwhile (the daemon's HTTP server shares its event
loop: how long the loop is held), how many hostile events the listener took, and the ratio of the
two phases' p99 and max.
The issue measured 3-7 s of delay before batches were decoded in a worker thread and applied in
pieces. Not a test: figures from one run on this machine.

Run: .venv/bin/python bench/isolation.py [--records 300]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from array import array
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from quiet import quiet_libraries

from kv_listener.core.model import BlockStored
from kv_listener.core.prefix import prefix_hash, prefix_key
from kv_listener.core.salt import issue_cache_salt
from kv_listener.core.sse import SseParser
from kv_listener.sim.encode import encode_vllm_batch
from kv_listener.sim.publisher import SimPublisher
from tests.conftest import free_port
from tests.support.daemon import Daemon

SECRET = b"isolation-bench-secret"
MODEL = "m"


def salted(backend: str, name: str, n_blocks: int, first_hash: int) -> tuple[BlockStored, str]:
    key = prefix_key(MODEL, name, None)
    salt = issue_cache_salt(SECRET, backend, key)
    ev = BlockStored(block_hashes=tuple(range(first_hash, first_hash + n_blocks)),
                     parent_hash=None, token_ids=array("I", [5] * (16 * n_blocks)),
                     block_size=16, medium="GPU",
                     extra_keys=((salt,), *([None] * (n_blocks - 1))))
    return ev, prefix_hash(key)


def hostile_frames(count: int) -> list[bytes]:
    frames = []
    for i in range(count):
        if i % 2 == 0:
            ev, _ = salted("hostile", f"hostile {i}", 60_000, 10**9 + i * 100_000)
            frames.append(encode_vllm_batch([ev], ts=1.0))
        else:
            evs = [BlockStored(block_hashes=(10**10 + i * 30_000 + j,), parent_hash=None,
                               token_ids=array("I", [6] * 16), block_size=16, medium="GPU")
                   for j in range(20_000)]
            frames.append(encode_vllm_batch(evs, ts=1.0))
    return frames


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def phase(name: str, honest: SimPublisher, hostile: SimPublisher | None,
                frames: list[bytes], base: str, http: aiohttp.ClientSession, records: int,
                offset: int) -> dict[str, Any]:
    chains = [salted("honest", f"honest {offset + i}", 1, 10**6 + offset + i)
              for i in range(records)]
    payloads = [encode_vllm_batch([ev], ts=1.0) for ev, _ in chains]
    sent: dict[str, float] = {}
    latency: list[float] = []
    done = asyncio.Event()

    async def read() -> None:
        parser = SseParser()
        async with http.get(f"{base}/events/honest", headers={"Accept": "text/event-stream"},
                            timeout=aiohttp.ClientTimeout(total=None)) as resp:
            while not done.is_set():
                chunk = await resp.content.readany()
                now = time.perf_counter()
                for ev in parser.feed(chunk):
                    ph = json.loads(ev.data).get("prefix_hash")
                    if ev.event == "cache_created" and ph in sent:
                        latency.append((now - sent.pop(ph)) * 1e3)
                        if len(latency) == records:
                            done.set()

    async def flood() -> int:
        n = 0
        while not done.is_set() and hostile is not None:
            hostile.publish(frames[n % len(frames)])
            n += 1
            await asyncio.sleep(0.02)
        return n

    probes: list[float] = []

    async def probe() -> None:  # the daemon's HTTP server shares its loop: /healthz round trips
        while not done.is_set():
            t0 = time.perf_counter()
            async with http.get(f"{base}/healthz") as resp:
                await resp.read()
            probes.append((time.perf_counter() - t0) * 1e3)
            await asyncio.sleep(0.01)

    reader = asyncio.create_task(read())
    await asyncio.sleep(0.3)  # the stream's resync has been read
    probing = asyncio.create_task(probe())
    flooding = asyncio.create_task(flood())
    for (_, ph), payload in zip(chains, payloads, strict=True):
        sent[ph] = time.perf_counter()
        honest.publish(payload)
        await asyncio.sleep(0.01)
    async with asyncio.timeout(120):
        await done.wait()
    sent_hostile = await flooding
    await probing
    reader.cancel()
    return {"phase": name, "p50": pct(latency, 0.5), "p99": pct(latency, 0.99),
            "max": max(latency), "hostile_batches": sent_hostile,
            "healthz": (pct(probes, 0.5), pct(probes, 0.99), max(probes))}


async def main(records: int) -> None:
    frames = hostile_frames(6)
    with tempfile.TemporaryDirectory() as tmp:
        secret = Path(tmp) / "secret"
        secret.write_bytes(SECRET)
        ports = {"honest": free_port(), "hostile": free_port()}
        config = {"listen": f"127.0.0.1:{free_port()}", "log": {"level": "info", "format": "json"},
                  "cache_salt": {"secret_file": str(secret)}, "update_interval": "0ms",
                  "sources": [{"backend_name": n, "engine": "vllm", "model": MODEL,
                               "zmq_endpoint": f"tcp://127.0.0.1:{p}", "zmq_mode": "bind",
                               "engine_down_after": None} for n, p in ports.items()]}
        daemon = Daemon(config, Path(tmp))
        async with daemon, aiohttp.ClientSession() as http, \
                SimPublisher(f"tcp://127.0.0.1:{ports['honest']}", mode="connect") as honest, \
                SimPublisher(f"tcp://127.0.0.1:{ports['hostile']}", mode="connect") as hostile:
            await honest.wait_for_subscriber()
            await hostile.wait_for_subscriber()
            alone = await phase("alone", honest, None, frames, daemon.base, http, records, 0)
            busy = await phase("neighbour", honest, hostile, frames, daemon.base, http, records,
                               records)
            async with http.get(f"{daemon.base}/stats") as resp:
                taken = (await resp.json())["sources"]["hostile"]["events_received"]
    print(f"honest publish -> SSE latency, {records} records per phase (ms)")
    for r in (alone, busy):
        print(f"  {r['phase']:<10} p50 {r['p50']:7.2f}  p99 {r['p99']:7.2f}  max {r['max']:7.2f}"
              f"  hostile batches sent {r['hostile_batches']}")
    print("/healthz round trip meanwhile (ms; the daemon's loop answering)")
    for r in (alone, busy):
        h50, h99, hmax = r["healthz"]
        print(f"  {r['phase']:<10} p50 {h50:7.2f}  p99 {h99:7.2f}  max {hmax:7.2f}")
    print(f"  hostile events the listener took: {taken} (60,000-block events and "
          f"20,000-event frames)")
    print(f"  ratio neighbour/alone: p99 {busy['p99'] / alone['p99']:.2f}x, "
          f"max {busy['max'] / alone['max']:.2f}x")


if __name__ == "__main__":
    quiet_libraries()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=300)
    args = parser.parse_args()
    asyncio.run(main(args.records))
