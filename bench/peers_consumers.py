"""The two consumers of the peers benchmark (`bench/peers.py`), each a child process fed by a bound
`SimPublisher` whose frames it subscribes to itself, with the same small interface:

    async with Dynamo(install, endpoint, work) / Ours(endpoint, work, ...) as c:
        c.expect(marker); <publish>; t = await c.applied()   # perf_counter when it was applied
        c.cpu_s(), c.rss_bytes()                               # of its process tree, from /proc
        await c.checks()                                       # drops, errors, its own counters

- `Dynamo`: `python -m dynamo.indexer --port P --block-size 16 --workers 1=tcp://127.0.0.1:Z
  --threads T` from its own venv (`.venv-peers/dynamo`). It binds its HTTP port on 0.0.0.0 (no
  host option): run it only inside the private network namespace `bench/peers.py` makes. Ready
  when `GET /workers` answers; `applied()` polls `POST /query` with the marker's tokens every
  `poll_s` (the tree applies events on its own thread, in order) and returns the midpoint between
  the last answer without the marker and the first with it. Each query costs it about 0.14 ms
  of CPU here, counted in its figures (conservative for Dynamo). `checks()` reads its
  `dynamo_kvrouter_kv_cache_events_applied{event_type, status}` counters.
- `Ours`: the real daemon, `python -m kv_listener --config FILE` (`tests.support.daemon.Daemon`),
  one vLLM source whose SUB connects to the publisher. With `sse=True` one client reads
  `GET /events/vllm-1` (the daemon's output, as a router would) and `applied()` is the arrival of
  the marker's `cache_created` there (the bench scans bytes for the marker's prefix hash and
  for `buffer_overflow`, so its own CPU stays low); it raises `StreamEnded` at once when the
  marker cannot come any more (the stream ended, the daemon exited, or it cleared the backend
  meanwhile: a burst beyond its source queue). Without SSE (the memory runs), `applied()`
  polls `/stats` until `blocks_tracked` reaches a count. `settled()` polls `/stats` until no chain
  waits for `/detokenize` (the resolver path). `checks()` reads its `/stats`: gaps, drops, clears.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from peer_routers import PeerInstall, free_port, stop_process
from peers_workloads import BACKEND, BLOCK, MODEL, SECRET, Marker

from tests.support.daemon import Daemon

_CLK_TCK = os.sysconf("SC_CLK_TCK")
_APPLIED = re.compile(
    r'^dynamo_kvrouter_kv_cache_events_applied\{event_type="(\w+)",status="(\w+)"\} (\d+)', re.M)


def tree_pids(pid: int) -> list[int]:
    """`pid` and its descendants now (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of `pid`'s tree, its threads and reaped children included."""
    total = 0
    for p in tree_pids(pid):
        with contextlib.suppress(OSError):
            f = Path(f"/proc/{p}/stat").read_text().rpartition(")")[2].split()
            total += int(f[11]) + int(f[12]) + int(f[13]) + int(f[14])
    return total / _CLK_TCK


def rss_bytes(pid: int) -> int:
    """VmRSS of `pid`'s tree."""
    total = 0
    for p in tree_pids(pid):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
    return total


def zmq_tcp(endpoint: str) -> str:
    """tcp://127.0.0.1:P of a dual-stack SimPublisher's LAST_ENDPOINT (tcp://[::ffff:127.0.0.1]:P)."""
    return f"tcp://127.0.0.1:{endpoint.rpartition(':')[2]}"


class Dynamo:
    name = "dynamo"

    def __init__(self, install: PeerInstall, endpoint: str, *, threads: int = 1,
                 poll_s: float = 0.005) -> None:
        self.install = install
        self.endpoint = zmq_tcp(endpoint)
        self.threads = threads
        self.poll_s = poll_s
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc: asyncio.subprocess.Process | None = None
        self.http: aiohttp.ClientSession | None = None
        self.polls = 0  # /query requests sent by applied()
        self._marker: Marker | None = None
        self._log: Any = None  # its stdout and stderr, a temp file while it runs

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def command(self) -> list[str]:
        return [str(self.install.venv / "bin" / "python"), "-m", "dynamo.indexer",
                "--port", str(self.port), "--block-size", str(BLOCK),
                "--workers", f"1={self.endpoint}", "--threads", str(self.threads)]

    async def __aenter__(self) -> Dynamo:
        self._log = tempfile.TemporaryFile(prefix="dynamo-indexer-")  # noqa: SIM115 - closed in __aexit__
        cmd = self.command()
        argv = ["setpriv", "--pdeathsig", "KILL", "--", *cmd] if shutil.which("setpriv") else cmd
        env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
        env["NO_COLOR"] = "1"
        self.proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=self._log, stderr=self._log, env=env,
            start_new_session=True)
        self.http = aiohttp.ClientSession()
        try:
            await self._wait_ready()
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def _wait_ready(self, timeout_s: float = 30.0) -> None:
        assert self.http is not None and self.proc is not None
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.returncode is not None:
                raise RuntimeError(f"dynamo.indexer exited {self.proc.returncode}: {self.log_tail()}")
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with self.http.get(self.base + "/workers",
                                         timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200 and '"active"' in await r.text():
                        return
            if time.monotonic() > deadline:
                raise RuntimeError(f"dynamo.indexer not ready after {timeout_s:.0f} s: "
                                   f"{self.log_tail()}")
            await asyncio.sleep(0.05)

    def log_tail(self, n: int = 5) -> str:
        if self._log is None:
            return ""
        self._log.seek(0)
        text = self._log.read().decode(errors="replace")
        return " | ".join(re.sub(r"\x1b\[[0-9;]*m", "", ln) for ln in text.splitlines()[-n:])

    async def __aexit__(self, *exc: object) -> None:
        try:
            if self.proc is not None:
                await stop_process(self.proc, 10.0)
        finally:
            if self.http is not None:
                await self.http.close()
            if self._log is not None:
                self._log.close()

    def cpu_s(self) -> float:
        return cpu_s(self.pid)

    def rss_bytes(self) -> int:
        return rss_bytes(self.pid)

    def expect(self, marker: Marker) -> None:
        self._marker = marker

    async def has(self, marker: Marker) -> bool:
        assert self.http is not None
        self.polls += 1
        body = {"token_ids": list(marker.tokens), "model_name": "default"}
        async with self.http.post(self.base + "/query", json=body) as r:
            r.raise_for_status()
            scores = (await r.json()).get("scores") or {}
        return bool(scores.get("1"))

    async def applied(self, timeout_s: float = 300.0) -> float:
        marker = self._marker
        assert marker is not None
        last_miss = time.perf_counter()
        async with asyncio.timeout(timeout_s):
            while not await self.has(marker):
                last_miss = time.perf_counter()
                await asyncio.sleep(self.poll_s)
        return (last_miss + time.perf_counter()) / 2

    async def applied_blocks(self, _total: int, marker: Marker) -> None:
        self.expect(marker)
        await self.applied()

    async def checks(self) -> dict[str, Any]:
        assert self.http is not None
        async with self.http.get(self.base + "/metrics") as r:
            text = await r.text()
        applied: dict[str, int] = {}
        for kind, status, n in _APPLIED.findall(text):
            if int(n):
                applied[f"{kind}:{status}"] = int(n)
        return {"events_applied": applied, "queries": self.polls}


_CLEARED = b"event: cache_cleared"


def exit_code(proc: subprocess.Popen[str], wait_s: float) -> int | None:
    """`proc`'s exit code, waiting up to `wait_s` for it; None if it still runs."""
    try:
        return proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        return None


class StreamEnded(RuntimeError):
    """Our daemon's SSE stream ended before the record a run waits for."""


class Ours:
    name = "ours"

    def __init__(self, endpoint: str, work: Path, *, sse: bool = True, max_blocks: int = 100_000,
                 detokenize_url: str | None = None, poll_s: float = 0.005) -> None:
        self.endpoint = zmq_tcp(endpoint)
        self.work = work
        self.sse = sse
        self.poll_s = poll_s
        secret = work / "salt.secret"
        secret.write_bytes(SECRET + b"\n")
        source: dict[str, Any] = {"backend_name": BACKEND, "engine": "vllm", "model": MODEL,
                                  "zmq_endpoint": self.endpoint, "zmq_mode": "connect"}
        if detokenize_url is not None:
            source["detokenize_endpoint"] = detokenize_url
        self.config = {
            "listen": f"127.0.0.1:{free_port()}", "log": {"level": "info"},
            "cache_salt": {"secret_file": str(secret)},
            # every record of a burst may wait for the client at once: no buffer_overflow
            "max_lag": 100_000,
            "limits": {"max_tracked_blocks": max(100_000, max_blocks)},
            "sources": [source]}
        self.daemon = Daemon(self.config, work)
        self.http: aiohttp.ClientSession | None = None
        self.records_bytes = 0
        self.overflow = False
        self._resp: aiohttp.ClientResponse | None = None
        self._reader: asyncio.Task[None] | None = None
        self._want: bytes | None = None
        self._seen_at: float | None = None
        self._seen = asyncio.Event()
        self._lost = asyncio.Event()
        self._clears = 0  # cache_cleared records read
        self._clears_before = 1

    @property
    def pid(self) -> int:
        assert self.daemon.proc is not None
        return self.daemon.proc.pid

    async def __aenter__(self) -> Ours:
        self.http = aiohttp.ClientSession()
        try:
            await self.daemon.start()
            if self.sse:
                self._resp = await self.http.get(f"{self.daemon.base}/events/{BACKEND}",
                                                 timeout=aiohttp.ClientTimeout(total=None))
                self._resp.raise_for_status()
                self._reader = asyncio.create_task(self._read())
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        if self._resp is not None:
            self._resp.close()
        try:
            await self.daemon.stop()
        finally:
            if self.http is not None:
                await self.http.close()

    async def _read(self) -> None:
        assert self._resp is not None
        tail = b""
        while True:
            chunk = await self._resp.content.readany()
            if not chunk:
                return
            now = time.perf_counter()
            self.records_bytes += len(chunk)
            buf = tail + chunk
            if self._want is not None and self._want in buf:
                self._want = None
                self._seen_at = now
                self._seen.set()
            if b"buffer_overflow" in buf:
                self.overflow = True
            self._clears += buf.count(_CLEARED) - tail.count(_CLEARED)
            if self._want is not None and self._clears > self._clears_before:
                self._lost.set()  # a clear while a phase is under way: its blocks are not all there
            tail = buf[-100:]

    def cpu_s(self) -> float:
        return cpu_s(self.pid)

    def rss_bytes(self) -> int:
        return rss_bytes(self.pid)

    def expect(self, marker: Marker) -> None:
        assert self.sse, "expect/applied need the SSE client"
        self._seen.clear()
        self._lost.clear()
        # the stream opens with a cache_cleared (the resync of a new client), maybe not read yet
        self._clears_before = max(self._clears, 1)
        self._seen_at = None
        self._want = marker.prefix_hash.encode()

    async def applied(self, timeout_s: float = 300.0) -> float:
        """When the marker's `cache_created` arrived. Raises `StreamEnded` as soon as it cannot
        come any more: the SSE stream ended (the daemon ended it with `buffer_overflow`, or
        exited), or the daemon cleared the backend meanwhile (its source queue overflowed and
        dropped batches); waiting out `timeout_s` would only hide why."""
        assert self._reader is not None
        seen = asyncio.ensure_future(self._seen.wait())
        lost = asyncio.ensure_future(self._lost.wait())
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.wait((seen, lost, self._reader), return_when=asyncio.FIRST_COMPLETED)
        finally:
            seen.cancel()
            lost.cancel()
        if self._seen_at is None:
            raise StreamEnded(await self._why_ended())
        return self._seen_at

    async def _why_ended(self) -> str:
        assert self._reader is not None and self.daemon.proc is not None
        if self._lost.is_set():
            return ("our daemon cleared the backend during the phase (cache_cleared): its source "
                    "queue overflowed and dropped batches. A burst this large outruns the queue "
                    "(10,000 batches or 4 Mi token IDs, never blocking the engine): use a "
                    "smaller --timed.")
        if self.overflow:
            return (f"our daemon ended its SSE stream with buffer_overflow: the client fell "
                    f"max_lag ({self.config['max_lag']:,}) records behind. A burst this large "
                    f"outruns what the daemon holds for one client: use a smaller --timed.")
        # a process killed closes its sockets before it can be reaped: give it a moment
        rc = await asyncio.to_thread(exit_code, self.daemon.proc, 2.0)
        if rc is not None:
            return f"our daemon exited (code {rc}) before the phase's last block was applied"
        error = None if self._reader.cancelled() else self._reader.exception()
        return ("our daemon's SSE stream ended before the phase's last block was applied"
                + (f" ({type(error).__name__}: {error})" if error is not None else ""))

    async def stats(self) -> dict[str, Any]:
        assert self.http is not None
        async with self.http.get(f"{self.daemon.base}/stats") as r:
            r.raise_for_status()
            source: dict[str, Any] = (await r.json())["sources"][BACKEND]
        return source

    async def _poll(self, done: Any, timeout_s: float) -> float:
        last_miss = time.perf_counter()
        deadline = last_miss + timeout_s
        while not done(stats := await self.stats()):
            last_miss = time.perf_counter()
            if last_miss > deadline:
                raise TimeoutError(f"our daemon did not get there in {timeout_s:.0f} s: {stats}")
            await asyncio.sleep(self.poll_s)
        return (last_miss + time.perf_counter()) / 2

    async def applied_blocks(self, total: int, _marker: Marker, timeout_s: float = 300.0) -> float:
        """Poll /stats until `blocks_tracked` >= `total` (a stream without eviction)."""
        return await self._poll(lambda s: s["blocks_tracked"] >= total, timeout_s)

    async def settled(self, timeout_s: float = 60.0) -> float:
        """Poll /stats until no `/detokenize` call is in flight and nothing is queued (a chain may
        stay pending without a call: its tokens do not decide a key yet, more blocks will)."""
        return await self._poll(
            lambda s: s["tracker"]["inflight"] == 0 and s["queue_depth"] == 0, timeout_s)

    async def checks(self) -> dict[str, Any]:
        s = await self.stats()
        t = s.get("tracker", {})
        return {"gaps": s["gaps"], "events_dropped": s["events_dropped"], "clears": s["clears"],
                "salt_rejected": s["salt_rejected"], "buffer_overflow": self.overflow,
                "events_decoded": s["events_decoded"], "blocks_tracked": s["blocks_tracked"],
                "prefixes_live": s["prefixes_live"], "detokenize_calls": s["detokenize_calls"],
                "detokenize_errors": s["detokenize_errors"], "pending": t.get("pending"),
                "unattributed": t.get("unattributed"), "removed_unknown": t.get("removed_unknown"),
                "pruned": t.get("pruned")}
