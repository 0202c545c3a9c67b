"""The child processes the demo starts and stops: the listener daemon (and, through a subclass
in `bench/soak.py`, the router), each `python -m kv_listener ... --config PATH`.

Owns a child's configuration file, its start (ready when its JSON log says so), its log (warnings
counted, the tail kept for one error line), its stop (SIGTERM, or nothing when a terminal's
Ctrl-C already reached it; killed after a timeout) and the wait for the listener to subscribe to
the engines' event sockets. Ports come from `free_ports`: the child reads them from its file,
where port 0 cannot be read back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
from collections import deque
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml

from kv_listener.sim.engine import SimEngine
from kv_listener.sim.server import EngineServer
from kv_listener.sim.workload import DEMO_MODEL


class DemoError(Exception):
    """The demo could not run (the listener did not start, ...): one line for the operator."""


def free_ports(n: int) -> list[int]:
    """`n` distinct TCP ports on 127.0.0.1 that were free a moment ago (the listener binds its
    HTTP and ZMQ addresses from its config file, where port 0 cannot be read back)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:  # all held open at once, so the ports differ
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


class ListenerProcess:
    """`python -m kv_listener --config PATH` as a child: its JSON log is read line by line
    (`listener_started` tells its readiness; warnings are counted; the tail is kept for an
    error report). A subclass runs another of the package's processes by changing `ROLE`,
    `COMMAND` and the two log events (bench/soak.py runs the router so)."""

    ROLE = "listener"
    COMMAND: tuple[str, ...] = ()  # between `-m kv_listener` and `--config PATH`
    STARTED_EVENT = "listener_started"
    STOPPING_EVENT = "listener_stopping"

    def __init__(self, config_path: Path) -> None:
        self.config_path = config_path
        self.proc: asyncio.subprocess.Process | None = None
        self.started = asyncio.Event()
        self.stopping = asyncio.Event()  # it logged `listener_stopping`: a signal reached it
        self.warnings = 0
        self.tail: deque[str] = deque(maxlen=30)
        self._reader: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    async def start(self, timeout_s: float) -> None:
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   TOKENIZERS_PARALLELISM="false")
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kv_listener", *self.COMMAND, "--config", str(self.config_path),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE, env=env, limit=1 << 20)
        self._reader = asyncio.create_task(self._read_log(), name=f"{self.ROLE}-log")
        started = asyncio.create_task(self.started.wait())
        try:
            done, _ = await asyncio.wait({started, self._reader}, timeout=timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            started.cancel()
        if not self.started.is_set():
            why = "exited" if self._reader in done else f"did not start within {timeout_s:g} s"
            raise DemoError(f"the {self.ROLE} {why}: {self.last_error()}")

    def last_error(self) -> str:
        for line in reversed(self.tail):
            try:
                rec = json.loads(line)
            except ValueError:
                if line.strip():
                    return line.strip()
                continue
            if isinstance(rec, dict) and rec.get("level") in ("error", "critical"):
                return f"{rec.get('event')} {rec.get('errors') or rec.get('detail') or ''}".strip()
        return self.tail[-1].strip() if self.tail else "no output"

    async def _read_log(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        while True:
            try:
                raw = await self.proc.stderr.readline()
            except ValueError:  # a line over the reader's limit: skip it
                continue
            if not raw:
                return
            line = raw.decode("utf-8", "replace")
            self.tail.append(line)
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if not isinstance(rec, dict):
                continue
            if rec.get("event") == self.STARTED_EVENT:
                self.started.set()
            elif rec.get("event") == self.STOPPING_EVENT:
                self.stopping.set()
            elif rec.get("level") in ("warning", "error", "critical"):
                self.warnings += 1

    async def stop(self, timeout_s: float, *, grace_s: float = 0.0) -> int:
        """SIGTERM, wait for the exit; killed (and reported as -9) after `timeout_s`.

        A terminal's Ctrl-C reaches the whole process group, the listener included, and it
        stops by itself: then it must not get a second signal (once it has begun to stop, it no
        longer handles them). `grace_s` is how long to watch its log for `listener_stopping`
        before sending SIGTERM."""
        if self.proc is None:
            return 0
        if grace_s > 0 and not self.stopping.is_set() and self.proc.returncode is None:
            waiters = {asyncio.create_task(self.stopping.wait()),
                       asyncio.create_task(self.proc.wait())}
            _, pending = await asyncio.wait(waiters, timeout=grace_s,
                                            return_when=asyncio.FIRST_COMPLETED)
            for t in pending:
                t.cancel()
        if self.proc.returncode is None and not self.stopping.is_set():
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
        if self.proc.returncode is None:
            try:
                await asyncio.wait_for(self.proc.wait(), timeout_s)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                await self.proc.wait()
        if self._reader is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        code = self.proc.returncode
        assert code is not None
        return code


def listener_config(port: int, engines: Sequence[EngineServer],
                    tokenizer_dir: str) -> dict[str, Any]:
    """The listener's YAML for the demo: one vLLM source per engine, in the usual deployment:
    the listener binds each `zmq_endpoint` (publishers checked against `allowed_publishers`)
    and the engine connects to it, vLLM's `tcp://host:port` form. Prompts are decoded by the
    engines' `/detokenize` (authoritative); the chat template is learned from the same
    tokenizer directory the engines use, as an operator with the model's files would."""
    return {
        "listen": f"127.0.0.1:{port}",
        "log": {"level": "info", "format": "json"},
        "history_size": 10000,
        "update_interval": "100ms",
        "sources": [
            {"backend_name": s.engine.name, "engine": "vllm", "model": DEMO_MODEL,
             "zmq_endpoint": s.engine.endpoint, "zmq_mode": "bind",
             "replay_endpoint": s.engine.replay_endpoint,
             "detokenize_endpoint": s.url + "/detokenize",
             "tokenizer": tokenizer_dir, "allowed_publishers": ["127.0.0.1"]}
            for s in engines
        ],
    }



def write_listener_config(directory: Path, port: int, engines: Sequence[EngineServer],
                          tokenizer_dir: str) -> Path:
    """`listener_config` as `directory/listener.yaml`; returns its path."""
    path = directory / "listener.yaml"
    path.write_text(yaml.safe_dump(listener_config(port, engines, tokenizer_dir)))
    return path


async def wait_for_subscriptions(engines: Iterable[SimEngine], timeout_s: float) -> None:
    """Until the listener subscribed to every engine's event socket (each engine connects to
    the address the listener binds; ZMQ retries until it does), at most `timeout_s` in all."""
    try:
        async with asyncio.timeout(timeout_s):
            for engine in engines:
                await engine.publisher.wait_for_subscriber(timeout_s=timeout_s)
    except TimeoutError:
        raise DemoError("the listener did not subscribe to the engines' event sockets") from None
