"""A recording ZMQ forwarder between a real engine's KV-event publisher and the listeners.

vLLM's publisher connects its PUB to a `tcp://host:port` endpoint and the listener's source binds
(`zmq_mode: bind`), so the tap sits where the listener would: it binds a SUB where the engine
connects, records every message `[topic, seq (8 bytes BE), payload]` (the oracle's input: what
the engine really sent), and forwards it over an XPUB that connects to each listener's bound
endpoint. The XPUB also shows the listeners' subscriptions, so a test can await "the listener
is subscribed" instead of guessing. The tap can withhold chosen messages from the listeners (a
real sequence gap, which the listener must fill from the engine's replay socket, which it
reaches directly).

The sockets live in one thread (ZMQ sockets are not thread-safe); tests talk to it through a
command queue and read what it recorded under a lock. Every wait is bounded.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq


@dataclass(frozen=True, slots=True)
class Tapped:
    at: float  # time.monotonic() when it arrived
    frames: tuple[bytes, ...]
    forwarded: bool

    @property
    def seq(self) -> int:
        return int.from_bytes(self.frames[1], "big") if len(self.frames) == 3 else -1


class ZmqTap:
    def __init__(self, bind_endpoint: str) -> None:
        self.endpoint = bind_endpoint
        self._ctx = zmq.Context()
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._lock = threading.Condition()
        self._messages: list[Tapped] = []
        self._subscriptions = 0
        self._drop = 0
        self._running = True
        self._error: BaseException | None = None
        self._bound = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"zmq-tap {bind_endpoint}",
                                        daemon=True)
        self._thread.start()
        if not self._bound.wait(10) or self._error is not None:
            raise RuntimeError(f"tap could not bind {bind_endpoint}: {self._error!r}")

    # --- the socket thread --------------------------------------------------------------------

    def _run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        out = self._ctx.socket(zmq.XPUB)
        try:
            sub.setsockopt(zmq.LINGER, 0)
            out.setsockopt(zmq.LINGER, 0)
            out.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscriber's subscription, not just the first
            sub.setsockopt(zmq.RCVHWM, 0)
            out.setsockopt(zmq.SNDHWM, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.bind(self.endpoint)
        except zmq.ZMQError as exc:
            self._error = exc
            self._bound.set()
            sub.close()
            out.close()
            return
        self._bound.set()
        self._pub = out
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(out, zmq.POLLIN)
        try:
            while self._running:
                while True:
                    try:
                        self._commands.get_nowait()()
                    except queue.Empty:
                        break
                for sock, _ in poller.poll(50):
                    if sock is out:
                        msg = out.recv()
                        if msg[:1] == b"\x01":
                            with self._lock:
                                self._subscriptions += 1
                                self._lock.notify_all()
                        continue
                    frames = tuple(sub.recv_multipart())
                    with self._lock:
                        forward = self._drop == 0
                        if not forward:
                            self._drop -= 1
                        self._messages.append(Tapped(time.monotonic(), frames, forward))
                        self._lock.notify_all()
                    if forward:
                        out.send_multipart(frames)
        except BaseException as exc:  # surfaced to the test by check()
            self._error = exc
        finally:
            sub.close()
            out.close()

    # --- test side ----------------------------------------------------------------------------

    def forward_to(self, endpoint: str) -> None:
        """Also forward to a listener bound at `endpoint` (PUB connects: order does not matter)."""
        done = threading.Event()

        def connect() -> None:
            self._pub.connect(endpoint)
            done.set()

        self._commands.put(connect)
        if not done.wait(10):
            raise TimeoutError(f"tap did not connect to {endpoint}")

    def stop_forwarding(self, endpoint: str) -> None:
        """Stop forwarding to a listener that is gone (nothing queues up for it)."""
        done = threading.Event()

        def disconnect() -> None:
            self._pub.disconnect(endpoint)
            done.set()

        self._commands.put(disconnect)
        if not done.wait(10):
            raise TimeoutError(f"tap did not disconnect from {endpoint}")

    def drop_next(self, n: int = 1) -> None:
        """Record but do not forward the next `n` messages (a gap for the listeners)."""
        with self._lock:
            self._drop += n

    @property
    def messages(self) -> list[Tapped]:
        with self._lock:
            return list(self._messages)

    @property
    def subscriptions(self) -> int:
        """Subscriptions the listeners' SUB sockets sent (one per connection and topic)."""
        with self._lock:
            return self._subscriptions

    def count(self) -> int:
        with self._lock:
            return len(self._messages)

    def last_at(self) -> float:
        with self._lock:
            return self._messages[-1].at if self._messages else 0.0

    def check(self) -> None:
        if self._error is not None:
            raise AssertionError(f"tap thread failed: {self._error!r}")

    def wait_for(self, pred: Callable[[], bool], timeout_s: float) -> bool:
        """Block (in a worker thread) until `pred()` holds under the tap's lock, at most
        `timeout_s`. Returns whether it holds."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while not pred():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
            return True

    def wait_subscriptions(self, n: int, timeout_s: float = 15.0) -> bool:
        return self.wait_for(lambda: self._subscriptions >= n, timeout_s)

    def wait_count(self, n: int, timeout_s: float) -> bool:
        return self.wait_for(lambda: len(self._messages) >= n, timeout_s)

    def close(self) -> None:
        self._running = False
        self._thread.join(5)
        self._ctx.term()
