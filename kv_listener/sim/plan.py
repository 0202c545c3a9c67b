"""A listener file read from the simulated engines' side (pure: no sockets): per source, which
endpoint a simulated engine binds, connects to or serves, and which it skips, with a one-line
note saying why.

Owns the rules of `simulate` (kv_listener/simulate.py) about addresses: loopback only
(127.0.0.0/8, ::1, localhost as 127.0.0.1); a ZMQ endpoint in the opposite mode of the source
(a wildcard bind of the listener is reached at 127.0.0.1); the replay ROUTER binds; HTTP servers
plain http at the URL's address; one owner per address (a second source naming it is skipped).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from kv_listener.config import ListenerConfig, SourceConfig, host_allowed, is_loopback
from kv_listener.core.model import Engine
from kv_listener.resolver.template import DEMO_TOKENIZER_DIR
from kv_listener.sim.engine import WIRE_VERSIONS

_WILDCARDS = frozenset({"*", "0.0.0.0", "::", "[::]"})  # noqa: S104 - recognised, never bound

EngineMode = Literal["bind", "connect"]


@dataclass(frozen=True, slots=True)
class HttpAddr:
    host: str  # what to bind: 127.0.0.1, ::1 (localhost is 127.0.0.1)
    port: int
    path: str

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}{self.path}"


@dataclass(frozen=True, slots=True)
class EnginePlan:
    """What the simulated engine of one source serves; None where nothing is served."""

    index: int
    source: SourceConfig
    zmq_endpoint: str | None = None  # where the engine's PUB binds or connects
    zmq_mode: EngineMode = "connect"
    replay_endpoint: str | None = None  # the replay ROUTER (binds)
    http: HttpAddr | None = None  # the engine's HTTP server (root routes)
    health_path: str = "/health"  # also served by `http`
    health: HttpAddr | None = None  # a health server of its own
    trtllm: HttpAddr | None = None
    notes: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.source.backend_name

    @property
    def fed(self) -> bool:
        """Does the listener get this engine's events?"""
        return self.zmq_endpoint is not None or self.trtllm is not None

    @property
    def serves(self) -> bool:
        return self.fed or self.http is not None or self.health is not None

    def describe(self) -> str:
        src = self.source
        parts = []
        if self.zmq_endpoint is not None:
            how = ("connects, the listener binds" if self.zmq_mode == "connect"
                   else "binds, the listener connects")
            topic = f", topic {src.zmq_topic!r}" if src.zmq_topic else ""
            parts.append(f"KV events to {self.zmq_endpoint} ({how}{topic})")
        if self.replay_endpoint is not None:
            parts.append(f"replay on {self.replay_endpoint}")
        if self.http is not None:
            paths = "/detokenize /tokenize /tokenizer_info " + self.health_path
            parts.append(f"HTTP on {self.http.url.removesuffix(self.http.path)} ({paths})")
        if self.health is not None:
            parts.append(f"health on {self.health.url}")
        if self.trtllm is not None:
            parts.append(f"KV events on POST {self.trtllm.url}")
        version = "" if src.engine is Engine.TRTLLM else f" {WIRE_VERSIONS[src.engine.value]}"
        return f"{self.name} ({src.engine.value}{version}): " + ", ".join(parts or ["nothing"])


def _bind_host(host: str) -> str:
    host = host.strip("[]")
    return "127.0.0.1" if host.lower() == "localhost" else host


class _Planner:
    """Reads one source's endpoints; what cannot be served becomes a note."""

    def __init__(self, index: int, source: SourceConfig, taken: dict[str, str]) -> None:
        self.label = f"sources[{index}] {source.backend_name}"
        self.notes: list[str] = []
        self._taken = taken  # addresses the plan binds -> who binds them

    def skip(self, key: str, value: str, why: str) -> None:
        self.notes.append(f"{self.label}: {key} {value} skipped: {why}")

    def _claim(self, key: str, value: str, address: str) -> bool:
        owner = self._taken.get(address)
        if owner is not None:
            self.skip(key, value, f"{address} is already served for {owner}")
            return False
        self._taken[address] = self.label
        return True

    def http(self, key: str, url: str | None) -> HttpAddr | None:
        if url is None:
            return None
        parts = urlsplit(url)
        if parts.scheme != "http":
            self.skip(key, url, "the simulator serves plain http only")
            return None
        host = parts.hostname or ""
        if not is_loopback(host):
            self.skip(key, url, "not a loopback address (simulate serves 127.0.0.1, ::1 only)")
            return None
        addr = HttpAddr(_bind_host(host), parts.port or 80, parts.path or "/")
        return addr if self._claim(key, url, f"http {addr.host} {addr.port}") else None

    def zmq(self, key: str, endpoint: str | None, mode: EngineMode) -> str | None:
        """The endpoint the engine's socket binds or connects to (`mode` is the engine's)."""
        if endpoint is None:
            return None
        scheme, _, rest = endpoint.partition("://")
        if scheme == "ipc":  # a local socket file: nothing leaves the machine
            return endpoint if mode == "connect" or self._claim(key, endpoint, endpoint) else None
        if scheme != "tcp":
            self.skip(key, endpoint, f"{scheme}:// does not reach another process")
            return None
        host, _, port = rest.rpartition(":")
        if port == "*":
            self.skip(key, endpoint, "no fixed port to reach")
            return None
        if mode == "connect" and host in _WILDCARDS:
            # The listener binds every interface: loopback is one of them.
            return f"tcp://127.0.0.1:{port}"
        if not is_loopback(host):
            self.skip(key, endpoint, "not a loopback address (simulate binds and connects on "
                                     "127.0.0.1, ::1 only)")
            return None
        host = _bind_host(host)
        target = f"tcp://{host if ':' not in host else f'[{host}]'}:{port}"
        if mode == "bind" and not self._claim(key, endpoint, f"tcp {host} {port}"):
            return None
        return target


def plan_engines(cfg: ListenerConfig) -> list[EnginePlan]:
    """One plan per source, in file order."""
    taken: dict[str, str] = {}
    plans = []
    for i, src in enumerate(cfg.sources):
        p = _Planner(i, src, taken)
        if src.engine is Engine.TRTLLM:
            plans.append(EnginePlan(i, src, trtllm=p.http("trtllm_endpoint", src.trtllm_endpoint),
                                    notes=tuple(p.notes)))
            continue
        mode: EngineMode = "connect" if src.zmq_mode == "bind" else "bind"
        zmq_ep = p.zmq("zmq_endpoint", src.zmq_endpoint, mode)
        replay = p.zmq("replay_endpoint", src.replay_endpoint, "bind") if zmq_ep else None
        if zmq_ep is not None and mode == "connect" and zmq_ep.startswith("tcp://") \
                and not host_allowed("127.0.0.1", src.allowed_publishers):
            p.notes.append(f"{p.label}: allowed_publishers does not cover 127.0.0.1: the "
                           "listener will refuse the simulated engine")
        http = p.http("detokenize_endpoint", src.detokenize_endpoint)
        if http is not None and http.path != "/detokenize":
            p.skip("detokenize_endpoint", src.detokenize_endpoint or "",
                   "the simulated engine serves /detokenize at the root only")
            http = None
        health_path, health = "/health", None
        if src.health_endpoint is not None:
            parts = urlsplit(src.health_endpoint)
            same = (http is not None and parts.scheme == "http" and parts.hostname is not None
                    and _bind_host(parts.hostname) == http.host
                    and (parts.port or 80) == http.port)
            if same:
                health_path = parts.path or "/"
            else:
                health = p.http("health_endpoint", src.health_endpoint)
        if src.tokenizer is not None and Path(src.tokenizer).resolve() != DEMO_TOKENIZER_DIR:
            p.notes.append(f"{p.label}: tokenizer is not the shipped demo tokenizer the "
                           "simulated engines use: the listener may decode their prompts wrong")
        plans.append(EnginePlan(i, src, zmq_ep, mode, replay, http, health_path, health,
                                notes=tuple(p.notes)))
    return plans
