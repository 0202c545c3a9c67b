"""Drives the peer routers of the cluster benchmark: installs them, starts them, sends through them.

Owns the peers' side of `bench/cluster.py`: each peer is installed into its own virtual environment
under `.venv-peers/<name>` (never the project's), started per policy as a child process on
127.0.0.1 in front of the simulated engines, probed until it routes, and stopped (SIGTERM, then
SIGKILL after a bound) with the process always reaped, cancellation included.

    ensure_installed(name)                  -> PeerInstall | str (a one-line reason)
    async with run_router(install, policy, workers, model=...) as router: ...
    await send_request(http, router, model=..., text=... or token_ids=..., prefix_key=...) -> Reply
    .venv/bin/python bench/peer_routers.py  # self-check against throwaway fake engines

Facts measured here (2026-12-01, 2 cores, CPython 3.11, aiohttp fake engines on 127.0.0.1):

smg 1.13.0 (`pip install smg==1.13.0`: 8.2 s, 155 MB venv with grpcio, protobuf, PyYAML,
setproctitle; console script `smg`; one process, which renames itself `smg::router`):
- `smg launch --host 127.0.0.1 --port P --prometheus-host 127.0.0.1 --prometheus-port M
  --worker-urls URL... --policy cache_aware|prefix_hash|round_robin
  --worker-startup-check-interval 1 --shutdown-grace-period-secs 2`. Without `--host` it binds
  0.0.0.0, without `--prometheus-host` its metrics too. `launch` is the router alone (`serve`
  starts engines as well). On SIGTERM it waits up to `--shutdown-grace-period-secs` (default
  180) for in-flight requests; with 2 it exits in 1.0-1.2 s.
- It listens at once and registers the workers in the background ("Workers initialized: 0
  total"): ready when `GET /workers` lists every URL with `is_healthy: true` and `status:
  "ready"` (`GET /readiness` also says `{"status": "ready", "healthy_workers": N,
  "total_workers": N}`): 0.1-0.2 s after spawn.
- Probes per worker at registration: `GET /health` x2, `/v1/models` x2, `/version` x2,
  `/server_info` (a 404 is fine); `{"version": "0.11.0"}` makes it `runtime_type: vllm`. Then
  `GET /loads` every 10 s (SGLang shape, see FakeEngine) and `/health` now and then; in 33 s it
  never asked for `/v1/loads` or `/metrics`.
- It re-serializes the chat body (adds `"logprobs": false`) and does not forward the client's
  `User-Agent`. `/v1/completions` takes a string prompt only: a token-ID prompt gets 400 `prompt:
  data did not match any variant of untagged enum StringOrArray`. The engine's response headers
  reach the client (`x-engine-name`), plus its own `x-smg-routed-worker-id: <worker URL>` and
  `x-request-id`. SSE streams pass through chunk by chunk.
- `prefix_hash` hashes the first `--prefix-token-count` (256) tokens, i.e. the first 1024
  characters of an untokenized request: prompts sharing a longer head all go to one worker.
  Worker overload protection is on by default (a worker reporting >= 8 waiting requests or
  token_usage >= 0.8 is left out).
- Its log is ANSI-coloured whatever NO_COLOR says (`log_tail()` strips the escapes) and always
  has one WARN, "SECURITY POSTURE: this gateway runs without authentication".

vllm-router 0.1.17 (`pip install vllm-router==0.1.17`: 14.7-17.1 s, 128 MB venv with fastapi,
uvicorn, aiohttp for its Python launcher; console script `vllm-router`; one process):
- `vllm-router --host 127.0.0.1 --port P --prometheus-host 127.0.0.1 --prometheus-port M
  --worker-urls URL... --policy kv_aware|cache_aware|consistent_hash
  --worker-startup-check-interval 1`; kv_aware adds one `--kv-event-source URL=tcp://127.0.0.1:Z`
  per worker (its SUB connects, so the engine's PUB binds; it subscribes to every topic: one subscribe
  frame, 0x01 and an empty prefix), one `--kv-event-replay-source URL=tcp://127.0.0.1:R` per worker that has
  a replay ROUTER, `--kv-event-block-size 16 --kv-event-model MODEL`. `--host` and
  `--prometheus-host` default to 127.0.0.1 here; `--worker-startup-check-interval` defaults to
  30 s (a worker not yet healthy at the first look costs 30 s).
- It asks every worker's `GET /health` before it listens ("Waiting for N unique hosts"), but it
  goes on as soon as ONE answers ("1 out of 2 unique hosts are healthy"), and then `GET
  /workers` lists the dead one `is_healthy: true` and `GET /health` says "All servers healthy"
  (until its 60 s health checker notices). Ready therefore means: the log line "N out of N
  unique hosts are healthy" (fewer: RouterStartError at once) and `GET /health` 200 and every
  worker in `GET /workers`: 0.5-0.8 s after spawn (mostly its Python launcher). SIGTERM: gone
  in about 0.1 s.
- Probes: `GET /health` only (at start, then every `--health-check-interval-secs`, 60). No
  `/v1/models`, `/version`, `/get_load` with these policies (model id shows as "unknown").
- cache_aware and kv_aware, for every chat request, POST the whole chat body to
  `/v1/chat/completions/render` on EVERY worker before forwarding (20 chat requests to 3
  engines: 20 render calls on each); where render answers 404 they also POST `/tokenize` to every
  worker; the request still goes through. consistent_hash makes no such call. An engine should
  answer render cheaply with vLLM >= 0.20's `{"token_ids": [...], ...}`.
- Engine response headers reach the client (`x-engine-name`); it adds CORS headers and no
  routed-worker header. It forwards the client's request headers (`User-Agent`, `X-Session-ID`).
- consistent_hash keys on `X-Session-ID` (then `X-User-ID`, `X-Tenant-ID`, `X-Request-ID`):
  40 keys over 3 engines spread 10/10/20 to 11/12/17; without a header every request goes to one
  engine.
- kv_aware: routes before any event (to one fixed worker: 6 distinct prompts one at a time all
  went to the same engine); asks for no replay at start. A vLLM 0.33 map-encoded `BlockStored`
  of 8 blocks on engine X sends that prompt (plus a tail) to X within 0.5 s. A seq gap makes it
  ask the replay ROUTER (start seq = the lost one) and the lost batch counts. Token-ID
  `/v1/completions` works without any tokenizer; chat works too when the engines answer
  `/v1/chat/completions/render` (it indexes the rendered token IDs), at one render call per
  worker per request.

Pitfalls handled here: proxy variables are dropped from the children's environment (none is set
on this machine; a proxy would swallow the 127.0.0.1 probes) and `HF_HUB_OFFLINE=1` is set; each
child runs under `setpriv --pdeathsig KILL` so it dies with this process even on SIGKILL, in its
own session (a terminal's Ctrl-C reaches only the benchmark, which then stops it in order); logs
go to a file (a full pipe would stall the router). A venv is complete only when its marker
`.peer-install.json` (written last) names the same requirement: a venv without it (an install
killed mid-pip, or one made by hand) is removed and made again. Installs of one peer are
serialized by an flock on `.venv-peers/.<name>.lock`; no CPU lock is taken here (the caller runs
the whole benchmark under one, and a second flock on it from a child would deadlock).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from array import array
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from quiet import quiet_libraries

ROOT = Path(__file__).resolve().parent.parent
PEERS_DIR = ROOT / ".venv-peers"
ENGINE_HEADER = "x-engine-name"  # the simulated engines name themselves in this response header
SMG_ROUTED_HEADER = "x-smg-routed-worker-id"  # smg's own: the worker URL it chose
MARKER = ".peer-install.json"
INSTALL_TIMEOUT_S = 1200.0
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_HOSTS_HEALTHY = re.compile(r"(\d+) out of (\d+) unique hosts are healthy")  # vllm-router's log


@dataclass(frozen=True, slots=True)
class PeerSpec:
    name: str
    requirement: str  # what pip installs
    dist: str  # distribution name in the dist-info directory
    version: str
    executable: str  # console script in <venv>/bin
    subcommand: tuple[str, ...]
    policies: tuple[str, ...]


PEERS: dict[str, PeerSpec] = {
    "smg": PeerSpec("smg", "smg==1.13.0", "smg", "1.13.0", "smg", ("launch",),
                    ("cache_aware", "prefix_hash", "round_robin")),
    "vllm-router": PeerSpec("vllm-router", "vllm-router==0.1.17", "vllm_router", "0.1.17",
                            "vllm-router", (), ("kv_aware", "cache_aware", "consistent_hash")),
}


@dataclass(frozen=True, slots=True)
class RequestForm:
    """How the benchmark must phrase a request for one peer and policy."""

    form: str  # "chat": /v1/chat/completions with text; "tokens": /v1/completions, token IDs
    session_header: str | None = None  # set to the request's prefix key when not None

    @property
    def path(self) -> str:
        return "/v1/completions" if self.form == "tokens" else "/v1/chat/completions"

    def headers(self, prefix_key: str | None) -> dict[str, str]:
        if self.session_header is None or prefix_key is None:
            return {}
        return {self.session_header: prefix_key}


def request_form(peer: str, policy: str) -> RequestForm:
    if peer == "vllm-router" and policy == "kv_aware":
        return RequestForm("tokens")  # indexes token IDs; no local tokenizer here
    if peer == "vllm-router" and policy == "consistent_hash":
        return RequestForm("chat", "X-Session-ID")
    return RequestForm("chat")  # smg: text prompts only


# --- installation --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PeerInstall:
    name: str
    requirement: str
    venv: Path
    executable: Path
    version: str
    install_s: float  # wall time of the install that made this venv (recorded in its marker)
    reused: bool  # an existing complete venv was used this time
    size_bytes: int


def _dir_bytes(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, f)).st_size
    return total


def _complete(spec: PeerSpec, venv: Path) -> dict[str, Any] | None:
    """The marker of a complete install of `spec` in `venv`, or None (absent, other requirement,
    executable or dist-info missing: an interrupted or foreign venv)."""
    try:
        marker = json.loads((venv / MARKER).read_text())
    except (OSError, ValueError):
        return None
    exe = venv / "bin" / spec.executable
    dist_info = list(venv.glob(f"lib/python*/site-packages/{spec.dist}-{spec.version}.dist-info"))
    if (not isinstance(marker, dict) or marker.get("requirement") != spec.requirement
            or not os.access(exe, os.X_OK) or not (venv / "bin" / "python").exists()
            or not dist_info):
        return None
    return marker


def _reason(step: str, proc: subprocess.CompletedProcess[str]) -> str:
    lines = [ln.strip() for ln in (proc.stderr + "\n" + proc.stdout).splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR")]
    useful = [ln for ln in lines if not ln.startswith("WARNING")]
    last = (errors or useful or ["no output"])[-1]
    return f"{step} failed (exit {proc.returncode}): {last[:300]}"


def ensure_installed(name: str, *, peers_dir: Path = PEERS_DIR,
                     timeout_s: float = INSTALL_TIMEOUT_S) -> PeerInstall | str:
    """Install peer `name` into `peers_dir/name` unless a complete install is there. Blocking
    (pip runs for seconds to minutes): from async code call it with `asyncio.to_thread`."""
    spec = PEERS.get(name)
    if spec is None:
        return f"unknown peer {name!r} (known: {', '.join(PEERS)})"
    venv = peers_dir / name
    try:
        peers_dir.mkdir(parents=True, exist_ok=True)
        lock = (peers_dir / f".{name}.lock").open("w")
    except OSError as e:
        return f"cannot create {peers_dir}: {e}"
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another benchmark installing the same peer
        marker = _complete(spec, venv)
        reused = marker is not None
        if marker is None:
            started = time.monotonic()
            if venv.exists():
                shutil.rmtree(venv, ignore_errors=True)  # half-made by an interrupted install
            python = shutil.which("python3") or sys.executable
            steps = (
                ("python3 -m venv", [python, "-m", "venv", str(venv)]),
                (f"pip install {spec.requirement}",
                 [str(venv / "bin" / "pip"), "install", "--disable-pip-version-check",
                  "--no-input", "-q", spec.requirement]),
            )
            for step, cmd in steps:
                try:
                    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                                          check=False)
                except subprocess.TimeoutExpired:
                    return f"{step} did not finish within {timeout_s:.0f} s"
                except OSError as e:
                    return f"{step} could not run: {e}"
                if proc.returncode != 0:
                    return _reason(step, proc)
            marker = {"requirement": spec.requirement, "install_s": round(time.monotonic()
                      - started, 1), "installed_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
            if not os.access(venv / "bin" / spec.executable, os.X_OK):
                return f"installed {spec.requirement} but {venv}/bin/{spec.executable} is missing"
            tmp = venv / (MARKER + ".tmp")
            tmp.write_text(json.dumps(marker))
            os.replace(tmp, venv / MARKER)  # written last: its presence means complete
    return PeerInstall(name, spec.requirement, venv, venv / "bin" / spec.executable, spec.version,
                       float(marker.get("install_s", 0.0)), reused, _dir_bytes(venv))


# --- running a router ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """One engine as a router sees it."""

    url: str  # http://127.0.0.1:PORT
    kv_events: str | None = None  # tcp://127.0.0.1:Z, the engine's bound PUB (kv_aware)
    kv_replay: str | None = None  # tcp://127.0.0.1:R, the engine's bound replay ROUTER


class RouterStartError(RuntimeError):
    """The router exited or did not become ready; the message carries its log's tail."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def router_command(install: PeerInstall, policy: str, workers: Sequence[WorkerSpec], *,
                   port: int, metrics_port: int, model: str,
                   extra_args: Sequence[str] = ()) -> list[str]:
    """The command line that starts `install`'s router (pure: printed in reports)."""
    spec = PEERS[install.name]
    if policy not in spec.policies:
        raise ValueError(f"{install.name} policy {policy!r}: supported {spec.policies}")
    cmd = [str(install.executable), *spec.subcommand, "--host", "127.0.0.1", "--port", str(port),
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
           "--worker-urls", *(w.url for w in workers), "--policy", policy,
           "--worker-startup-check-interval", "1"]
    if install.name == "smg":
        cmd += ["--shutdown-grace-period-secs", "2"]  # default 180 s of waiting on SIGTERM
    if install.name == "vllm-router" and policy == "kv_aware":
        missing = [w.url for w in workers if w.kv_events is None]
        if missing:
            raise ValueError(f"kv_aware needs a kv_events endpoint for {missing}")
        for w in workers:
            cmd += ["--kv-event-source", f"{w.url}={w.kv_events}"]
        for w in workers:
            if w.kv_replay is not None:
                cmd += ["--kv-event-replay-source", f"{w.url}={w.kv_replay}"]
        cmd += ["--kv-event-block-size", "16", "--kv-event-model", model]
    return [*cmd, *extra_args]


@dataclass(slots=True)
class RunningRouter:
    peer: str
    policy: str
    base_url: str
    process: asyncio.subprocess.Process
    command: list[str]
    log_path: Path
    form: RequestForm
    workers: tuple[WorkerSpec, ...]
    metrics_url: str  # its Prometheus endpoint
    ready_s: float = 0.0  # spawn -> routable

    def log_tail(self, lines: int = 30, *, problems_only: bool = False) -> str:
        """The last `lines` lines of the router's output, ANSI escapes removed; with
        `problems_only`, only WARN/ERROR/panic lines."""
        try:
            with self.log_path.open("rb") as f:
                f.seek(max(0, self.log_path.stat().st_size - 256 * 1024))
                text = f.read().decode("utf-8", "replace")
        except OSError as e:
            return f"(no log: {e})"
        rows = [_ANSI.sub("", ln) for ln in text.splitlines()]
        if problems_only:  # smg always warns that it runs without authentication: not news
            rows = [r for r in rows if re.search(r"\b(WARN|ERROR|error|panicked|Traceback)", r)
                    and "SECURITY POSTURE" not in r]
        return "\n".join(rows[-lines:])


def _child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k.lower() not in ("http_proxy", "https_proxy", "all_proxy")}
    env.update(NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost",
               HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    return env


def _open_log(log_dir: Path | None, peer: str, policy: str) -> tuple[Any, Path]:
    directory = log_dir or Path(tempfile.gettempdir())
    directory.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f"{peer}-{policy}-", suffix=".log", dir=directory)
    return os.fdopen(fd, "wb"), Path(name)


async def _ready(http: aiohttp.ClientSession, router: RunningRouter) -> str | None:
    """None once `router` routes to every worker, else what it is still waiting for."""
    want = {w.url.rstrip("/") for w in router.workers}
    timeout = aiohttp.ClientTimeout(total=2)
    if router.peer == "vllm-router":
        # It serves once ONE worker answered /health and then lists every worker healthy (and
        # its /health says "All servers healthy"): only its start-up log line tells.
        seen = _HOSTS_HEALTHY.findall(router.log_tail(400))
        if not seen:
            return "no 'unique hosts are healthy' line in its log yet"
        healthy_n, total_n = map(int, seen[-1])
        if healthy_n < len(want) or total_n < len(want):
            raise RouterStartError(f"vllm-router {router.policy} started with {healthy_n} of "
                                   f"{total_n} workers healthy (a worker did not answer /health)")
        async with http.get(router.base_url + "/health", timeout=timeout) as r:
            if r.status != 200:
                return f"/health {r.status}"
    async with http.get(router.base_url + "/workers", timeout=timeout) as r:
        if r.status != 200:
            return f"/workers {r.status}"
        listed = (await r.json(content_type=None)).get("workers", [])
    healthy = {str(w.get("url", "")).rstrip("/") for w in listed
               if w.get("is_healthy") and w.get("status", "ready") == "ready"}
    return None if want <= healthy else f"healthy {sorted(healthy)} of {sorted(want)}"


async def stop_process(proc: asyncio.subprocess.Process, timeout_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after `timeout_s`; reaped either way. If cancelled meanwhile, the
    process is killed before the cancellation goes on (the child watcher reaps it)."""
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.terminate()
    try:
        try:
            async with asyncio.timeout(timeout_s):
                await proc.wait()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        raise


async def _spawn(install: PeerInstall, policy: str, workers: Sequence[WorkerSpec], model: str,
                 log_dir: Path | None, extra_args: Sequence[str]) -> RunningRouter:
    port, metrics_port = free_port(), free_port()
    cmd = router_command(install, policy, workers, port=port, metrics_port=metrics_port,
                         model=model, extra_args=extra_args)
    argv = ["setpriv", "--pdeathsig", "KILL", "--", *cmd] if shutil.which("setpriv") else cmd
    log_file, log_path = _open_log(log_dir, install.name, policy)
    with log_file:  # the child keeps its own descriptor
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=log_file, stderr=log_file,
                env=_child_env(), start_new_session=True)
        except OSError as e:
            raise RouterStartError(f"{install.name} {policy} could not start: {e}") from e
    return RunningRouter(install.name, policy, f"http://127.0.0.1:{port}", proc, cmd, log_path,
                         request_form(install.name, policy), tuple(workers),
                         f"http://127.0.0.1:{metrics_port}/metrics")


async def _wait_ready(router: RunningRouter, timeout_s: float) -> None:
    started = time.monotonic()
    waiting = "no answer yet"
    name = f"{router.peer} {router.policy}"
    async with aiohttp.ClientSession() as http:
        while True:
            if router.process.returncode is not None:
                raise RouterStartError(f"{name} exited with {router.process.returncode}: "
                                       f"{router.log_tail(8)}")
            if time.monotonic() - started > timeout_s:
                raise RouterStartError(f"{name} not ready after {timeout_s:.0f} s ({waiting}): "
                                       f"{router.log_tail(1, problems_only=True)[:400]}")
            try:
                status = await _ready(http, router)
            except (aiohttp.ClientError, TimeoutError, ValueError) as e:
                status = f"{type(e).__name__}: {e}"
            if status is None:
                return
            waiting = status
            await asyncio.sleep(0.1)


@contextlib.asynccontextmanager
async def run_router(install: PeerInstall, policy: str, workers: Sequence[WorkerSpec], *,
                     model: str, ready_timeout_s: float = 60.0, stop_timeout_s: float = 10.0,
                     log_dir: Path | None = None,
                     extra_args: Sequence[str] = ()) -> AsyncIterator[RunningRouter]:
    """Start `install`'s router with `policy` in front of `workers` and yield it once it routes
    to all of them; raises RouterStartError (with the log tail) if it exits or is not ready
    within `ready_timeout_s`. The process is stopped and reaped on exit, cancellation included.
    The log is kept in `log_dir` if given, else it is a temp file removed at the end (a start
    error quotes its tail)."""

    async def stop(router: RunningRouter) -> None:
        try:
            await stop_process(router.process, stop_timeout_s)
        finally:
            if log_dir is None:
                router.log_path.unlink(missing_ok=True)

    for attempt in range(3):
        started = time.monotonic()
        router = await _spawn(install, policy, workers, model, log_dir, extra_args)
        try:
            await _wait_ready(router, ready_timeout_s)
        except RouterStartError as e:
            await stop(router)
            if attempt < 2 and "in use" in str(e).lower():
                continue  # lost a race for the free port
            raise
        except BaseException:
            await stop(router)
            raise
        break
    router.ready_s = time.monotonic() - started
    try:
        yield router
    finally:
        await stop(router)


# --- sending -------------------------------------------------------------------------------------

EngineOf = Callable[[Mapping[str, str], dict[str, Any] | None], str | None]


@dataclass(frozen=True, slots=True)
class Reply:
    status: int  # 0: no HTTP answer
    engine: str | None  # who served it (ENGINE_HEADER, or `engine_of`)
    routed_url: str | None  # smg's x-smg-routed-worker-id (the worker URL), None elsewhere
    ttft_s: float | None  # sent -> first SSE data event (not a keep-alive comment); whole body
    #                       when not streamed
    total_s: float
    chunks: int  # SSE data events other than [DONE]
    error: str | None = None
    body: dict[str, Any] | None = field(default=None, repr=False)  # non-streamed JSON


async def send_request(http: aiohttp.ClientSession, router: RunningRouter, *, model: str,
                       text: str | None = None, token_ids: Sequence[int] | None = None,
                       messages: Sequence[Mapping[str, Any]] | None = None,
                       prefix_key: str | None = None, max_tokens: int = 8, stream: bool = True,
                       engine_of: EngineOf | None = None, timeout_s: float = 120.0,
                       extra_body: Mapping[str, Any] | None = None) -> Reply:
    """One request through `router` in the form its policy needs (`router.form`): chat from
    `messages` or `text`, or a token-ID completion from `token_ids`, with the session header set
    to `prefix_key` where the policy keys on it. `engine_of(headers, first JSON object)` names
    the engine; by default the ENGINE_HEADER response header."""
    form = router.form
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "stream": stream}
    if form.form == "tokens":
        if token_ids is None:
            raise ValueError(f"{router.peer} {router.policy} needs token_ids")
        body["prompt"] = list(token_ids)
    else:
        if messages is None and text is None:
            raise ValueError(f"{router.peer} {router.policy} needs text or messages")
        body["messages"] = list(messages) if messages is not None else [
            {"role": "user", "content": text}]
    body.update(extra_body or {})
    started = time.perf_counter()
    first: float | None = None
    chunks = 0
    first_obj: dict[str, Any] | None = None
    try:
        async with http.post(router.base_url + form.path, json=body,
                             headers=form.headers(prefix_key),
                             timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            headers = {k.lower(): v for k, v in resp.headers.items()}
            if resp.status != 200 or not stream:
                raw = await resp.read()
                first = time.perf_counter()
                with contextlib.suppress(ValueError):
                    first_obj = json.loads(raw)
                if resp.status != 200:
                    return Reply(resp.status, None, headers.get(SMG_ROUTED_HEADER), None,
                                 first - started, 0, raw[:300].decode("utf-8", "replace"))
                chunks = 1
            else:
                async for line in resp.content:
                    data = line.strip()
                    if not data.startswith(b"data:"):
                        continue
                    data = data[5:].strip()
                    if data == b"[DONE]":
                        continue
                    chunks += 1
                    if first is None:
                        first = time.perf_counter()
                        with contextlib.suppress(ValueError):
                            first_obj = json.loads(data)
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:  # ValueError: an over-long line
        return Reply(0, None, None, None, time.perf_counter() - started, chunks,
                     f"{type(e).__name__}: {e}")
    total = time.perf_counter() - started
    engine = engine_of(headers, first_obj) if engine_of else headers.get(ENGINE_HEADER)
    return Reply(200, engine, headers.get(SMG_ROUTED_HEADER),
                 None if first is None else first - started, total, chunks,
                 None if first is not None else "stream ended without a data chunk",
                 first_obj if not stream else None)


# --- self-check: throwaway fake engines ----------------------------------------------------------

_MODEL = "selfcheck-model"
_BLOCK = 16
_SERVED = ("/v1/chat/completions", "/v1/completions")


def _fake_tokens(body: Mapping[str, Any]) -> list[int]:
    """The fake engines' tokenizer: UTF-8 bytes of the chat contents (or of a text prompt)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        return [int(t) for t in prompt]
    if isinstance(prompt, str):
        return list(prompt.encode())
    return list("".join(str(m.get("content", "")) for m in body.get("messages", [])).encode())


class FakeEngine:
    """An OpenAI-compatible stand-in that answers the peers' probes, names itself in
    ENGINE_HEADER, records what it was sent and (optionally) publishes KV events."""

    def __init__(self, name: str, *, render: bool = True) -> None:
        self.name = name
        self.render = render  # answer /v1/chat/completions/render and /tokenize
        self.seen: list[tuple[str, str, dict[str, str]]] = []  # (method, path, headers)
        self.publisher: Any = None
        self._runner: Any = None
        self.url = ""

    async def start(self, *, kv_events: bool) -> FakeEngine:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        if kv_events:
            from kv_listener.sim.publisher import SimPublisher  # noqa: PLC0415 - self-check only

            self.publisher = await SimPublisher("tcp://127.0.0.1:0", mode="bind",
                                                replay_endpoint="tcp://127.0.0.1:0").start()
        return self

    async def close(self) -> None:
        if self.publisher is not None:
            await self.publisher.close()
        if self._runner is not None:
            await self._runner.cleanup()

    def spec(self) -> WorkerSpec:
        def plain(endpoint: str | None) -> str | None:
            # SimPublisher's sockets are dual-stack: LAST_ENDPOINT reads tcp://[::ffff:127.0.0.1]:P
            return None if endpoint is None else endpoint.replace("[::ffff:127.0.0.1]", "127.0.0.1")

        pub = self.publisher
        return WorkerSpec(self.url, plain(pub.endpoint) if pub else None,
                          plain(pub.replay_endpoint) if pub else None)

    def publish_stored(self, tokens: Sequence[int]) -> None:
        """One vLLM 0.33 BlockStored for the full blocks of `tokens` (sha256-chained hashes)."""
        # Self-check only: the driver itself runs without the project's package.
        from kv_listener.core.model import BlockStored  # noqa: PLC0415
        from kv_listener.sim.encode import encode_vllm_batch  # noqa: PLC0415

        n = len(tokens) // _BLOCK * _BLOCK
        hashes, parent = [], b"\x00" * 32
        for i in range(0, n, _BLOCK):
            parent = hashlib.sha256(parent + array("I", tokens[i:i + _BLOCK]).tobytes()).digest()
            hashes.append(int.from_bytes(parent[-8:], "big"))
        ev = BlockStored(tuple(hashes), None, array("I", tokens[:n]), _BLOCK, medium="GPU")
        self.publisher.publish(encode_vllm_batch([ev], ts=time.time()))

    def probes(self) -> list[str]:
        return sorted({f"{m} {p}" for m, p, _ in self.seen if p not in _SERVED})

    async def _handle(self, req: Any) -> Any:
        raw = await req.read()
        self.seen.append((req.method, req.path, dict(req.headers)))
        body: dict[str, Any] = {}
        with contextlib.suppress(ValueError):
            body = json.loads(raw) if raw else {}
        path = req.path
        if path == "/health":
            return web.Response(text="")
        if path == "/v1/models":
            return web.json_response({"object": "list", "data": [
                {"id": _MODEL, "object": "model", "owned_by": "selfcheck", "max_model_len": 4096}]})
        if path == "/version":
            return web.json_response({"version": "0.11.0"})
        if path in ("/v1/loads", "/loads"):
            return web.json_response({"dp_rank_count": 1, "loads": [
                {"dp_rank": 0, "num_running_reqs": 0, "num_waiting_reqs": 0,
                 "max_total_num_tokens": 65536, "token_usage": 0.0}]})
        if path == "/get_load":
            return web.json_response({"load": 0})
        if path == "/metrics":
            return web.Response(text="vllm:kv_cache_usage_perc 0.0\n")
        if self.render and path == "/v1/chat/completions/render":
            return web.json_response({"model": _MODEL, "token_ids": _fake_tokens(body),
                                      "features": None, "sampling_params": {}})
        if self.render and path == "/tokenize":
            toks = _fake_tokens(body)
            return web.json_response({"count": len(toks), "max_model_len": 4096, "tokens": toks})
        if path not in _SERVED:
            return web.Response(status=404)
        chat = path == "/v1/chat/completions"
        kind = "chat.completion" if chat else "text_completion"
        headers = {ENGINE_HEADER: self.name}
        if not body.get("stream"):
            choice = ({"index": 0, "message": {"role": "assistant", "content": "ok"},
                       "finish_reason": "stop"} if chat else
                      {"index": 0, "text": "ok", "finish_reason": "stop"})
            return web.json_response({"id": "x", "object": kind, "model": _MODEL,
                                      "choices": [choice], "x_engine": self.name},
                                     headers=headers)
        resp = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream"})
        await resp.prepare(req)
        await asyncio.sleep(0.02)  # a visible TTFT
        for _ in range(3):
            delta = {"delta": {"content": "a"}} if chat else {"text": "a"}
            chunk = {"id": "x", "object": kind + ".chunk" if chat else kind, "model": _MODEL,
                     "choices": [{"index": 0, **delta, "finish_reason": None}]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


@dataclass(slots=True)
class _Run:
    peer: str
    policy: str
    command: str = ""
    ready_s: float = 0.0
    stop_s: float = 0.0
    checks: list[tuple[str, bool, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    probes: list[str] = field(default_factory=list)

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        self.checks.append((name, ok, detail))


async def _behaviour(run: _Run, router: RunningRouter, http: aiohttp.ClientSession,
                     engines: list[FakeEngine]) -> None:
    async def send(i: int | str, **kw: Any) -> Reply:
        toks = [(hash(str(i)) + j) % 30000 + 1000 for j in range(72)]
        return await send_request(http, router, model=_MODEL, text=f"prompt {i} " + "x" * 40,
                                  token_ids=toks, **kw)

    by_url = {e.url: e.name for e in engines}
    plain = await send("plain", stream=False)
    run.check("non-streamed request", plain.status == 200 and plain.engine is not None,
              f"HTTP {plain.status} engine={plain.engine} {plain.error or ''}")
    streamed = await send("streamed")
    run.check("streamed request", streamed.status == 200 and streamed.chunks == 3
              and streamed.engine is not None,
              f"HTTP {streamed.status} engine={streamed.engine} chunks={streamed.chunks} "
              f"ttft={1000 * (streamed.ttft_s or 0):.1f} ms {streamed.error or ''}")
    run.check("response header x-engine-name passes", streamed.engine is not None,
              f"routed_url={streamed.routed_url} -> {by_url.get(streamed.routed_url or '')}")
    policy = router.policy
    if policy == "round_robin":
        got = [(await send(i)).engine for i in range(6)]
        run.check("round_robin uses every engine", set(got) == {e.name for e in engines}, str(got))
    elif policy in ("cache_aware", "prefix_hash"):
        head = "shared head " * 100  # 1200 characters: past prefix_hash's 1024
        got = [(await send_request(http, router, model=_MODEL, text=head + f"tail {i}")).engine
               for i in range(4)]
        run.check(f"{policy}: one prefix stays on one engine", len(set(got[1:])) == 1, str(got))
    elif policy == "consistent_hash":
        pairs = [((await send(k, prefix_key=f"key-{k}")).engine,
                  (await send(f"{k}b", prefix_key=f"key-{k}")).engine) for k in range(6)]
        same = all(a == b for a, b in pairs)
        run.check("consistent_hash: X-Session-ID pins", same and len({a for a, _ in pairs}) > 1,
                  str(pairs))
        seen = [v for e in engines for _m, p, h in e.seen if p in _SERVED
                for k, v in h.items() if k.lower() == "x-session-id"]
        run.notes.append(f"X-Session-ID reaches the engine: {any(seen)}")
    elif policy == "kv_aware":
        await _kv_aware(run, router, http, engines)


async def _kv_aware(run: _Run, router: RunningRouter, http: aiohttp.ClientSession,
                    engines: list[FakeEngine]) -> None:
    subs = []
    for e in engines:
        with contextlib.suppress(TimeoutError):
            await e.publisher.wait_for_subscriber(1, timeout_s=5.0)
        subs.append(e.publisher.subscribed)
    run.check("kv_aware: its SUB connects to every engine's PUB", all(subs),
              f"subscriptions {subs}, topics {[e.publisher.subscriptions[:1] for e in engines]}")
    replays = [list(e.publisher.replay_requests) for e in engines]
    run.notes.append(f"replay requests (start seq) per engine before any event: {replays}")
    spread = [(await send_request(http, router, model=_MODEL,
                                  token_ids=[7000 + i] * 40)).engine for i in range(6)]
    run.notes.append(f"kv_aware, 6 distinct prompts with no event yet, one at a time: {spread}")
    for target, seed in ((2, 11), (1, 23), (0, 37)):
        tokens = [(seed * 997 + j * 31) % 30000 + 1000 for j in range(8 * _BLOCK)]
        engines[target].publish_stored(tokens)
        await asyncio.sleep(0.5)  # no ingestion signal to await: a fixed bound
        got = [(await send_request(http, router, model=_MODEL,
                                   token_ids=[*tokens, 5, 6, 7 + i])).engine for i in range(3)]
        run.check(f"kv_aware: 8 cached blocks on {engines[target].name} route there",
                  got == [engines[target].name] * 3, str(got))
    # A batch lost on the wire (seq gap), kept in the engine's replay buffer: asked for again?
    pub = engines[1].publisher
    lost = [(4242 + j * 7) % 30000 + 1000 for j in range(8 * _BLOCK)]
    pub.drop_next(1)
    engines[1].publish_stored(lost)
    engines[1].publish_stored([999] * _BLOCK)  # the next seq reveals the gap
    await asyncio.sleep(0.5)
    got = [(await send_request(http, router, model=_MODEL, token_ids=[*lost, 1, i])).engine
           for i in range(3)]
    run.notes.append(f"kv_aware after a seq gap on {engines[1].name}: replay requests "
                     f"{pub.replay_requests}, the lost batch's prompt went to {got}")
    # Chat through kv_aware, with the engines answering /render (informational).
    chat = dataclasses.replace(router, form=RequestForm("chat"))
    for target in (2, 1):
        text = f"chat through kv_aware to {target} " * 12
        engines[target].publish_stored(list(text.encode()))
        await asyncio.sleep(0.5)
        replies = [await send_request(http, chat, model=_MODEL, text=text + str(i))
                   for i in range(3)]
        run.notes.append("kv_aware with chat (engines answer /render; events for the rendered "
                         f"tokens on {engines[target].name}): "
                         f"{[(r.status, r.engine, (r.error or '')[:80]) for r in replies]}")


async def _one(install: PeerInstall, policy: str, http: aiohttp.ClientSession,
               render: bool = True) -> _Run:
    run = _Run(install.name, policy + ("" if render else " (no /render)"))
    kv = install.name == "vllm-router" and policy == "kv_aware"
    engines = [await FakeEngine(f"e{i}", render=render).start(kv_events=kv) for i in range(3)]
    try:
        async with run_router(install, policy, [e.spec() for e in engines],
                              model=_MODEL) as router:
            run.command = " ".join(router.command)
            run.ready_s = router.ready_s
            if kv:
                first = await send_request(http, router, model=_MODEL, token_ids=list(range(40)))
                run.notes.append(f"kv_aware before any event: HTTP {first.status}, engine "
                                 f"{first.engine} {first.error or ''}")
            await _behaviour(run, router, http, engines)
            async with http.get(router.metrics_url) as m:
                metrics = await m.text()
            run.notes.append(f"{router.metrics_url}: HTTP {m.status}, {len(metrics.splitlines())} "
                             "lines")
            problems = [ln[:240] for ln in router.log_tail(6, problems_only=True).splitlines()]
            if problems:
                run.notes.append("log problems:\n      " + "\n      ".join(problems))
            t0 = time.monotonic()
        run.stop_s = time.monotonic() - t0
        run.check("stopped and reaped", router.process.returncode is not None,
                  f"exit {router.process.returncode} after {run.stop_s:.2f} s")
        calls = sorted({p for e in engines for _m, p, _h in e.seen if p in (
            "/v1/chat/completions/render", "/tokenize")})
        if calls:
            run.notes.append(f"called on engines around chat requests: {calls}")
    except RouterStartError as exc:
        run.check("router starts", False, str(exc))
    finally:
        run.probes = sorted({p for e in engines for p in e.probes()})
        for e in engines:
            await e.close()
    return run


async def _cancel_check(install: PeerInstall, http: aiohttp.ClientSession) -> _Run:
    """A benchmark cancelled while the router runs must leave no process behind."""
    run = _Run(install.name, "cancelled while running")
    engines = [await FakeEngine(f"e{i}").start(kv_events=False) for i in range(2)]
    holder: list[RunningRouter] = []
    ready = asyncio.Event()

    async def body() -> None:
        async with run_router(install, PEERS[install.name].policies[-1],
                              [e.spec() for e in engines], model=_MODEL) as router:
            holder.append(router)
            ready.set()
            await asyncio.sleep(3600)

    task = asyncio.create_task(body())
    try:
        async with asyncio.timeout(60):
            await ready.wait()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        proc = holder[0].process
        alive = True
        try:
            os.kill(proc.pid, 0)
        except ProcessLookupError:
            alive = False
        run.check("cancelled: process stopped and reaped", proc.returncode is not None
                  and not alive, f"returncode {proc.returncode}, pid alive {alive}")
    finally:
        task.cancel()
        for e in engines:
            await e.close()
    return run


async def _dead_worker_check(install: PeerInstall) -> _Run:
    """A worker that never answers: a bounded RouterStartError naming what it waited for."""
    run = _Run(install.name, "one worker down")
    engine = await FakeEngine("e0").start(kv_events=False)
    dead = WorkerSpec(f"http://127.0.0.1:{free_port()}")
    t0 = time.monotonic()
    try:
        async with run_router(install, PEERS[install.name].policies[-1], [engine.spec(), dead],
                              model=_MODEL, ready_timeout_s=5.0) as router:
            run.check("a dead worker stops the start", False, f"ready: {router.base_url}")
    except RouterStartError as e:
        run.check("a dead worker stops the start", time.monotonic() - t0 < 15,
                  f"after {time.monotonic() - t0:.1f} s: {str(e)[:200]}")
    finally:
        await engine.close()
    return run


def _print(run: _Run) -> None:
    print(f"\n== {run.peer} {run.policy}  ready {run.ready_s:.2f} s  stop {run.stop_s:.2f} s")
    if run.command:
        print(f"   $ {run.command}")
    for name, ok, detail in run.checks:
        print(f"   [{'ok' if ok else 'FAIL'}] {name}: {detail}")
    for note in run.notes:
        print(f"   - {note}")
    if run.probes:
        print(f"   probes on the engines: {', '.join(run.probes)}")


async def _selfcheck_async(installs: list[PeerInstall]) -> bool:
    ok = True
    async with aiohttp.ClientSession() as http:
        for install in installs:
            runs = [await _one(install, p, http) for p in PEERS[install.name].policies]
            if install.name == "vllm-router":
                runs.append(await _one(install, "cache_aware", http, render=False))
            runs.append(await _cancel_check(install, http))
            runs.append(await _dead_worker_check(install))
            for run in runs:
                _print(run)
                ok &= all(c[1] for c in run.checks)
    return ok


def _selfcheck() -> int:
    sys.path.insert(0, str(ROOT))
    installs: list[PeerInstall] = []
    for name in PEERS:
        got = ensure_installed(name)
        if isinstance(got, str):
            print(f"{name}: not installed: {got}")
            continue
        how = "reused" if got.reused else "installed now"
        print(f"{name} {got.version}: {got.executable} ({how}; install took {got.install_s:.1f} s;"
              f" venv {got.size_bytes / 1e6:.0f} MB)")
        installs.append(got)
    assert _complete(PEERS["smg"], Path(tempfile.mkdtemp())) is None  # an empty dir is no venv
    ok = asyncio.run(_selfcheck_async(installs))
    print(f"\nself-check {'passed' if ok else 'FAILED'} for {[i.name for i in installs]}")
    return 0 if ok and installs else 1


if __name__ == "__main__":
    # No options, but `--help` must say what this does instead of starting the peers.
    argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0]).parse_args()
    quiet_libraries()
    sys.exit(_selfcheck())
