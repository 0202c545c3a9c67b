"""The listener as an operator runs it (issue 14): exit codes of a busy port, start-up that says
`listener_started` only once everything is bound, every line JSON with `log.format: json`
(libraries' lines and fatal errors included), and per-source readiness next to `/readyz`.

Real processes, real sockets on 127.0.0.1: a real ZMQ PUB is the engine."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
import zmq
import zmq.asyncio

from tests.conftest import FIXTURES
from tests.support.daemon import Daemon
from tests.support.ports import free_port

pytestmark = pytest.mark.timeout(60)

CMD = [sys.executable, "-m", "kv_listener"]


def vllm_source(name: str, port: int, **extra: Any) -> dict[str, Any]:
    return {"backend_name": name, "engine": "vllm", "model": "m",
            "zmq_endpoint": f"tcp://127.0.0.1:{port}", "zmq_mode": "bind", **extra}


def run_listener(tmp_path: Path, doc: dict[str, Any]) -> tuple[int, list[str]]:
    path = tmp_path / "listener.yaml"
    path.write_text(yaml.safe_dump(doc))
    proc = subprocess.run([*CMD, "--config", str(path)], capture_output=True, text=True,
                          timeout=30, check=False)
    return proc.returncode, proc.stderr.strip().splitlines()


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        yield sock.getsockname()[1]


# --- exit codes ---------------------------------------------------------------------------------

def test_a_busy_http_port_exits_1_in_json(tmp_path: Path, taken_port: int) -> None:
    code, lines = run_listener(tmp_path, {"listen": f"127.0.0.1:{taken_port}", "sources": []})
    assert code == 1, lines
    records = [json.loads(line) for line in lines]  # every line JSON, the fatal one included
    failed = [r for r in records if r["event"] == "start_failed"]
    assert len(failed) == 1, lines
    assert failed[0]["detail"] == (f"listen: cannot bind 127.0.0.1:{taken_port}: "
                                   "Address already in use")
    assert failed[0]["exit_code"] == 1 and failed[0]["level"] == "error"
    assert not any(r["event"] == "listener_started" for r in records)


def test_a_busy_zmq_port_exits_1_and_never_claims_to_have_started(tmp_path: Path,
                                                                  taken_port: int) -> None:
    doc = {"listen": f"127.0.0.1:{free_port()}",
           "sources": [vllm_source("vllm-1", free_port()), vllm_source("vllm-2", taken_port)]}
    code, lines = run_listener(tmp_path, doc)
    assert code == 1, lines
    records = [json.loads(line) for line in lines]
    failed = [r["detail"] for r in records if r["event"] == "start_failed"]
    assert failed == [f"sources[1].zmq_endpoint: cannot bind tcp://127.0.0.1:{taken_port}: "
                      "Address already in use"], lines
    assert not any(r["event"] == "listener_started" for r in records)


def test_a_console_file_gets_plain_fatal_lines(tmp_path: Path, taken_port: int) -> None:
    doc = {"listen": f"127.0.0.1:{taken_port}", "sources": [], "log": {"format": "console"}}
    code, lines = run_listener(tmp_path, doc)
    assert code == 1
    assert lines[-1] == (f"continuum-kv-listener: error: listen: cannot bind 127.0.0.1:{taken_port}"
                         ": Address already in use")


def test_a_config_error_is_exit_2_in_the_file_s_format(tmp_path: Path) -> None:
    code, lines = run_listener(tmp_path, {"max_lag": -3, "sources": []})
    assert code == 2
    records = [json.loads(line) for line in lines]
    assert [r["event"] for r in records] == ["config_invalid"]
    assert records[0]["detail"].startswith("max_lag: must be between")
    assert records[0]["exit_code"] == 2
    code, lines = run_listener(tmp_path, {"max_lag": -3, "sources": [],
                                          "log": {"format": "console"}})
    assert code == 2
    assert lines == ["continuum-kv-listener: error: max_lag: must be between 1 and 100000000, "
                     "got -3"]


# --- every line JSON --------------------------------------------------------------------------

async def test_every_line_is_json_at_debug_level(tmp_path: Path) -> None:
    """uvicorn, asyncio and zmq.auth log through stdlib logging: at debug level they wrote plain
    `DEBUG name: text` lines next to the JSON ones; transformers (a local tokenizer) its own
    `[transformers] ...` line."""
    zport = free_port()
    cfg = {"listen": f"127.0.0.1:{free_port()}", "log": {"level": "debug", "format": "json"},
           "sources": [vllm_source("vllm-1", zport,
                                   tokenizer=str(FIXTURES / "tokenizers" / "chatml"))]}
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.linger = 0
    try:
        async with Daemon(cfg, tmp_path) as daemon, aiohttp.ClientSession() as http:
            pub.connect(f"tcp://127.0.0.1:{zport}")  # the ZAP handshake: zmq.auth logs it
            await wait_ready(http, f"{daemon.base}/readyz/vllm-1")
            async with http.get(f"{daemon.base}/stats") as resp:
                assert resp.status == 200
        logs = daemon.read_logs()
    finally:
        pub.close()
        ctx.term()
    plain = [r["line"] for r in logs if r["event"] == "plain_line"]
    assert plain == []
    library = {r["logger"].split(".")[0] for r in logs if r["event"] == "library_log"}
    assert "zmq" in library, logs[-10:]
    assert all("level" in r and "timestamp" in r for r in logs if r["event"] != "plain_line")


# --- readiness ----------------------------------------------------------------------------------

async def wait_ready(http: aiohttp.ClientSession, url: str, timeout_s: float = 15.0
                     ) -> dict[str, Any]:
    """Poll a readiness URL until it answers 200 (bounded; the body of the last answer)."""
    body: dict[str, Any] = {}
    async with asyncio.timeout(timeout_s):
        while True:
            async with http.get(url) as resp:
                body = await resp.json()
                if resp.status == 200:
                    return body
            await asyncio.sleep(0.05)


async def readiness(http: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with http.get(url) as resp:
        return resp.status, await resp.json()


async def test_per_source_readiness_needs_a_connected_engine(tmp_path: Path) -> None:
    bound, connecting = free_port(), free_port()
    cfg = {"listen": f"127.0.0.1:{free_port()}", "sources": [
        vllm_source("vllm-1", bound),
        {**vllm_source("vllm-2", connecting), "zmq_mode": "connect"},
    ]}
    ctx = zmq.asyncio.Context()
    engine1 = ctx.socket(zmq.PUB)  # connects to the listener's bound SUB
    engine2 = ctx.socket(zmq.PUB)  # binds: the listener's SUB connects to it
    for s in (engine1, engine2):
        s.linger = 0
    try:
        async with Daemon(cfg, tmp_path) as daemon, aiohttp.ClientSession() as http:
            # Sockets bound / connecting: /readyz (SPEC §6) is 200; no engine behind either.
            assert await readiness(http, f"{daemon.base}/readyz") == (200, [])
            status, body = await readiness(http, f"{daemon.base}/readyz/vllm-1")
            assert status == 503
            assert body == {"backend": "vllm-1", "ready": False, "reason": "no_publisher",
                            "engine": "vllm", "engine_state": "off", "publishers_connected": 0}
            assert (await readiness(http, f"{daemon.base}/readyz/vllm-2"))[0] == 503
            assert (await readiness(http, f"{daemon.base}/readyz/nope"))[0] == 404

            engine1.connect(f"tcp://127.0.0.1:{bound}")
            body = await wait_ready(http, f"{daemon.base}/readyz/vllm-1")
            assert body["publishers_connected"] == 1 and body["reason"] is None
            # One engine up does not make the other one ready.
            assert (await readiness(http, f"{daemon.base}/readyz/vllm-2"))[0] == 503

            engine2.bind(f"tcp://127.0.0.1:{connecting}")
            await wait_ready(http, f"{daemon.base}/readyz/vllm-2")
            async with http.get(f"{daemon.base}/stats") as resp:
                stats = await resp.json()
            assert stats["sources"]["vllm-1"]["publishers_connected"] == 1
            assert stats["sources"]["vllm-2"]["publishers_connected"] == 1
            async with http.get(f"{daemon.base}/metrics") as resp:
                metrics = await resp.text()
            for b in ("vllm-1", "vllm-2"):
                assert f'continuum_kv_listener_publishers_connected{{backend="{b}"}} 1.0' in metrics

            # The engine goes away: its source is not ready any more, the other one still is.
            engine1.close()
            async with asyncio.timeout(15):
                while (await readiness(http, f"{daemon.base}/readyz/vllm-1"))[0] != 503:
                    await asyncio.sleep(0.05)
            status, body = await readiness(http, f"{daemon.base}/readyz/vllm-1")
            assert body["reason"] == "no_publisher" and body["publishers_connected"] == 0
            assert (await readiness(http, f"{daemon.base}/readyz/vllm-2"))[0] == 200
            assert await readiness(http, f"{daemon.base}/readyz") == (200, [])
    finally:
        engine1.close()
        engine2.close()
        ctx.term()


async def test_per_source_readiness_of_a_trtllm_source_follows_its_polls(tmp_path: Path) -> None:
    cfg = {"listen": f"127.0.0.1:{free_port()}", "sources": [
        {"backend_name": "trt-1", "engine": "trtllm", "model": "m",
         "trtllm_endpoint": f"http://127.0.0.1:{free_port()}/kv_cache_events",
         "poll_interval": "50ms", "engine_down_after": None},
    ]}
    async with Daemon(cfg, tmp_path) as daemon, aiohttp.ClientSession() as http:
        status, body = await readiness(http, f"{daemon.base}/readyz/trt-1")
        assert status == 503 and body["reason"] == "polls_failing"
        assert await readiness(http, f"{daemon.base}/readyz") == (503, ["trt-1"])
