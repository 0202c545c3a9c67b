"""A stand-in engine that publishes KV-cache event batches exactly as vLLM does on the wire.

Owns the engine side of the ZMQ transport for tests, the e2e benchmark and the demo. It mirrors
vLLM's `ZmqEventPublisher` (`vllm/distributed/kv_events.py`, 0.9.0 .. 0.33.0; wire-formats §2.1,
§2.2, §7.1, §7.5); SGLang's publisher is a near-copy of it:

- frames `[topic, seq (8 bytes big-endian), payload]`; seq starts at 0 and grows by one per batch;
- a bounded in-memory replay buffer of `buffer_steps` batches (oldest evicted first), served by a
  bound ROUTER: a request must be exactly `[client_id, b"", start_seq]` (anything else is ignored,
  as vLLM logs "Invalid replay request" and ignores it); the answer is every buffered batch with
  `seq >= start_seq`, oldest first, then the end marker `ff`x8 with an empty payload. Layout
  `"no_topic"` is vLLM <= 0.25 / SGLang <= 0.5.21 (`[b"", seq, payload]`), `"topic"` is vLLM >= 0.26
  / SGLang >= 0.5.22 (`[b"", topic, seq, payload]`, end marker `[b"", b"", END, b""]`);
- replay is served between publishes, never interleaved with the live stream;
- an engine restart loses the buffer and starts the sequence at 0 again.

One local difference, invisible on the wire: the live socket is an XPUB instead of a PUB, so that a
test can await `wait_for_subscriber()` (the subscription reaching the publisher) instead of
sleeping through ZMQ's "slow joiner" window. Subscribers see a PUB.

Loss can be simulated: `drop_next(n)` publishes the next n batches into the replay buffer but not
on the wire (what a PUB high-water-mark drop looks like to a subscriber); `drop_next(n,
replayable=False)` also keeps them out of the buffer. `send_raw(frames)` sends arbitrary frames.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from typing import Literal, Self

import structlog
import zmq
import zmq.asyncio

from kv_listener.core.sequence import END_SEQ
from kv_listener.sim.lifecycle import AsyncLifecycle

log = structlog.get_logger(__name__)

ReplayLayout = Literal["topic", "no_topic"]


def vllm_binds(endpoint: str) -> bool:
    """vLLM's bind-or-connect heuristic for the PUB endpoint (wire-formats §2.1)."""
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith("ipc://")
        or endpoint.startswith("inproc://")
    )


def _send_now(sock: zmq.asyncio.Socket, frames: list[bytes]) -> None:
    """Non-blocking send through the asyncio socket (which keeps its edge-triggered FD state
    right); PUB and ROUTER drop rather than block, so the returned future is already done."""
    fut = sock.send_multipart(frames, flags=zmq.NOBLOCK)
    if isinstance(fut, asyncio.Future) and fut.done():
        fut.result()


class SimPublisher(AsyncLifecycle):
    """Engine-side publisher. Use as `async with SimPublisher(...) as pub:`.

    `mode` None applies vLLM's heuristic (`vllm_binds`); tests usually pass `"bind"` with
    `tcp://127.0.0.1:0` and read `endpoint` back, or `"connect"` to a listener that bound.
    The replay ROUTER always binds (as in vLLM).
    """

    def __init__(
        self,
        endpoint: str,
        *,
        mode: Literal["bind", "connect"] | None = None,
        replay_endpoint: str | None = None,
        replay_layout: ReplayLayout = "topic",
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
    ) -> None:
        if replay_layout not in ("topic", "no_topic"):
            raise ValueError(f"replay_layout must be 'topic' or 'no_topic', got {replay_layout!r}")
        if buffer_steps < 1:
            raise ValueError("buffer_steps must be >= 1")
        self._endpoint_cfg = endpoint
        self._bind = vllm_binds(endpoint) if mode is None else mode == "bind"
        self._replay_endpoint_cfg = replay_endpoint
        self.replay_layout: ReplayLayout = replay_layout
        self._topic = topic.encode("utf-8")
        self._hwm = hwm
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._next_seq = 0
        self._drop_left = 0
        self._drop_replayable = True
        #: When False, replay requests are read but never answered (a hung engine).
        self.replay_enabled = True
        #: Set: the next replay answer sends that many batches, then its end marker (vLLM
        #: 0.32's ROUTER drops what its queue toward the DEALER cannot take, and the small end
        #: marker can still get through after a dropped tail).
        self.cut_next_replay: int | None = None
        self.replay_requests: list[int] = []  # start_seq of every valid request, in order
        self.subscriptions: list[bytes] = []  # subscribe messages seen by the XPUB
        self._sub_event = asyncio.Event()
        self._replay_event = asyncio.Event()  # set on every replay request
        self._ctx: zmq.asyncio.Context | None = None
        self._pub: zmq.asyncio.Socket | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.endpoint: str = endpoint
        self.replay_endpoint: str | None = replay_endpoint

    # --- lifecycle ----------------------------------------------------------------------

    async def start(self) -> Self:
        ctx = zmq.asyncio.Context()
        self._ctx = ctx
        try:
            pub = ctx.socket(zmq.XPUB)
            self._pub = pub
            pub.linger = 0
            pub.ipv6 = True
            pub.sndhwm = self._hwm
            pub.setsockopt(zmq.XPUB_VERBOSE, 1)
            if self._bind:
                pub.bind(self._endpoint_cfg)
                self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                pub.connect(self._endpoint_cfg)
            self._tasks.append(asyncio.create_task(self._read_subscriptions(pub)))
            if self._replay_endpoint_cfg is not None:
                router = ctx.socket(zmq.ROUTER)
                self._router = router
                router.linger = 0
                router.ipv6 = True
                router.sndhwm = 2 * (self._buffer.maxlen or 1) + 2  # vLLM 0.33
                router.bind(self._replay_endpoint_cfg)
                self.replay_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
                self._tasks.append(asyncio.create_task(self._serve_replay(router)))
        except BaseException:
            await self.close()
            raise
        return self

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._router = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    # --- publishing ---------------------------------------------------------------------

    @property
    def next_seq(self) -> int:
        return self._next_seq

    @property
    def buffered_seqs(self) -> list[int]:
        return [seq for seq, _ in self._buffer]

    def publish(self, payload: bytes) -> int:
        """Publish one msgpack `EventBatch` payload; returns the seq it got. Never blocks: like
        a PUB at its high-water mark, a slow subscriber loses messages instead."""
        pub = self._require_pub()
        seq = self._next_seq
        self._next_seq += 1
        if self._drop_left > 0:
            self._drop_left -= 1
            if self._drop_replayable:
                self._buffer.append((seq, payload))
            return seq
        _send_now(pub, [self._topic, seq.to_bytes(8, "big"), payload])
        # vLLM appends to the replay buffer after sending.
        self._buffer.append((seq, payload))
        return seq

    def connect(self, endpoint: str) -> None:
        """Also connect the live socket to `endpoint` (a listener that bound its SUB), as a vLLM
        whose `endpoint` has no wildcard does. ZMQ sockets may bind and connect at once."""
        self._require_pub().connect(endpoint)

    def drop_next(self, n: int = 1, *, replayable: bool = True) -> None:
        """Lose the next `n` batches on the wire (they still take a seq). `replayable` keeps them
        in the replay buffer, as a high-water-mark drop does; False loses them for good."""
        self._drop_left = n
        self._drop_replayable = replayable

    def restart(self) -> None:
        """Simulate an engine restart: the sequence starts at 0 again and the buffer is lost."""
        self._next_seq = 0
        self._buffer.clear()
        self._drop_left = 0

    def send_raw(self, frames: list[bytes]) -> None:
        """Send arbitrary frames on the live socket (malformed-input tests)."""
        _send_now(self._require_pub(), frames)

    @property
    def subscribed(self) -> int:
        """Subscribe messages seen so far (a subscriber that connects again sends another)."""
        return sum(1 for s in self.subscriptions if s[:1] == b"\x01")

    async def wait_for_subscriber(self, count: int = 1, timeout_s: float = 5.0) -> None:
        """Wait until `count` subscriptions reached this publisher (so nothing published from
        now on is lost to ZMQ's slow-joiner window)."""
        await _wait_until(self._sub_event, lambda: self.subscribed >= count, timeout_s)

    async def wait_for_replay_requests(self, count: int = 1, timeout_s: float = 5.0) -> None:
        """Wait until `count` replay requests reached this publisher (each answered at once, from
        the buffer as it was then)."""
        await _wait_until(self._replay_event, lambda: len(self.replay_requests) >= count, timeout_s)

    def _require_pub(self) -> zmq.asyncio.Socket:
        if self._pub is None:
            raise RuntimeError("SimPublisher is not started")
        return self._pub

    # --- background tasks ---------------------------------------------------------------

    async def _read_subscriptions(self, pub: zmq.asyncio.Socket) -> None:
        while True:
            msg = await pub.recv()
            self.subscriptions.append(msg)
            self._sub_event.set()

    async def _serve_replay(self, router: zmq.asyncio.Socket) -> None:
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3:
                log.warning("sim_invalid_replay_request", frames=len(frames))
                continue
            client_id, _, start = frames
            start_seq = int.from_bytes(start, "big")
            self.replay_requests.append(start_seq)
            self._replay_event.set()
            if not self.replay_enabled:
                continue
            # Sent in one go, with no await in between: the live stream cannot interleave.
            left, self.cut_next_replay = self.cut_next_replay, None
            for seq, payload in self._buffer:
                if seq >= start_seq and (left is None or (left := left - 1) >= 0):
                    _send_now(router, self._reply(client_id, seq.to_bytes(8, "big"), payload))
            _send_now(router, self._reply(client_id, END_SEQ, b"", end=True))

    def _reply(self, client_id: bytes, seq: bytes, payload: bytes, *, end: bool = False) -> list[bytes]:
        if self.replay_layout == "topic":
            return [client_id, b"", b"" if end else self._topic, seq, payload]
        return [client_id, b"", seq, payload]


async def _wait_until(event: asyncio.Event, done: Callable[[], bool], timeout_s: float) -> None:
    """Wait, at most `timeout_s`, until `done()`; `event` is set whenever it may have become so."""
    async with asyncio.timeout(timeout_s):
        while not done():
            event.clear()
            await event.wait()
