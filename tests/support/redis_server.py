"""A real `redis-server` on a free 127.0.0.1 port in a temp dir, for tests (never the system one).

No persistence (`--save "" --appendonly no`), keyspace notifications for expiry on (`Ex`, so a
test can await a key's expiry instead of sleeping), optional TLS (certificates from `trustme`).
`start()` returns once the server logged "Ready to accept connections"; `stop()` terminates it;
`start()` again reuses the same port (the Redis fallback test restarts the server).
"""

from __future__ import annotations

import shutil
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from tests.support.lifecycle import StartStop
from tests.support.ports import free_port

READY_LINE = "Ready to accept connections"
START_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class TlsFiles:
    cert: Path
    key: Path


class RedisServer(StartStop):
    def __init__(self, directory: Path, *, tls: TlsFiles | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.binary = binary
        self.directory = directory
        self.tls = tls
        self.port = free_port()
        self._proc: subprocess.Popen[str] | None = None
        self._thread: threading.Thread | None = None
        self._log: list[str] = []

    @property
    def url(self) -> str:
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://127.0.0.1:{self.port}/0"

    def _args(self) -> list[str]:
        args = [
            self.binary, "--bind", "127.0.0.1", "--dir", str(self.directory),
            "--save", "", "--appendonly", "no", "--daemonize", "no", "--logfile", "",
            "--notify-keyspace-events", "Ex", "--databases", "1",
        ]
        if self.tls is None:
            args += ["--port", str(self.port)]
        else:
            args += ["--port", "0", "--tls-port", str(self.port),
                     "--tls-cert-file", str(self.tls.cert), "--tls-key-file", str(self.tls.key),
                     "--tls-auth-clients", "no"]
        return args

    def start(self) -> None:
        if self._proc is not None:
            raise RuntimeError("already running")
        for attempt in range(3):
            ready = threading.Event()
            proc = subprocess.Popen(
                self._args(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )
            assert proc.stdout is not None
            stdout = proc.stdout

            def drain(stream: IO[str] = stdout, ready: threading.Event = ready) -> None:
                # Keeps reading after "ready" so the server never blocks on a full pipe.
                for line in stream:
                    self._log.append(line.rstrip())
                    if READY_LINE in line:
                        ready.set()
                ready.set()  # EOF: the process ended (failed to start, or stopped)

            thread = threading.Thread(target=drain, daemon=True)
            thread.start()
            ready.wait(START_TIMEOUT_S)
            if proc.poll() is None and any(READY_LINE in line for line in self._log[-50:]):
                self._proc, self._thread = proc, thread
                return
            proc.kill()
            _reap(proc, thread)
            if self._proc is None and attempt < 2 and any(
                "Address already in use" in line for line in self._log[-20:]
            ):
                self.port = free_port()  # someone took the port between probe and bind
                continue
            break
        raise RuntimeError("redis-server did not start:\n" + "\n".join(self._log[-20:]))

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        _reap(proc, self._thread)
        self._thread = None


def _reap(proc: subprocess.Popen[str], thread: threading.Thread | None) -> None:
    """Wait for the process and its output reader, then close the pipe (no ResourceWarning)."""
    proc.wait()
    if thread is not None:
        thread.join(timeout=10)  # EOF follows the exit
    if proc.stdout is not None:
        proc.stdout.close()
