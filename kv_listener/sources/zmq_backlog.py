"""The live batches a ZMQ source keeps while a replay is in flight (`LiveBacklog`), and the
typed pyzmq futures its receive and replay loops wait on.

Bounded in count (`max_replay_backlog`) and in bytes (the receive budget); past either, the batch
before the newest is lost, like a high-water-mark drop, and the newest takes its place: the
backlog always ends with the newest batch, so its seq shows the gap even when the engine sends
nothing more (a lost tail would otherwise go unnoticed).
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

import zmq.asyncio

from kv_listener.core.sequence import FrameError, parse_event_frames


def recv_future(sock: zmq.asyncio.Socket) -> asyncio.Future[list[bytes]]:
    fut: asyncio.Future[list[bytes]] = sock.recv_multipart()  # type: ignore[assignment]
    return fut


def recv_now(sock: zmq.Socket[bytes]) -> list[bytes] | None:
    """The message already queued on `sock` (a sync shadow of the SUB), or None when there is
    none. The hot path of a busy stream: the async socket's receive makes a Future per message
    and goes through pyzmq's Python event handling even when the message is there (about a
    sixth of the daemon's samples in a py-spy profile, a stream of 16 KB frames); it receives
    the same way (non-blocking) when it can, and does not yield to the loop either, so nothing
    else changes."""
    try:
        return sock.recv_multipart(zmq.NOBLOCK)
    except zmq.Again:
        return None


def send_future(sock: zmq.asyncio.Socket, frames: list[bytes]) -> asyncio.Future[Any]:
    fut: asyncio.Future[Any] = sock.send_multipart(frames)  # type: ignore[assignment]
    return fut


def frames_size(frames: list[bytes]) -> int:
    return sum(len(frame) for frame in frames)


class LiveBacklog:
    __slots__ = ("_frames", "_max_bytes", "_max_count", "nbytes")

    def __init__(self, max_count: int, max_bytes: int) -> None:
        self._frames: deque[list[bytes]] = deque()
        self._max_count = max_count
        self._max_bytes = max_bytes
        self.nbytes = 0  # what the kept frames take

    def __len__(self) -> int:
        return len(self._frames)

    def keep(self, frames: list[bytes]) -> bool:
        """Keep `frames`; False when that cost the batch kept last (see module doc)."""
        size = frames_size(frames)
        kept = self._frames
        if not kept or (len(kept) < self._max_count and self.nbytes + size <= self._max_bytes):
            kept.append(frames)
            self.nbytes += size
            return True
        self.nbytes += size - frames_size(kept[-1])
        kept[-1] = frames
        return False

    def popleft(self) -> list[bytes]:
        frames = self._frames.popleft()
        self.nbytes -= frames_size(frames)
        return frames

    def continues(self, last: int | None) -> bool:
        """Whether a batch kept here follows `last` at once or is older (the live stream then
        carries on from a run that ended at `last`)."""
        for frames in self._frames:
            try:
                return last is not None and parse_event_frames(frames)[1] <= last + 1
            except FrameError:
                continue
        return False

    def drop_covered(self, last: int) -> None:
        """Forget the batches a replay already covered (seq <= `last`); frames that do not
        parse stay, to be counted when handled."""
        kept: deque[list[bytes]] = deque()
        for frames in self._frames:
            try:
                _topic, seq, _payload = parse_event_frames(frames)
            except FrameError:
                kept.append(frames)
                continue
            if seq > last:
                kept.append(frames)
        self._frames = kept
        self.nbytes = sum(frames_size(frames) for frames in kept)
