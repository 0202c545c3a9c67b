"""Benchmark of push mode next to pull mode. Prints figures; asserts nothing.

    .venv/bin/python bench/push.py [--records 100000] [--batch 100] [--repeat 3]

The same records of one backend's stream (the listener's `StreamHub`, real encoder) travel:
- push: `BusClient` -> TLS HTTP/2 (h2 over asyncio) -> `EventBusServer` (hypercorn) -> the
  consumer's `open_announced_stream` iterator;
- pull: `GET /events/{backend}` (the listener's Starlette app under uvicorn) -> aiohttp client;
and the consumer parses every byte with `core.sse.SseParser` (what the router does) in both.

Two shapes:
- replay: the records are in the history first; the consumer asks from `<epoch>-0` (pure transport
  throughput, the hub hands out 512-record chunks);
- live: records are published in batches of `--batch` while the consumer reads (each batch one
  hub fan-out, the transport sees many small writes).

Everything runs in one event loop of one process (listener, router and consumer share a core), so
the figures are a lower bound per core for the whole chain, not for one side.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import structlog

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from quiet import quiet_libraries

from kv_listener.core.bus_protocol import token_hash
from kv_listener.core.model import PrefixTransition, Tier, TransitionKind
from kv_listener.core.sse import SseParser
from kv_listener.outputs.bus_client import BusClient
from kv_listener.outputs.sse_server import NoSources, create_app, serve
from kv_listener.outputs.streams import StreamHub
from kv_listener.router.bus_server import Broker, EventBusServer, TlsFiles
from tests.support.bus import listener_config, write_token
from tests.support.tls import TlsMaterial

BACKEND = "vllm-1"
EPOCH = "be9c4001"
TOKEN = b"bench-token-0123456789"




def make_hub(n: int) -> StreamHub:
    hub = StreamHub(history_size=max(n, 1), max_lag=max(n, 1) + 1, update_interval_s=0.0,
                    max_sse_clients=16, ping_interval_s=None, new_epoch=lambda: EPOCH)
    hub.add_backend(BACKEND)
    return hub


def batches(n: int, size: int) -> list[list[PrefixTransition]]:
    out: list[list[PrefixTransition]] = []
    for start in range(0, n, size):
        out.append([PrefixTransition(TransitionKind.CREATED, f"{i:064x}", 1024 + i % 4096, Tier.GPU_HOT)
                    for i in range(start, min(n, start + size))])
    return out


async def consume(chunks: AsyncIterator[bytes], n: int) -> tuple[int, int]:
    """Parse until `n` records arrived; returns (records, bytes)."""
    parser = SseParser()
    records = 0
    size = 0
    async for chunk in chunks:
        size += len(chunk)
        records += len(parser.feed(chunk))
        if records >= n:
            break
    return records, size


OpenConsumer = Callable[[], Awaitable[AsyncIterator[bytes]]]


async def run_shape(hub: StreamHub, open_consumer: OpenConsumer, work: list[list[PrefixTransition]],
                    n: int, live: bool) -> tuple[float, int]:
    if not live:
        for batch in work:
            hub.publish(BACKEND, batch)
    before = hub.clients
    t0 = time.perf_counter()
    chunks = await open_consumer()
    if live:
        await hub.wait_clients(lambda c: c > before)  # registered: nothing published is missed

        async def produce() -> None:
            for batch in work:
                hub.publish(BACKEND, batch)
                await asyncio.sleep(0)

        _, (records, size) = await asyncio.gather(produce(), consume(chunks, n))
    else:
        records, size = await consume(chunks, n)
    elapsed = time.perf_counter() - t0
    aclose = getattr(chunks, "aclose", None)
    if aclose is not None:
        await aclose()
    assert records >= n, (records, n)
    return elapsed, size


async def main_async(args: argparse.Namespace) -> None:
    n, batch, repeat = args.records, args.batch, args.repeat
    work = batches(n, batch)
    tmp = Path(tempfile.mkdtemp(prefix="bench-push-"))
    tls = TlsMaterial.create(tmp / "tls")
    token_file = write_token(tmp, TOKEN)
    results: dict[tuple[str, str], list[tuple[float, int]]] = {}

    for shape in ("replay", "live"):
        for _ in range(repeat):
            # push
            hub = make_hub(n)
            server = EventBusServer(TlsFiles(tls.server.cert, tls.server.key),
                                    [Broker("kv-listener-a", "kv_listener", token_hash(TOKEN), (BACKEND,))],
                                    host="127.0.0.1", port=0)
            await server.start()
            client = BusClient(listener_config(server.port, tls, token_file), lambda: [BACKEND], hub.open)
            task = asyncio.create_task(client.run())
            await server.wait_announced(BACKEND)

            async def open_push(server: EventBusServer = server) -> AsyncIterator[bytes]:
                return await server.open_announced_stream(BACKEND, f"{EPOCH}-0")

            results.setdefault(("push (TLS h2)", shape), []).append(
                await run_shape(hub, open_push, work, n, shape == "live"))
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await server.close()
            hub.close()

            # pull
            hub = make_hub(n)
            http = await serve(create_app(hub, NoSources()), "127.0.0.1", 0)
            async with aiohttp.ClientSession() as session:
                async def open_pull(session: aiohttp.ClientSession = session, port: int = http.port
                                    ) -> AsyncIterator[bytes]:
                    resp = await session.get(f"http://127.0.0.1:{port}/events/{BACKEND}",
                                             headers={"Last-Event-ID": f"{EPOCH}-0"})
                    return resp.content.iter_any()

                results.setdefault(("pull (SSE http/1.1)", shape), []).append(
                    await run_shape(hub, open_pull, work, n, shape == "live"))
            await hub.drain(timeout_s=2.0)
            await http.stop()
            hub.close()

    print(f"records: {n}, live batch: {batch}, runs: {repeat} (median shown), one event loop")
    print(f"{'transport':<22}{'shape':<8}{'records/s':>12}{'MB/s':>8}{'bytes/rec':>11}")
    for (transport, shape), runs in results.items():
        elapsed = statistics.median(e for e, _ in runs)
        size = runs[0][1]
        print(f"{transport:<22}{shape:<8}{n / elapsed:>12,.0f}{size / elapsed / 1e6:>8.1f}"
              f"{size / n:>11.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    # Quiet: per-stream info logs would be part of what is measured.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    logging.getLogger().setLevel(logging.WARNING)
    asyncio.run(main_async(args))


if __name__ == "__main__":
    quiet_libraries()
    main()
