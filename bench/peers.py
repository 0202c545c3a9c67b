"""Ingestion next to a peer: NVIDIA Dynamo's standalone KV indexer and this project's daemon drain
the same ZMQ frames. Prints figures; asserts nothing (issue 13).

    flock /tmp/kvl-cpu.lock .venv/bin/python bench/peers.py [--reps 5] [--quick] [--ours-only]
        [--workloads salted,chat,resolver,memory,floors] [--mem-sizes 100000,1000000] [--json F]

Set-up. `ai-dynamo-runtime==1.6.1` is installed on first use into `.venv-peers/dynamo`
(`peer_routers.ensure_installed`: about 9 s, 270 MB; its marker is written last, a half-made venv
is redone). Dynamo's indexer binds its HTTP port on 0.0.0.0 and has no host option, so the
script re-executes itself inside a private network namespace that has only loopback (`unshare
-rn sh -c 'ip link set lo up && exec python bench/peers.py --inside ...'`); the publisher, both
consumers and every HTTP client run in there, on 127.0.0.1. Without `unshare -rn` it says so and
exits 2, except with `--ours-only` (nothing binds beyond 127.0.0.1 then), which runs in place.

Consumers (`peers_consumers.py`): `python -m dynamo.indexer --threads 1` (one indexer thread, the
reference figures' set-up; `--dynamo-threads`) and `python -m kv_listener --config FILE` with one
vLLM source and one SSE client on `/events/vllm-1` (the daemon's output is part of its work). Each
SUB connects to a bound `SimPublisher` (an XPUB, so the bench awaits the subscription).

Fairness: one consumer at a time, a fresh process and a fresh publisher per repetition, the same
pre-encoded frames (`peers_workloads.py`, built once per run) byte for byte; repetitions
interleave (Dynamo then ours on even repetitions, ours then Dynamo on odd ones), so drift of the
shared machine hits both alike. Feeding both from one PUB at once was rejected: on 2 cores the
two consumers and the publisher would fight for CPU and each figure would depend on the other.
A phase is published in one burst (the publisher's high-water mark of 100,000 messages and our
source's queue of 10,000 batches / 4 Mi tokens / 256 Ki block hashes hold a whole phase: nothing
drops, which the checks confirm), so each consumer always has a backlog and the figure is its
capacity. A phase
beyond our queue (`--timed 600000`: 12,000 frames, 9.6 M token IDs) makes the daemon drop and
clear, as it should; the run then stops at once with exit 1 and says so (`!! rep N ours: ...`)
instead of waiting for a block that cannot come:

- blocks/s: timed blocks / (first frame published -> the consumer applied the last one). Applied
  = the phase's marker block is there (Dynamo: `POST /query` with its tokens every 5 ms, the
  midpoint of the last miss and the first hit; ours: its `cache_created` on the SSE stream).
  The resolver path also waits until `/stats` shows no chain waiting for `/detokenize`.
- CPU ms per 1,000 blocks: utime + stime of the consumer's process tree (/proc, every thread,
  10 ms ticks) over the same window. Dynamo's figure includes its barrier queries (~0.14 ms
  each, 20-100 per phase).
- RSS: VmRSS of the consumer at the end of the timed phase.
- bytes per tracked block: (VmRSS with N live blocks - VmRSS idle, after start) / N at each of
  `--mem-sizes`, salted chains without eviction published in chunks of 5,000 blocks (no backlog
  inflates the heap), once with single-block chains (every block a prefix of its own: the
  worst case for both) and once with chains of 16 blocks (`--mem-chains 1,16`); ours runs
  without an SSE client there. Dynamo's barrier is its /query, ours `/stats` `blocks_tracked`.

Workloads: (1) salted single-block chains, 50 per frame, 20,000 live (warm-up), 60,000 timed
with the oldest evicted; (2) chat: 64 shared system prompts, multi-turn conversations, an LRU
pool of 20,000 blocks evicting leaf-first, 60,000 blocks timed after the first eviction (blocks/s
counts stored blocks; these frames also carry one `BlockRemoved` per evicted block, as vLLM
sends them, and about 5 stored blocks per `BlockStored`); (3) the
resolver path: the same chat frames without `cache_salt`, so our daemon asks `/detokenize`
(`sim.detokenize_server.DetokenizeServer` with the demo tokenizer, in the bench process, as the
demo's engines serve it). Dynamo has no such path (it indexes token hashes and needs no prefix
key): ours alone. In-process floors on workload (1)'s timed frames: `msgpack.unpackb`,
`msgspec.msgpack.decode` (untyped), `decode_zmq_payload`, decode + `Tracker.apply`.

Time: the defaults took 287 s here (2026-12-01), half of it the memory fills (our daemon takes
about 24 s for 1,000,000 single-block chains: `--mem-sizes 100000` or `--mem-reps 1` shorten it;
the bench process holds about 0.9 GiB of frames then); `--quick` takes about 10 s. Our daemon runs
from the working tree, whose state is printed (`this project at <commit> + N changed files`).
The machine is shared: the figures are what this run saw.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgpack
import peer_routers as pr
from decode import rate
from peers_consumers import Dynamo, Ours, StreamEnded
from peers_workloads import (
    BACKEND,
    MODEL,
    SECRET,
    MemoryChunk,
    Stream,
    chat_streams,
    memory_chunks,
    salted_chains,
)
from quiet import quiet_libraries

from kv_listener.core.decode import DecodedBatch, decode_zmq_payload
from kv_listener.core.limits import Limits
from kv_listener.core.model import Engine
from kv_listener.core.salt import SaltVerifier
from kv_listener.core.tracker import Tracker
from kv_listener.sim.publisher import SimPublisher

DYNAMO = pr.PeerSpec("dynamo", "ai-dynamo-runtime==1.6.1", "ai_dynamo_runtime", "1.6.1", "python",
                     (), ())
pr.PEERS.setdefault("dynamo", DYNAMO)  # so that ensure_installed knows it (no router policies)
WORKLOADS = ("salted", "chat", "resolver", "memory", "floors")
FIGURES = {"blocks_per_s": ("blocks/s", "{:,.0f}"),
           "cpu_ms_per_1k": ("CPU ms per 1,000 blocks", "{:.1f}"),
           "rss_mib": ("RSS MiB at the end", "{:.1f}")}


# --- figures -------------------------------------------------------------------------------------


def summary(values: Sequence[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "values": list(values)}


def cell(s: dict[str, Any] | None, fmt: str) -> str:
    if s is None:
        return "-"
    return f"{fmt.format(s['median'])} ({fmt.format(s['min'])}-{fmt.format(s['max'])})"


def print_table(rows: list[tuple[str, dict[str, Any] | None, dict[str, Any] | None, str]],
                dynamo_label: str) -> None:
    print(f"  {'':<34}{dynamo_label:>30}{'ours':>30}{'ours/Dynamo':>13}")
    for label, dyn, ours, fmt in rows:
        ratio = (f"{ours['median'] / dyn['median']:.2f}" if dyn and ours and dyn["median"]
                 else "-")
        print(f"  {label:<34}{cell(dyn, fmt):>30}{cell(ours, fmt):>30}{ratio:>13}")


def tree_state() -> str:
    """The commit under test and how many files of kv_listener/ differ from it: our daemon runs
    from the working tree, so its figures belong to that state."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--",
                                "kv_listener"], capture_output=True, text=True, timeout=10,
                               check=True).stdout.splitlines()
    except (OSError, subprocess.SubprocessError) as e:
        return f"unknown ({type(e).__name__})"
    return f"{head}" + (f" + {len(dirty)} changed files in kv_listener/" if dirty else "")


def order(rep: int, kinds: Sequence[str]) -> list[str]:
    return list(kinds) if rep % 2 == 0 else list(reversed(kinds))


# --- one repetition ------------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace, install: pr.PeerInstall | None,
                 work: Path) -> None:
        self.args = args
        self.install = install
        self.work = work
        self.detokenize_url: str | None = None
        self.chunks: list[MemoryChunk] = []  # the memory stream, built when its run starts
        self._n = 0

    def consumer(self, kind: str, endpoint: str, *, sse: bool = True, max_blocks: int = 100_000,
                 detokenize: bool = False) -> Dynamo | Ours:
        if kind == "dynamo":
            assert self.install is not None
            return Dynamo(self.install, endpoint, threads=self.args.dynamo_threads,
                          poll_s=self.args.poll_ms / 1000)
        self._n += 1
        work = self.work / f"ours-{self._n}"
        work.mkdir()
        return Ours(endpoint, work, sse=sse, max_blocks=max_blocks,
                    detokenize_url=self.detokenize_url if detokenize else None,
                    poll_s=self.args.poll_ms / 1000)

    async def throughput(self, kind: str, stream: Stream) -> dict[str, Any]:
        async with SimPublisher("tcp://127.0.0.1:0", mode="bind") as pub, \
                self.consumer(kind, pub.endpoint, detokenize=not stream.salted) as c:
            await pub.wait_for_subscriber(timeout_s=30)
            assert stream.warmup.marker is not None and stream.timed.marker is not None
            c.expect(stream.warmup.marker)
            for f in stream.warmup.frames:
                pub.publish(f)
            await c.applied()
            if isinstance(c, Ours) and not stream.salted:
                await c.settled()
            c.expect(stream.timed.marker)
            cpu0, t0 = c.cpu_s(), time.perf_counter()
            for f in stream.timed.frames:
                pub.publish(f)
            t1 = await c.applied()
            if isinstance(c, Ours) and not stream.salted:
                t1 = await c.settled()
            cpu1 = c.cpu_s()
            rss = c.rss_bytes()
            checks = await c.checks()
        blocks = stream.timed.blocks
        return {"blocks_per_s": blocks / (t1 - t0), "cpu_ms_per_1k": (cpu1 - cpu0) * 1e6 / blocks,
                "rss_mib": rss / 2**20, "drain_s": t1 - t0, "checks": checks}

    async def memory(self, kind: str, sizes: Sequence[int]) -> dict[str, Any]:
        chunks = self.chunks
        out: dict[str, Any] = {}
        async with SimPublisher("tcp://127.0.0.1:0", mode="bind") as pub, \
                self.consumer(kind, pub.endpoint, sse=False, max_blocks=max(sizes) + 1) as c:
            await pub.wait_for_subscriber(timeout_s=30)
            await asyncio.sleep(0.5)  # start-up work done
            idle = c.rss_bytes()
            t0 = time.perf_counter()
            for ch in chunks:
                for f in ch.frames:
                    pub.publish(f)
                await c.applied_blocks(ch.total_blocks, ch.marker)
                if ch.total_blocks in sizes:
                    out[str(ch.total_blocks)] = (c.rss_bytes() - idle) / ch.total_blocks
            fill_s = time.perf_counter() - t0
            checks = await c.checks()
        return {"idle_rss_mib": idle / 2**20, "bytes_per_block": out, "fill_s": fill_s,
                "checks": checks}


# --- the runs ------------------------------------------------------------------------------------


def check_line(kind: str, checks: list[dict[str, Any]], stored_events: int) -> str:
    """What the consumer's own counters say, and `!!` where something was lost (Dynamo: fewer
    BlockStored applied than published, or any status but ok)."""
    if kind == "dynamo":
        last = checks[-1]["events_applied"]
        failed = {k: v for c in checks for k, v in c["events_applied"].items()
                  if not k.endswith(":ok")}
        lost = [n for c in checks if (n := c["events_applied"].get("stored:ok", 0)) != stored_events]
        note = f" !! stored:ok {lost} of {stored_events:,} published" if lost else ""
        note += " !! events not applied" if failed else ""
        return (f"Dynamo (last rep) events applied {last}; not ok over all reps: "
                f"{failed or 'none'}; barrier queries per rep {[c['queries'] for c in checks]}{note}")
    gaps = sum(c["gaps"] for c in checks)
    drops: dict[str, int] = {}
    for c in checks:
        for k, v in c["events_dropped"].items():
            drops[k] = drops.get(k, 0) + v
    overflow = any(c["buffer_overflow"] for c in checks)
    end = checks[-1]
    bad = gaps or drops or overflow or any(c["clears"] or c["salt_rejected"] for c in checks)
    return (f"ours (all reps) gaps {gaps}, events_dropped {drops or 0}, buffer_overflow "
            f"{'yes' if overflow else 'no'}, clears {sum(c['clears'] for c in checks)}, "
            f"salt_rejected {sum(c['salt_rejected'] for c in checks)}; last rep: "
            f"detokenize_calls {end['detokenize_calls']:,} (errors {end['detokenize_errors']}), "
            f"pending {end['pending']}, unattributed {end['unattributed']}, "
            f"prefixes_live {end['prefixes_live']:,}" + (" !! something was lost" if bad else ""))


async def run_throughput(bench: Bench, stream: Stream, kinds: Sequence[str],
                         dynamo_label: str) -> dict[str, Any]:
    reps = bench.args.reps
    print(f"\n== {stream.title}: {reps} reps, interleaved ==")
    print(f"  frames: warm-up {stream.warmup.summary()}, timed {stream.timed.summary()}")
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
    for rep in range(reps):
        for kind in order(rep, kinds):
            try:
                r = await bench.throughput(kind, stream)
            except StreamEnded as e:
                raise BenchStopped(f"rep {rep + 1} {kind}: {e}") from None
            runs[kind].append(r)
            print(f"  rep {rep + 1} {kind:<7} {r['blocks_per_s']:>10,.0f} blocks/s "
                  f"{r['cpu_ms_per_1k']:>7.1f} CPU ms/1k {r['rss_mib']:>7.1f} MiB "
                  f"(drained in {r['drain_s']:.3f} s)", flush=True)
    out: dict[str, Any] = {"title": stream.title, "frames": {"warmup": stream.warmup.summary(),
                                                              "timed": stream.timed.summary()},
                           "info": stream.info, "runs": runs}
    figs: dict[str, dict[str, Any]] = {k: {f: summary([r[f] for r in runs[k]]) for f in FIGURES}
                                       for k in kinds}
    out["figures"] = figs
    out["ratios"] = ({f: figs["ours"][f]["median"] / figs["dynamo"][f]["median"] for f in FIGURES}
                     if "dynamo" in figs and "ours" in figs else {})
    print("  median (min-max):")
    print_table([(label, figs.get("dynamo", {}).get(f), figs.get("ours", {}).get(f), fmt)
                 for f, (label, fmt) in FIGURES.items()], dynamo_label)
    for kind in kinds:
        print("  " + check_line(kind, [r["checks"] for r in runs[kind]],
                                stream.warmup.stored_events + stream.timed.stored_events))
    if "dynamo" not in kinds:
        print("  (ours alone: Dynamo has no resolver path; it indexes token hashes and never needs "
              "a prefix key)" if not stream.salted else "  (ours alone: --ours-only)")
    return out


async def run_memory(bench: Bench, kinds: Sequence[str], dynamo_label: str,
                     chain_blocks: int) -> dict[str, Any]:
    args = bench.args
    sizes = args.mem_sizes
    reps = args.mem_reps or args.reps
    shape = ("single-block chains (every block a prefix)" if chain_blocks == 1
             else f"chains of {chain_blocks} blocks")
    print(f"\n== memory: salted {shape} without eviction, chunks of {args.mem_chunk:,} blocks, "
          f"RSS over idle at {', '.join(f'{s:,}' for s in sizes)} blocks: {reps} reps, "
          "interleaved ==")
    t = time.perf_counter()
    bench.chunks = memory_chunks(max(sizes), args.mem_chunk, chain_blocks)
    print(f"  {sum(len(c.frames) for c in bench.chunks):,} frames built in "
          f"{time.perf_counter() - t:.1f} s", flush=True)
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
    for rep in range(reps):
        for kind in order(rep, kinds):
            r = await bench.memory(kind, sizes)
            runs[kind].append(r)
            per = ", ".join(f"{int(n):,}: {b:.0f} B" for n, b in r["bytes_per_block"].items())
            print(f"  rep {rep + 1} {kind:<7} idle {r['idle_rss_mib']:.1f} MiB, per block {per} "
                  f"(filled in {r['fill_s']:.1f} s)", flush=True)
    figs: dict[str, dict[str, Any]] = {}
    for k in kinds:
        figs[k] = {"idle_rss_mib": summary([r["idle_rss_mib"] for r in runs[k]])}
        for n in sizes:
            figs[k][f"bytes_per_block_{n}"] = summary([r["bytes_per_block"][str(n)] for r in runs[k]])
    rows: list[tuple[str, dict[str, Any] | None, dict[str, Any] | None, str]] = [
        ("idle RSS MiB", figs.get("dynamo", {}).get("idle_rss_mib"),
         figs.get("ours", {}).get("idle_rss_mib"), "{:.1f}")]
    rows += [(f"bytes per tracked block @{n:,}", figs.get("dynamo", {}).get(f"bytes_per_block_{n}"),
              figs.get("ours", {}).get(f"bytes_per_block_{n}"), "{:.0f}") for n in sizes]
    print("  median (min-max):")
    print_table(rows, dynamo_label)
    for kind in kinds:
        print("  " + check_line(kind, [r["checks"] for r in runs[kind]],
                                bench.chunks[-1].stored_events))
    bench.chunks = []
    return {"chain_blocks": chain_blocks, "sizes": sizes, "chunk_blocks": args.mem_chunk,
            "runs": runs, "figures": figs,
            "ratios": {f: figs["ours"][f]["median"] / figs["dynamo"][f]["median"]
                       for f in figs.get("ours", {}) if "dynamo" in figs}}


def run_floors(stream: Stream, seconds: float, reps: int) -> dict[str, Any]:
    frames = stream.timed.frames
    per_frame = stream.timed.blocks / len(frames)
    print(f"\n== in-process floors, {stream.title} (timed frames, {per_frame:.0f} stored blocks "
          f"per frame, {seconds:g} s per figure) ==")
    out: dict[str, Any] = {}

    def vllm(p: bytes) -> DecodedBatch:
        return decode_zmq_payload(Engine.VLLM, p)

    cases: list[tuple[str, Callable[[bytes], object]]] = [("msgpack.unpackb", msgpack.unpackb)]
    try:
        import msgspec  # noqa: PLC0415 - optional: the figure is skipped without it

        cases.append(("msgspec.msgpack.decode (untyped)", msgspec.msgpack.decode))
    except ImportError:
        print("  msgspec is not installed: its line is skipped")
    cases.append(("decode_zmq_payload", vllm))
    for name, fn in cases:
        out[name] = rate(fn, frames, round(per_frame), seconds)

    verify = SaltVerifier(SECRET, BACKEND)  # as the daemon verifies
    times = []
    for _ in range(reps):
        tracker = Tracker(engine=Engine.VLLM, model=MODEL, limits=Limits(), salt_verifier=verify)
        for f in stream.warmup.frames:
            tracker.apply(vllm(f).batch)
        t0 = time.perf_counter()
        for f in frames:
            tracker.apply(vllm(f).batch)
        times.append(time.perf_counter() - t0)
    out["decode + Tracker.apply"] = stream.timed.blocks / statistics.median(times)
    base = out["msgpack.unpackb"]
    for name, v in out.items():
        print(f"  {name:<36}{v:>14,.0f} blocks/s{v / base:>8.2f}x msgpack.unpackb")
    return out


class BenchStopped(Exception):
    """A run that cannot give a figure (what it waits for cannot come): said, exit 1."""


async def run_workloads(bench: Bench, chosen: set[str], streams: dict[str, Stream],
                        kinds: Sequence[str], dynamo_label: str, doc: dict[str, Any],
                        tokenizer: Any) -> None:
    for name in ("salted", "chat"):
        if name in chosen:
            doc[name] = await run_throughput(bench, streams[name], kinds, dynamo_label)
    if "resolver" in chosen:
        from kv_listener.resolver.template import DEMO_TOKENIZER_DIR  # noqa: PLC0415
        from kv_listener.sim.detokenize_server import (  # noqa: PLC0415
            DetokenizeServer,
            tokenizer_info,
        )

        async with DetokenizeServer(tokenizer, info=tokenizer_info(DEMO_TOKENIZER_DIR)) as srv:
            bench.detokenize_url = srv.url
            doc["resolver"] = await run_throughput(bench, streams["resolver"], ["ours"],
                                                   dynamo_label)
            doc["resolver"]["detokenize_answered"] = srv.answered
    if "memory" in chosen:
        doc["memory"] = {str(n): await run_memory(bench, kinds, dynamo_label, n)
                         for n in bench.args.mem_chains}


async def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    install: pr.PeerInstall | None = None
    kinds = ["ours"]
    if not args.ours_only:
        got = pr.ensure_installed("dynamo")
        if isinstance(got, str):
            print(f"Dynamo unavailable: {got}")
            return 1
        install = got
        kinds = ["dynamo", "ours"]
    dynamo_label = f"Dynamo {DYNAMO.version} ({args.dynamo_threads} thr)"
    print(f"{platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}, "
          f"CPython {platform.python_version()}; "
          f"{'private network namespace' if args.inside else 'host network (no namespace)'}; "
          f"consumers: {', '.join(kinds)}; vLLM 0.33 map frames")
    tree = await asyncio.to_thread(tree_state)
    print(f"this project at {tree}")
    if install is not None:
        print(f"Dynamo: {' '.join(Dynamo(install, 'tcp://127.0.0.1:0').command())}")
    doc: dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if k != "json"},
                           "tree": tree,
                           "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                       "load_average": os.getloadavg()[0]}}
    chosen = set(args.workloads)
    t = time.perf_counter()
    salted = salted_chains(args.live, args.timed, args.per_frame)
    streams: dict[str, Stream] = {"salted": salted}
    tokenizer: Any = None
    if chosen & {"chat", "resolver"}:
        from kv_listener.resolver.template import DEMO_TOKENIZER_DIR, load_tokenizer  # noqa: PLC0415

        tokenizer = load_tokenizer(DEMO_TOKENIZER_DIR)
        streams["chat"], streams["resolver"] = chat_streams(
            tokenizer, pool_blocks=args.chat_pool, timed=args.chat_timed, prompts=args.prompts)
    print(f"frames built in {time.perf_counter() - t:.1f} s", flush=True)
    with tempfile.TemporaryDirectory(prefix="kv-peers-bench-") as tmp:
        try:
            await run_workloads(Bench(args, install, Path(tmp)), chosen, streams, kinds,
                                dynamo_label, doc, tokenizer)
        except BenchStopped as e:
            print(f"  !! {e}", flush=True)
            return 1
    if "floors" in chosen:
        doc["floors"] = run_floors(salted, args.floor_seconds, args.reps)
    elapsed = time.perf_counter() - started
    doc["elapsed_s"] = elapsed
    print(f"\ntotal {elapsed:.0f} s")
    if args.json:
        await asyncio.to_thread(Path(args.json).write_text, json.dumps(doc, indent=1))
        print(f"figures written to {args.json}")
    return 0


# --- the network namespace -----------------------------------------------------------------------


def netns_problem() -> str | None:
    """None when `unshare -rn` gives a namespace whose loopback comes up, else why not."""
    try:
        proc = subprocess.run(["unshare", "-rn", "sh", "-c", "ip link set lo up"],
                              capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare -rn could not run: {e}"
    if proc.returncode != 0:
        return f"unshare -rn failed (exit {proc.returncode}): {proc.stderr.strip()[:200]}"
    return None


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=None, help="repetitions per figure (5)")
    ap.add_argument("--quick", action="store_true", help="small streams, 2 reps: a smoke run")
    ap.add_argument("--ours-only", action="store_true", help="skip Dynamo (no install)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS),
                    help=f"comma-separated, of {','.join(WORKLOADS)}")
    ap.add_argument("--live", type=int, default=None, help="salted chains live (20,000)")
    ap.add_argument("--timed", type=int, default=None, help="salted blocks timed (60,000)")
    ap.add_argument("--per-frame", type=int, default=50, help="salted blocks per frame")
    ap.add_argument("--chat-pool", type=int, default=None, help="chat engine pool blocks (20,000)")
    ap.add_argument("--chat-timed", type=int, default=None, help="chat blocks timed (60,000)")
    ap.add_argument("--prompts", type=int, default=64, help="chat system prompts")
    ap.add_argument("--mem-sizes", default=None, help="live blocks to read RSS at (100000,1000000)")
    ap.add_argument("--mem-chains", default="1,16",
                    help="memory: blocks per chain, one fill per value (1,16)")
    ap.add_argument("--mem-chunk", type=int, default=5000, help="memory fill: blocks per chunk")
    ap.add_argument("--mem-reps", type=int, default=None, help="memory repetitions (--reps)")
    ap.add_argument("--floor-seconds", type=float, default=None, help="per floor figure (1.0)")
    ap.add_argument("--dynamo-threads", type=int, default=1, help="dynamo.indexer --threads")
    ap.add_argument("--poll-ms", type=float, default=5.0, help="barrier polling interval")
    ap.add_argument("--json", help="write every figure to this file")
    ap.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    quick = args.quick
    for name, full, small in (("reps", 5, 2), ("live", 20_000, 2_000), ("timed", 60_000, 6_000),
                              ("chat_pool", 20_000, 2_000), ("chat_timed", 60_000, 6_000),
                              ("floor_seconds", 1.0, 0.2),
                              ("mem_sizes", "100000,1000000", "10000,30000")):
        if getattr(args, name) is None:
            setattr(args, name, small if quick else full)
    args.mem_sizes = sorted({int(s) for s in str(args.mem_sizes).split(",")})
    args.mem_chains = sorted({int(s) for s in str(args.mem_chains).split(",")})
    if quick and args.mem_chunk == 5000:
        args.mem_chunk = 2000
    bad = [s for s in args.mem_sizes if s % args.mem_chunk]
    if bad:
        ap.error(f"--mem-sizes {bad} are not multiples of --mem-chunk {args.mem_chunk}")
    args.workloads = [w for w in args.workloads.split(",") if w]
    unknown = set(args.workloads) - set(WORKLOADS)
    if unknown:
        ap.error(f"unknown workloads {sorted(unknown)} (known: {', '.join(WORKLOADS)})")
    return args


def main() -> int:
    args = parse()
    if args.inside:
        return asyncio.run(run(args))
    problem = netns_problem()
    if problem is not None:
        if not args.ours_only:
            print(f"{problem}: Dynamo's indexer binds 0.0.0.0, so it runs only in a private "
                  "network namespace; use --ours-only to measure this project alone", file=sys.stderr)
            return 2
        print(f"note: {problem}; ours only, on the host's 127.0.0.1")
        return asyncio.run(run(args))
    if not args.ours_only:
        got = pr.ensure_installed("dynamo")  # out here: the namespace has no network
        if isinstance(got, str):
            print(f"cannot install Dynamo: {got}", file=sys.stderr)
            return 1
        print(f"Dynamo {got.version} in {got.venv} ({'reused' if got.reused else 'installed'}, "
              f"{got.install_s:.1f} s install, {got.size_bytes / 2**20:.0f} MiB)", flush=True)
    cmd = ["unshare", "-rn", "sh", "-c", 'ip link set lo up && exec "$0" "$@"', sys.executable,
           str(Path(__file__).resolve()), "--inside", *sys.argv[1:]]
    return subprocess.call(cmd)


if __name__ == "__main__":
    quiet_libraries()
    sys.exit(main())
