"""`continuum-kv-listener simulate` as a new user runs it: real processes on 127.0.0.1, real
sockets, no mocks.

- The three commands of the README's quick start (listener, simulate, router) on copies of the
  shipped example files whose ports, and nothing else, are moved to free ones: every listener
  source ready and fed, every backend indexed by the router, every process exiting 0 on SIGTERM.
- Both examples validate without a warning.
- simulate refuses a bad file (2) and a busy address (1), and skips every endpoint that is not
  on loopback with a note, binding nothing but loopback.
- A source in connect mode and one in bind mode are both fed, salted with the file's secret
  (the listener verifies the salts: no detokenize call at all), and `--duration` ends it with 0.

Every wait polls an HTTP endpoint or a file with a deadline and says what it waited for.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

from kv_listener.sim.workload import ChatSessions
from tests.conftest import ROOT
from tests.support.ports import free_ports

LISTENER_EXAMPLE = ROOT / "config.kv-listener.yaml.example"
ROUTER_EXAMPLE = ROOT / "config.router.yaml.example"
KVL = [sys.executable, "-m", "kv_listener"]
ADDRESS = re.compile(r"127\.0\.0\.1:(\d+)")
ERROR_PREFIX = "continuum-kv-listener: error: "
START_TIMEOUT_S = 60.0  # a cold start loads transformers in each process, on a shared CPU
STOP_TIMEOUT_S = 20.0

T = TypeVar("T")


# --- helpers ---------------------------------------------------------------------------------


class Proc:
    """A child process with its stdout and stderr in files (read while it runs)."""

    def __init__(self, name: str, args: list[str], tmp: Path) -> None:
        self.name = name
        self.out_path = tmp / f"{name}.out"
        self.err_path = tmp / f"{name}.err"
        with self.out_path.open("wb") as out, self.err_path.open("wb") as err:
            self.popen = subprocess.Popen(args, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=out,
                                          stderr=err, env=dict(os.environ))

    @property
    def stdout(self) -> str:
        return self.out_path.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def tail(self) -> str:
        return (f"--- {self.name} (pid {self.popen.pid}, rc {self.popen.poll()}) stdout:\n"
                f"{self.stdout[-3000:]}\n--- stderr:\n{self.stderr[-3000:]}")

    def stop(self) -> int:
        """SIGTERM and the exit code (killed, and -9, after STOP_TIMEOUT_S)."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
        try:
            return self.popen.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
            return -9

    def wait(self, timeout_s: float) -> int:
        try:
            return self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} did not exit within {timeout_s:g} s\n"
                                 f"{self.tail()}") from None


@contextmanager
def running(tmp: Path) -> Iterator[Callable[[str, list[str]], Proc]]:
    """Start processes; on the way out every one still running gets SIGTERM (then a kill)."""
    procs: list[Proc] = []

    def start(name: str, args: list[str]) -> Proc:
        proc = Proc(name, args, tmp)
        procs.append(proc)
        return proc

    try:
        yield start
    finally:
        for proc in procs:
            if proc.popen.poll() is None:
                proc.stop()


def until(what: str, check: Callable[[], T | None], procs: list[Proc],
          timeout_s: float = START_TIMEOUT_S) -> T:
    """Poll `check` until it returns a value (not None); fail with `what` and the processes'
    output after `timeout_s`, or as soon as one of them exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.popen.poll() is not None:
                raise AssertionError(f"{proc.name} exited while waiting for {what}\n"
                                     + "\n".join(p.tail() for p in procs))
        value = check()
        if value is not None:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}\n"
                         + "\n".join(p.tail() for p in procs))


def http_get(url: str) -> tuple[int, Any] | None:
    """(status, JSON body), or None while nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        body = exc.read()
        try:
            return exc.code, json.loads(body or b"null")
        except ValueError:
            return exc.code, body.decode(errors="replace")
    except (OSError, ValueError):
        return None


def write_yaml(path: Path, data: Any) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def simulate(config: Path, *extra: str) -> list[str]:
    return [*KVL, "simulate", "--config", str(config), *extra]


def run_simulate(config: Path, *extra: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(simulate(config, *extra), cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout_s, check=False)


def listening_addresses(pid: int) -> set[tuple[str, int]]:
    """(local address, port) of every listening TCP socket the process holds (/proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd) if fd.is_symlink() else ""
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = set()
    for table, size in (("tcp", 4), ("tcp6", 16)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                continue
            hex_ip, hex_port = cols[1].split(":")
            raw = bytes.fromhex(hex_ip)
            # /proc writes each 32-bit word in host (little-endian) order.
            ip = b"".join(raw[i:i + 4][::-1] for i in range(0, size, 4))
            addr = socket.inet_ntop(socket.AF_INET if size == 4 else socket.AF_INET6, ip)
            out.add((addr.removeprefix("::ffff:"), int(hex_port, 16)))  # v4-mapped: IPv4
    return out


def is_loopback(addr: str) -> bool:
    return addr.startswith("127.") or addr == "::1"


# --- (a) the quick start: listener + simulate + router on the shipped examples ----------------


def moved_ports(texts: dict[str, str]) -> tuple[dict[str, str], dict[int, int]]:
    """Both files with every 127.0.0.1 port moved to a free one (one mapping for both, so the
    router still names the listener's port)."""
    ports = sorted({int(p) for text in texts.values() for p in ADDRESS.findall(text)})
    mapping = dict(zip(ports, free_ports(len(ports)), strict=True))
    moved = {name: ADDRESS.sub(lambda m: f"127.0.0.1:{mapping[int(m.group(1))]}", text)
             for name, text in texts.items()}
    return moved, mapping


@pytest.mark.timeout(150)
def test_the_three_quick_start_commands_feed_the_router_from_every_source(tmp_path: Path) -> None:
    texts = {"listener": LISTENER_EXAMPLE.read_text(), "router": ROUTER_EXAMPLE.read_text()}
    moved, mapping = moved_ports(texts)
    for name, text in texts.items():
        # Ports are the only thing changed.
        assert ADDRESS.sub("127.0.0.1:PORT", moved[name]) == ADDRESS.sub("127.0.0.1:PORT", text)
        assert not set(map(int, ADDRESS.findall(moved[name]))) & set(mapping), name
    listener_file = tmp_path / "config.kv-listener.yaml"
    router_file = tmp_path / "config.router.yaml"
    listener_file.write_text(moved["listener"])
    router_file.write_text(moved["router"])
    listener_cfg = yaml.safe_load(moved["listener"])
    router_cfg = yaml.safe_load(moved["router"])
    backends = [s["backend_name"] for s in listener_cfg["sources"]]
    engines = {s["engine"] for s in listener_cfg["sources"]}
    assert engines == {"vllm", "sglang", "trtllm"}
    # The router consumes exactly what the listener serves.
    assert [s["backend_name"] for s in router_cfg["kv_cache_index"]["event_sources"]] == backends
    base = f"http://{listener_cfg['listen']}"
    admin = f"http://{router_cfg['admin']['listen']}"

    with running(tmp_path) as start:
        listener = start("listener", [*KVL, "--config", str(listener_file)])
        sim = start("simulate", simulate(listener_file, "--duration", "300"))
        router = start("router", [*KVL, "router", "--config", str(router_file)])
        procs = [listener, sim, router]

        def ready() -> bool | None:
            got = http_get(f"{base}/readyz")
            return True if got is not None and got[0] == 200 else None

        until("the listener's /readyz to answer 200 (every source ready)", ready, procs)

        def fed() -> dict[str, Any] | None:
            got = http_get(f"{base}/stats")
            if got is None or got[0] != 200:
                return None
            sources = got[1]["sources"]
            ok = all(sources[b]["events_received"] > 0 and sources[b]["prefixes_live"] > 0
                     for b in backends)
            return sources if ok else None

        sources = until("events and live prefixes on every listener source", fed, procs)
        for b in backends:
            assert sources[b]["events_dropped"] == {}, (b, sources[b])
            assert sources[b]["salt_rejected"] == 0, (b, sources[b])

        def indexed() -> dict[str, Any] | None:
            got = http_get(f"{admin}/admin/kv-index/backends")
            if got is None or got[0] != 200:
                return None
            rows = {r["backend_name"]: r for r in got[1]["backends"]}
            ok = all(b in rows and rows[b]["connection"]["connected"]
                     and rows[b]["index"]["entries"] > 0 for b in backends)
            return rows if ok else None

        rows = until("router index entries from every listener backend", indexed, procs)
        assert set(rows) == set(backends), rows
        status, stats = http_get(f"{admin}/admin/kv-index/stats") or (0, {})
        assert status == 200 and stats["index"]["entry_count"] > 0, stats
        assert set(stats["index"]["backends"]) == set(backends), stats
        assert {s["backend_name"] for s in stats["event_sources"]} == set(backends)
        assert (http_get(f"{base}/readyz") or (0,))[0] == 200

        codes = {p.name: p.stop() for p in (sim, router, listener)}
    assert codes == {"simulate": 0, "router": 0, "listener": 0}, \
        "\n".join(p.tail() for p in procs)
    out = sim.stdout
    assert "Traceback" not in sim.stderr + listener.stderr + router.stderr
    for b in backends:
        assert re.search(rf"\| {b}: req [1-9]\d* stored [1-9]\d* evicted \d+", out), out
    assert out.splitlines()[-1].startswith("simulate: stopped after "), out


# --- (b) the examples validate cleanly ---------------------------------------------------------


@pytest.mark.parametrize("example", [LISTENER_EXAMPLE, ROUTER_EXAMPLE], ids=lambda p: p.name)
def test_the_examples_validate_without_warnings(example: Path) -> None:
    proc = subprocess.run([*KVL, "config", "validate", str(example)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    output = proc.stdout + proc.stderr
    assert "warning" not in output.lower(), output
    assert "valid " in proc.stdout and "(3 " in proc.stdout, proc.stdout


# --- (c) bad files, busy addresses, non-loopback endpoints --------------------------------------


def vllm_source(name: str, zport: int, **extra: Any) -> dict[str, Any]:
    return {"backend_name": name, "engine": "vllm", "model": "m",
            "zmq_endpoint": f"tcp://127.0.0.1:{zport}", **extra}


def test_a_bad_file_exits_2_with_one_line_per_error(tmp_path: Path) -> None:
    bad = write_yaml(tmp_path / "bad.yaml", {"listen": "nowhere", "sources": [
        {"backend_name": "a b", "engine": "vllm", "model": "m",
         "zmq_endpoint": "tcp://127.0.0.1:5557"}]})
    proc = run_simulate(bad)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith(ERROR_PREFIX) for line in lines), lines
    assert any("listen" in line for line in lines) and any("backend_name" in line
                                                           for line in lines), lines
    missing = run_simulate(tmp_path / "missing.yaml")
    assert missing.returncode == 2
    assert missing.stderr.startswith(ERROR_PREFIX) and "no such file" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1, missing.stderr


@pytest.mark.parametrize("where", ["detokenize_endpoint", "zmq_endpoint"])
def test_a_busy_address_exits_1_and_says_which(tmp_path: Path, where: str) -> None:
    zport, busy_port = free_ports(2)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", busy_port))
        holder.listen()
        if where == "zmq_endpoint":  # a connecting source: the simulated engine binds
            source = vllm_source("vllm-1", busy_port, zmq_mode="connect")
        else:
            source = vllm_source(
                "vllm-1", zport, detokenize_endpoint=f"http://127.0.0.1:{busy_port}/detokenize")
        proc = run_simulate(write_yaml(tmp_path / "l.yaml", {"sources": [source]}),
                            "--duration", "30")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(ERROR_PREFIX + "simulate: vllm-1: "), lines
    assert f"127.0.0.1:{busy_port}" in lines[0] and "in use" in lines[0], lines


@pytest.mark.timeout(90)
def test_endpoints_off_loopback_are_skipped_with_a_note_and_nothing_else_binds(
        tmp_path: Path) -> None:
    served_z, wild_z, wild_http, off_trt, off_health, named = free_ports(6)
    config = write_yaml(tmp_path / "l.yaml", {"sources": [
        # Served: a connecting source, so the simulated engine binds 127.0.0.1.
        vllm_source("local", served_z, zmq_mode="connect"),
        # The listener would connect to every interface / another host: nothing to bind.
        vllm_source("wild", wild_z, zmq_mode="connect",
                    detokenize_endpoint=f"http://0.0.0.0:{wild_http}/detokenize",
                    health_endpoint=f"http://192.0.2.7:{off_health}/health") | {
            "zmq_endpoint": f"tcp://0.0.0.0:{wild_z}"},
        {"backend_name": "far", "engine": "trtllm", "model": "m",
         "trtllm_endpoint": f"http://192.0.2.8:{off_trt}/kv_cache_events",
         "allowed_publishers": ["192.0.2.8"]},
        vllm_source("named", named, zmq_mode="connect") | {
            "zmq_endpoint": f"tcp://engine-7.internal:{named}"},
    ]})
    with running(tmp_path) as start:
        sim = start("simulate", simulate(config, "--duration", "60"))
        until("simulate to start its engines", lambda: True if "simulate: running" in sim.stdout
              else None, [sim])
        addresses = listening_addresses(sim.popen.pid)
        assert addresses, "the served source binds its ZMQ endpoint"
        assert all(is_loopback(addr) for addr, _ in addresses), addresses
        assert ("127.0.0.1", served_z) in addresses
        assert not {port for _, port in addresses} & {wild_z, wild_http, off_trt, off_health,
                                                       named}, addresses
        assert sim.stop() == 0, sim.tail()
    notes = [line for line in sim.stdout.splitlines() if line.startswith("simulate: note: ")]
    expected = [
        f"sources[1] wild: zmq_endpoint tcp://0.0.0.0:{wild_z} skipped: not a loopback",
        f"sources[1] wild: detokenize_endpoint http://0.0.0.0:{wild_http}/detokenize skipped: "
        "not a loopback",
        f"sources[1] wild: health_endpoint http://192.0.2.7:{off_health}/health skipped: not a "
        "loopback",
        f"sources[2] far: trtllm_endpoint http://192.0.2.8:{off_trt}/kv_cache_events skipped: "
        "not a loopback",
        f"sources[3] named: zmq_endpoint tcp://engine-7.internal:{named} skipped: not a loopback",
    ]
    for want in expected:
        assert sum(want in n for n in notes) == 1, (want, notes)
    assert len(notes) == len(expected), notes
    assert "Traceback" not in sim.stderr


def test_a_file_with_nothing_on_loopback_is_a_usage_error(tmp_path: Path) -> None:
    config = write_yaml(tmp_path / "l.yaml", {"sources": [
        vllm_source("far", 5557, zmq_mode="connect") | {"zmq_endpoint": "tcp://192.0.2.9:5557"}]})
    proc = run_simulate(config)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "skipped: not a loopback" in proc.stdout
    assert proc.stderr.strip().splitlines() == [
        f"{ERROR_PREFIX}simulate: {config}: nothing to simulate (no source has an endpoint on a "
        "loopback address)"]


# --- (d) connect and bind mode, salted ---------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_connecting_and_a_binding_source_are_both_fed_with_verified_salts(
        tmp_path: Path) -> None:
    listen, bind_z, conn_z, replay, http_a, http_b = free_ports(6)
    secret = tmp_path / "salt.secret"
    secret.write_text("s3cret-for-the-test\n")
    config = write_yaml(tmp_path / "l.yaml", {
        "listen": f"127.0.0.1:{listen}",
        "cache_salt": {"secret_file": str(secret)},
        "sources": [
            vllm_source("binding", bind_z, zmq_mode="bind",
                        detokenize_endpoint=f"http://127.0.0.1:{http_a}/detokenize"),
            {"backend_name": "connecting", "engine": "sglang", "model": "s",
             "zmq_endpoint": f"tcp://127.0.0.1:{conn_z}", "zmq_mode": "connect",
             "zmq_topic": "kv-events", "replay_endpoint": f"tcp://127.0.0.1:{replay}",
             "detokenize_endpoint": f"http://127.0.0.1:{http_b}/detokenize"},
        ]})
    base = f"http://127.0.0.1:{listen}"
    with running(tmp_path) as start:
        listener = start("listener", [*KVL, "--config", str(config)])
        # 10 s: both sources are fed 2 s after the start (5 s beside three CPU burners), and the
        # plain progress line comes every 5 s, so one is printed before the duration ends it.
        sim = start("simulate", simulate(config, "--duration", "10"))

        def fed() -> dict[str, Any] | None:
            got = http_get(f"{base}/stats")
            if got is None or got[0] != 200:
                return None
            sources = got[1]["sources"]
            ok = all(s["events_received"] > 0 and s["prefixes_live"] > 0
                     for s in sources.values())
            return sources if len(sources) == 2 and ok else None

        sources = until("both sources fed with live prefixes", fed, [listener, sim])
        for name, st in sources.items():
            # Every chain resolved by its salt: the listener never had to detokenize.
            assert (st["salt_rejected"], st["detokenize_calls"]) == (0, 0), (name, st)
            assert st["events_dropped"] == {} and st["ready"], (name, st)
        assert sources["connecting"]["startup_replay"] is not None
        assert (http_get(f"{base}/readyz") or (0,))[0] == 200
        assert sim.wait(60) == 0, sim.tail()  # --duration ends it
        assert listener.stop() == 0, listener.tail()
    out = sim.stdout
    assert "requests salted" in out, out
    assert "connecting (sglang 0.5.23): KV events to tcp://127.0.0.1:" in out, out
    assert "(binds, the listener connects, topic 'kv-events')" in out, out
    assert "binding (vllm 0.33): KV events to tcp://127.0.0.1:" in out, out
    assert "(connects, the listener binds)" in out, out
    assert re.search(r"^simulate +\d+\.\d+s/10s +requests \d+", out, re.M), out
    assert "s3cret" not in out + sim.stderr + listener.stderr


# --- the workload it drives ---------------------------------------------------------------------


def test_chat_sessions_come_back_with_the_whole_history() -> None:
    sessions = ChatSessions(seed=3, model="m", follow_up=1.0, max_turns=3, max_open=1)
    first = sessions.next()
    other = sessions.next()  # `first` is in flight: never two turns of one conversation
    assert (first.turn, other.turn) == (1, 1) and first.conversation != other.conversation
    sessions.answered(first, "answer one")
    second = sessions.next()
    assert (second.conversation, second.turn) == (first.conversation, 2)
    history = second.request.messages
    assert history[:2] == first.request.messages
    assert history[2] == {"role": "assistant", "content": "answer one"}
    assert history[3]["role"] == "user" and len(history) == 4
    assert second.request.prefix_hash == first.request.prefix_hash  # the system prompt's key
    sessions.answered(second, "answer two")
    third = sessions.next()
    assert third.turn == 3
    sessions.answered(third, "answer three")  # max_turns: the conversation ends
    sessions.answered(other, "hi")
    assert sessions.open_conversations == 1
    assert sessions.next().conversation == other.conversation
