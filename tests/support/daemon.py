"""Run the real listener daemon (`python -m kv_listener --config FILE`) as a subprocess for
end-to-end tests, and read its JSON log lines as they come (a reader thread feeds an asyncio
queue, so a test awaits a log event instead of sleeping)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from kv_listener.core.sse import SseEvent, SseParser


class Daemon:
    """The listener (`python -m kv_listener --config FILE`), or with `command=("router",)` the
    standalone router (`python -m kv_listener router --config FILE`, `started` its start event)."""

    def __init__(self, config: dict[str, Any], workdir: Path, *, command: tuple[str, ...] = (),
                 name: str = "listener", started: str = "listener_started") -> None:
        self.config = config
        self.command = command
        self.started = started
        self.path = workdir / f"{name}.yaml"
        self.path.write_text(yaml.safe_dump(config))
        self.proc: subprocess.Popen[str] | None = None
        self.logs: list[dict[str, Any]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lines: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self._reader: threading.Thread | None = None

    @property
    def base(self) -> str:
        return f"http://{self.config['listen']}"

    def rewrite(self, config: dict[str, Any] | str) -> None:
        self.path.write_text(config if isinstance(config, str) else yaml.safe_dump(config))
        if not isinstance(config, str):
            self.config = config

    async def start(self) -> Daemon:
        self._loop = asyncio.get_running_loop()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kv_listener", *self.command, "--config", str(self.path)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        await self.wait_log(self.started)
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None and self._loop is not None
        for raw in self.proc.stderr:
            line = raw.strip()
            try:
                rec = json.loads(line) if line.startswith("{") else None
            except ValueError:
                rec = None
            if not isinstance(rec, dict):  # a plain line (a fatal error): kept for messages
                if not line:
                    continue
                rec = {"event": "plain_line", "line": line[:500]}
            self._loop.call_soon_threadsafe(self._lines.put_nowait, rec)
        self._loop.call_soon_threadsafe(self._lines.put_nowait, None)

    async def wait_log(self, event: str, timeout_s: float = 20.0, **match: Any) -> dict[str, Any]:
        """Await the next log line named `event` (whose fields include `match`)."""
        async with asyncio.timeout(timeout_s):
            for rec in self.logs:
                if rec.get("_seen") is None and rec.get("event") == event and \
                        all(rec.get(k) == v for k, v in match.items()):
                    rec["_seen"] = True
                    return rec
            while True:
                line = await self._lines.get()
                if line is None:
                    raise AssertionError(f"daemon exited before logging {event!r}: {self.logs[-5:]}")
                self.logs.append(line)
                if line.get("event") == event and all(line.get(k) == v for k, v in match.items()):
                    line["_seen"] = True
                    return line

    def read_logs(self) -> list[dict[str, Any]]:
        """Every log line the daemon wrote so far (those already read are in `logs`)."""
        while True:
            try:
                line = self._lines.get_nowait()
            except asyncio.QueueEmpty:
                return self.logs
            if line is None:  # the process ended: keep the marker for wait_log
                self._lines.put_nowait(None)
                return self.logs
            self.logs.append(line)

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    async def kill(self) -> None:
        """SIGKILL (no clean-up of any kind), reaped; `start()` may run it again."""
        assert self.proc is not None
        self.proc.kill()
        await self.wait_exit()
        await self.stop()
        self._lines = asyncio.Queue()
        self.logs = []

    async def wait_exit(self, timeout_s: float = 20.0) -> int:
        assert self.proc is not None
        proc = self.proc
        return await asyncio.wait_for(asyncio.to_thread(proc.wait), timeout_s)

    async def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                await self.wait_exit(20)
            except TimeoutError:
                self.proc.kill()
                self.proc.wait()
        if self._reader is not None:
            await asyncio.to_thread(self._reader.join, 5)
        if self.proc.stderr is not None:
            self.proc.stderr.close()

    async def __aenter__(self) -> Daemon:
        try:
            return await self.start()
        except BaseException:
            await self.stop()  # reap the process and close its pipe even when start failed
            raise

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


class SseClient:
    """A consumer of `GET /events/{backend}` over a real socket."""

    def __init__(self, session: aiohttp.ClientSession, url: str,
                 last_event_id: str | None = None) -> None:
        self.session, self.url = session, url
        self.parser = SseParser(last_event_id=last_event_id or "")
        self.last_event_id = last_event_id
        self.events: list[SseEvent] = []
        self._resp: aiohttp.ClientResponse | None = None
        self._pending: list[SseEvent] = []

    async def connect(self) -> SseClient:
        headers = {"Accept": "text/event-stream"}
        if self.last_event_id:
            headers["Last-Event-ID"] = self.last_event_id
        self._resp = await self.session.get(self.url, headers=headers,
                                            timeout=aiohttp.ClientTimeout(total=None))
        assert self._resp.status == 200, self._resp.status
        return self

    async def next(self, timeout_s: float = 10.0) -> SseEvent:
        assert self._resp is not None
        async with asyncio.timeout(timeout_s):
            while not self._pending:
                chunk = await self._resp.content.readany()
                if not chunk:
                    raise EOFError("stream ended")
                self._pending.extend(self.parser.feed(chunk))
        ev = self._pending.pop(0)
        self.events.append(ev)
        if ev.id:
            self.last_event_id = ev.id
        return ev

    async def until(self, pred: Any, timeout_s: float = 10.0) -> SseEvent:
        """Read records until one satisfies `pred` (returns it)."""
        async with asyncio.timeout(timeout_s):
            while True:
                ev = await self.next(timeout_s)
                if pred(ev):
                    return ev

    def close(self) -> None:
        if self._resp is not None:
            self._resp.close()


@contextlib.asynccontextmanager
async def sse(session: aiohttp.ClientSession, url: str,
              last_event_id: str | None = None) -> AsyncIterator[SseClient]:
    client = await SseClient(session, url, last_event_id).connect()
    try:
        yield client
    finally:
        client.close()
