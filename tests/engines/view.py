"""The router's side of the real-engine tests: a consumer of the listener's `GET /events/{backend}`
that folds the records (resync snapshot, then live ones) into the state a KV index would hold,
prefix_hash -> (token_count, tier), and the convergence check against `EngineTruth`.

"Converged" means: every chat response has returned, then neither the engine (as the tap saw it)
nor the listener's stream has said anything for `QUIET_S`; the listener's view must then equal
the oracle's exactly (no missing key, no extra key, same token_count and tier). Every wait is
bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kv_listener.core.sse import SseParser
from tests.engines.oracle import EngineTruth
from tests.engines.tap import ZmqTap

#: Longer than the listener's token_count coalescing (250 ms) and its detokenize round trips.
QUIET_S = 1.0


@dataclass(frozen=True, slots=True)
class Seen:
    at: float  # time.monotonic()
    event: str
    data: dict[str, Any]


@dataclass(repr=False)
class StreamView:
    """One backend's stream, consumed in a background task for as long as the test module runs."""

    base: str
    backend: str
    state: dict[str, tuple[int, str]] = field(default_factory=dict)
    records: list[Seen] = field(default_factory=list)
    last_at: float = 0.0
    error: BaseException | None = None
    connected: asyncio.Event = field(default_factory=asyncio.Event)
    _task: asyncio.Task[None] | None = None

    def start(self, session: aiohttp.ClientSession) -> None:
        self._task = asyncio.create_task(self._run(session), name=f"sse {self.backend}")

    async def _run(self, session: aiohttp.ClientSession) -> None:
        parser = SseParser()
        try:
            async with session.get(f"{self.base}/events/{self.backend}",
                                   headers={"Accept": "text/event-stream"},
                                   timeout=aiohttp.ClientTimeout(total=None)) as resp:
                assert resp.status == 200, f"GET /events/{self.backend}: {resp.status}"
                self.connected.set()
                while True:
                    chunk = await resp.content.readany()
                    if not chunk:
                        raise EOFError(f"the listener ended the stream of {self.backend}")
                    for ev in parser.feed(chunk):
                        self._apply(ev.event, json.loads(ev.data))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self.error = exc
            self.connected.set()

    def _apply(self, event: str, data: dict[str, Any]) -> None:
        now = time.monotonic()
        self.records.append(Seen(now, event, data))
        self.last_at = now
        assert data.get("backend") == self.backend, data
        if event == "cache_cleared":
            self.state.clear()
        elif event in ("cache_created", "cache_offloaded"):
            self.state[data["prefix_hash"]] = (data["token_count"], data["tier"])
        elif event == "cache_evicted":
            self.state.pop(data["prefix_hash"], None)

    def check(self) -> None:
        if self.error is not None:
            raise AssertionError(f"stream of {self.backend} failed: {self.error!r}")

    def mark(self) -> int:
        return len(self.records)

    def since(self, mark: int, *events: str) -> list[Seen]:
        return [r for r in self.records[mark:] if not events or r.event in events]

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task


async def wait_quiet(views: Iterable[StreamView], taps: Iterable[ZmqTap], *,
                     quiet_s: float = QUIET_S, timeout_s: float = 30.0) -> None:
    """Until neither the engines nor the listener streams said anything for `quiet_s`."""
    views, taps = list(views), list(taps)
    deadline = time.monotonic() + timeout_s
    while True:
        for v in views:
            v.check()
        for t in taps:
            t.check()
        latest = max([v.last_at for v in views] + [t.last_at() for t in taps] + [0.0])
        now = time.monotonic()
        if now - latest >= quiet_s:
            return
        if now >= deadline:
            raise AssertionError(f"engines/listener never went quiet for {quiet_s} s "
                                 f"within {timeout_s} s")
        await asyncio.sleep(min(quiet_s - (now - latest), deadline - now) + 0.01)


def diff(view: dict[str, tuple[int, str]], truth: dict[str, tuple[int, str]],
         note: Callable[[str], str] = lambda _k: "") -> list[str]:
    """Human-readable differences (prefix hashes only: no tokens, no salts); `note(prefix_hash)`
    adds what is known of a key (which request sent it, what the engine did with it)."""
    out = []

    def with_note(line: str, k: str) -> str:
        extra = note(k)
        return f"{line} [{extra}]" if extra else line

    for k in sorted(truth.keys() - view.keys()):
        out.append(with_note(f"missing {k[:16]} (engine holds it: token_count={truth[k][0]}, "
                             f"{truth[k][1]})", k))
    for k in sorted(view.keys() - truth.keys()):
        out.append(with_note(f"extra {k[:16]} (listener: token_count={view[k][0]}, {view[k][1]}; "
                             f"engine holds no block of it)", k))
    for k in sorted(view.keys() & truth.keys()):
        if view[k] != truth[k]:
            out.append(with_note(f"differs {k[:16]}: listener {view[k]}, engine {truth[k]}", k))
    return out


@dataclass(repr=False)
class Backend:
    """One source of a listener: its engine's tap and oracle, and the listener's stream."""

    name: str
    tap: ZmqTap
    truth: EngineTruth
    views: list[StreamView]
    fed: int = 0  # tap messages already given to the oracle
    #: prefix_hash -> where it came from (e.g. the test that sent the request), for messages
    origin: dict[str, str] = field(default_factory=dict)

    def note(self, k: str) -> str:
        return "; ".join(x for x in (self.origin.get(k, ""), self.truth.note(k)) if x)

    def feed(self) -> None:
        msgs = self.tap.messages
        for m in msgs[self.fed:]:
            self.truth.feed_frames(m.frames)
        self.fed = len(msgs)


async def converge(pairs: Iterable[tuple[Backend, StreamView]], *,
                   timeout_s: float = 30.0) -> None:
    """Await quiescence, then assert every view equals its engine's truth. A view that differs
    at the first quiet moment gets until `timeout_s` to catch up (a slow detokenize round trip
    is not a bug; a listener that stays wrong is)."""
    pairs = list(pairs)
    views = list({id(v): v for _, v in pairs}.values())
    taps = list({id(b.tap): b.tap for b, _ in pairs}.values())
    deadline = time.monotonic() + timeout_s

    def latest() -> float:
        return max([v.last_at for v in views] + [t.last_at() for t in taps])

    while True:
        await wait_quiet(views, taps, timeout_s=max(1.0, deadline - time.monotonic()))
        problems: list[str] = []
        for b, _ in pairs:
            b.feed()
        for b, v in pairs:
            problems += [f"{b.name} @ {v.base}: {d}"
                         for d in diff(v.state, b.truth.expected(), b.note)]
        if not problems:
            return
        if time.monotonic() >= deadline:
            raise AssertionError("listener view != engine truth after quiescence:\n  "
                                 + "\n  ".join(problems))
        # Wait for the next thing to happen (bounded by the deadline), then look again.
        mark = latest()
        while time.monotonic() < deadline and latest() <= mark:
            await asyncio.sleep(0.1)
