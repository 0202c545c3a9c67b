"""Typed, frozen configuration of the listener, loaded from YAML (SPEC section 9).

Owns: the listener file's key names and their defaults (written once, in the dataclasses below),
and its validation rules. Every error names its YAML path (`sources[1].zmq_endpoint: ...`) and
all errors of a file are reported together in one `ConfigError`. Warnings are things that work
but are probably not what the operator meant. The reading machinery the router's file shares
(strict YAML, `Reader`, durations, URLs, the log block, secrets) is `kv_listener.configkit`;
its names are re-exported here for the listener's own modules.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kv_listener.configkit import (
    BACKEND_NAME_RE,
    ConfigError,
    LogConfig,
    Reader,
    YamlContentError,
    check_url,
    did_you_mean,
    is_loopback,
    is_router_file,
    parse_duration,
    parse_listen,
    parse_log,
    read_secret,
    read_yaml,
    root_mapping,
    type_name,
)
from kv_listener.core.limits import Limits
from kv_listener.core.model import Engine

# This module's names, plus the toolkit's that the listener's modules (and older callers) import
# from here; the router imports the toolkit itself.
__all__ = [
    "BACKEND_NAME_RE",
    "LISTENER_TOP_KEYS",
    "BackoffConfig",
    "CacheSaltConfig",
    "ConfigError",
    "Engine",
    "EventBusConfig",
    "Limits",
    "ListenerConfig",
    "LogConfig",
    "SourceConfig",
    "YamlContentError",
    "check_url",
    "did_you_mean",
    "host_allowed",
    "is_loopback",
    "load_config",
    "parse_config",
    "parse_duration",
    "parse_listen",
    "read_secret",
    "read_yaml",
    "type_name",
]

#: An RFC 1123 host name: an `allowed_publishers` entry that is neither an address nor a network.
_HOSTNAME_RE = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$"
)


@dataclass(frozen=True, slots=True)
class CacheSaltConfig:
    secret_file: str | None = None
    secret_env: str | None = None

    @property
    def enabled(self) -> bool:
        return self.secret_file is not None or self.secret_env is not None


@dataclass(frozen=True, slots=True)
class BackoffConfig:
    """`event_bus.reconnect_backoff`: the push client's retry delays (`kv_listener.backoff`
    applies them)."""

    initial_s: float = 1.0
    max_s: float = 60.0


@dataclass(frozen=True, slots=True)
class EventBusConfig:
    url: str
    client_id: str = "kv-listener-a"
    ca_file: str | None = None
    tls_server_name: str | None = None
    credential_file: str | None = None
    credential_env: str | None = None
    client_cert_file: str | None = None
    client_key_file: str | None = None
    reconnect_backoff: BackoffConfig = field(default_factory=BackoffConfig)
    connect_timeout_s: float = 5.0
    drain_deadline_s: float = 5.0


@dataclass(frozen=True, slots=True)
class SourceConfig:
    backend_name: str
    engine: Engine
    model: str
    zmq_endpoint: str | None = None
    zmq_mode: str = "bind"
    zmq_topic: str = ""
    replay_endpoint: str | None = None
    detokenize_endpoint: str | None = None
    tokenizer: str | None = None
    trtllm_endpoint: str | None = None
    poll_interval_s: float = 0.1
    allowed_publishers: tuple[str, ...] = ("127.0.0.1",)
    chat_template: str | None = None
    limits: Limits = field(default_factory=Limits)
    #: Engine liveness (vllm, sglang): `GET` this URL every `health_interval_s`; None: `/health`
    #: beside `detokenize_endpoint` (no liveness without either). TRT-LLM: its poll is the check.
    health_endpoint: str | None = None
    health_interval_s: float = 1.0
    #: An engine with no sign of life (health answer, ZMQ batch, successful poll) for this long
    #: is down: its source is cleared (`engine_down`) and not ready. None: never.
    engine_down_after_s: float | None = 10.0


@dataclass(frozen=True, slots=True)
class ListenerConfig:
    listen_host: str = "127.0.0.1"
    listen_port: int = 7817
    log: LogConfig = field(default_factory=LogConfig)
    limits: Limits = field(default_factory=Limits)
    max_prefix_length: int = 1024
    history_size: int = 100000
    max_lag: int = 10000
    update_interval_s: float = 0.25
    max_sse_clients: int = 256
    cache_salt: CacheSaltConfig = field(default_factory=CacheSaltConfig)
    event_bus: EventBusConfig | None = None
    sources: tuple[SourceConfig, ...] = ()
    warnings: tuple[str, ...] = field(default=(), compare=False)

    def source(self, backend_name: str) -> SourceConfig | None:
        return next((s for s in self.sources if s.backend_name == backend_name), None)


def _limits(r: Reader, raw: Any, path: str, base: Limits) -> Limits:
    allowed = {f.name for f in dataclasses.fields(Limits)}
    data = r.mapping(raw, path, allowed)
    lim = Limits(
        max_chain_tokens=r.int_range(data, "max_chain_tokens", path, base.max_chain_tokens, 1, 1 << 24),
        max_tracked_blocks=r.int_range(data, "max_tracked_blocks", path, base.max_tracked_blocks, 1, 1 << 30),
        max_retained_tokens=r.int_range(
            data, "max_retained_tokens", path, base.max_retained_tokens, 0, 1 << 32
        ),
        max_message_bytes=r.int_range(
            data, "max_message_bytes", path, base.max_message_bytes, 1024, 1 << 31
        ),
        max_event_tokens=r.int_range(data, "max_event_tokens", path, base.max_event_tokens, 1, 1 << 28),
        max_event_hashes=r.int_range(data, "max_event_hashes", path, base.max_event_hashes, 1, 1 << 24),
    )
    return lim


def _zmq_endpoint(r: Reader, path: str, value: str | None) -> str | None:
    if value is None:
        return None
    m = re.match(r"^(tcp|ipc|inproc)://(.+)$", value)
    if not m:
        r.error(
            path, f"invalid ZMQ endpoint {value!r} (expected tcp://host:port, ipc://path or inproc://name)"
        )
        return None
    if m.group(1) == "tcp":
        host, sep, port = m.group(2).rpartition(":")
        if not sep or not host or not (port.isdigit() or port == "*"):
            r.error(path, f"invalid ZMQ endpoint {value!r} (tcp needs host:port)")
            return None
    return value


def _publisher(r: Reader, path: str, value: Any) -> str | None:
    if not isinstance(value, str):
        r.error(path, f"expected a string, got {type_name(value)}")
        return None
    try:
        ipaddress.ip_network(value, strict=False)
        return value
    except ValueError:
        pass
    if _HOSTNAME_RE.match(value):
        return value
    r.error(path, f"{value!r} is neither an IP address, a network (CIDR) nor a host name")
    return None


def _source(r: Reader, raw: Any, path: str, top_limits: Limits, salt_enabled: bool) -> SourceConfig | None:
    allowed = {
        "backend_name",
        "engine",
        "model",
        "zmq_endpoint",
        "zmq_mode",
        "zmq_topic",
        "replay_endpoint",
        "detokenize_endpoint",
        "tokenizer",
        "trtllm_endpoint",
        "poll_interval",
        "allowed_publishers",
        "chat_template",
        "limits",
        "health_endpoint",
        "health_interval",
        "engine_down_after",
    }
    data = r.entry(raw, path, allowed)
    if data is None:
        return None
    n_errors = len(r.errors)

    name = r.name(data, "backend_name", path)
    engine = r.enum(data, "engine", path, Engine)

    model = r.typed(data, "model", path, str, "")
    if "model" not in data:
        r.error(f"{path}.model", "is required (the router-facing model name)")
    elif not model:
        r.error(f"{path}.model", "must not be empty")

    zmq_endpoint = _zmq_endpoint(
        r, f"{path}.zmq_endpoint", r.typed(data, "zmq_endpoint", path, str, None, nullable=True)
    )
    replay_endpoint = _zmq_endpoint(
        r, f"{path}.replay_endpoint", r.typed(data, "replay_endpoint", path, str, None, nullable=True)
    )
    zmq_mode = r.choice(data, "zmq_mode", path, "bind", ("bind", "connect"))
    zmq_topic = r.typed(data, "zmq_topic", path, str, "")
    detok = check_url(
        r,
        f"{path}.detokenize_endpoint",
        r.typed(data, "detokenize_endpoint", path, str, None, nullable=True),
        ("http", "https"),
    )
    trtllm = check_url(
        r,
        f"{path}.trtllm_endpoint",
        r.typed(data, "trtllm_endpoint", path, str, None, nullable=True),
        ("http", "https"),
    )
    tokenizer = r.typed(data, "tokenizer", path, str, None, nullable=True)
    r.existing_file(f"{path}.tokenizer", tokenizer, directory=True)
    chat_template = r.typed(data, "chat_template", path, str, None, nullable=True)
    r.existing_file(f"{path}.chat_template", chat_template)
    poll = r.duration(data, "poll_interval", path, 0.1, lo=0.01, hi=60.0)
    health = check_url(
        r,
        f"{path}.health_endpoint",
        r.typed(data, "health_endpoint", path, str, None, nullable=True),
        ("http", "https"),
    )
    health_interval = r.duration(data, "health_interval", path, 1.0, lo=0.05, hi=60.0)
    down_after: float | None = None
    if data.get("engine_down_after", "10s") is not None:
        down_after = r.duration(data, "engine_down_after", path, 10.0, lo=0.1, hi=86400.0)
        if down_after < health_interval:
            r.error(f"{path}.engine_down_after",
                    f"must be at least health_interval ({health_interval:g}s), got {down_after:g}s")

    publishers: list[str] = []
    raw_pubs = data.get("allowed_publishers", ["127.0.0.1"])
    if not isinstance(raw_pubs, list):
        r.error(f"{path}.allowed_publishers", f"expected a list, got {type_name(raw_pubs)}")
    else:
        for i, item in enumerate(raw_pubs):
            pub = _publisher(r, f"{path}.allowed_publishers[{i}]", item)
            if pub is not None:
                publishers.append(pub)
        if not raw_pubs:
            r.error(f"{path}.allowed_publishers", "must not be empty (no engine could publish)")

    limits = (
        top_limits if data.get("limits") is None else _limits(r, data["limits"], f"{path}.limits", top_limits)
    )

    if engine in (Engine.VLLM, Engine.SGLANG):
        if zmq_endpoint is None and "zmq_endpoint" not in data:
            r.error(f"{path}.zmq_endpoint", f"is required for engine {engine.value}")
        if "trtllm_endpoint" in data and data["trtllm_endpoint"] is not None:
            r.error(f"{path}.trtllm_endpoint", f"is only for engine trtllm, not {engine.value}")
        if detok is None and tokenizer is None:
            r.warn(
                path,
                "neither detokenize_endpoint nor tokenizer is set: only salted chains "
                "can be attributed" + ("" if salt_enabled else ", and cache_salt is not configured either"),
            )
        if detok is None and health is None and down_after is not None:
            r.warn(
                path,
                "no detokenize_endpoint and no health_endpoint: engine liveness is not checked, "
                "so a dead engine's prefixes stay live until the engine publishes again",
            )
    elif engine is Engine.TRTLLM:
        if trtllm is None and "trtllm_endpoint" not in data:
            r.error(f"{path}.trtllm_endpoint", "is required for engine trtllm")
        for key in ("zmq_endpoint", "replay_endpoint"):
            if data.get(key) is not None:
                r.error(f"{path}.{key}", "is only for engines vllm and sglang, not trtllm")
        if detok is not None:
            r.error(
                f"{path}.detokenize_endpoint",
                "trtllm-serve has no /detokenize; use a local tokenizer or cache salts",
            )
        if health is not None:
            r.error(f"{path}.health_endpoint",
                    "is only for engines vllm and sglang; a trtllm source's poll is its check")
        elif tokenizer is None and not salt_enabled:
            r.warn(
                path,
                "engine trtllm without a local tokenizer and without cache_salt: every "
                "chain will be discarded",
            )
        if trtllm is not None and publishers:
            host = urlsplit(trtllm).hostname or ""
            if not host_allowed(host, publishers):
                r.error(f"{path}.trtllm_endpoint", f"host {host!r} is not in allowed_publishers")
    if len(r.errors) != n_errors or engine is None:
        return None
    return SourceConfig(
        backend_name=name,
        engine=engine,
        model=model,
        zmq_endpoint=zmq_endpoint,
        zmq_mode=zmq_mode,
        zmq_topic=zmq_topic,
        replay_endpoint=replay_endpoint,
        detokenize_endpoint=detok,
        tokenizer=tokenizer,
        trtllm_endpoint=trtllm,
        poll_interval_s=poll,
        allowed_publishers=tuple(publishers),
        chat_template=chat_template,
        limits=limits,
        health_endpoint=health,
        health_interval_s=health_interval,
        engine_down_after_s=down_after,
    )


def host_allowed(host: str, publishers: tuple[str, ...] | list[str]) -> bool:
    """Is `host` (an IP or a name, as written in a URL) covered by `allowed_publishers`?"""
    try:
        addr = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return host.lower() in (p.lower() for p in publishers)
    for p in publishers:
        try:
            if addr in ipaddress.ip_network(p, strict=False):
                return True
        except ValueError:
            continue
    return False


def _cache_salt(r: Reader, raw: Any) -> CacheSaltConfig:
    data = r.mapping(raw, "cache_salt", {"secret_file", "secret_env"})
    secret_file = r.typed(data, "secret_file", "cache_salt", str, None, nullable=True)
    secret_env = r.typed(data, "secret_env", "cache_salt", str, None, nullable=True)
    r.not_both("cache_salt", ("secret_file", secret_file), ("secret_env", secret_env))
    r.existing_file("cache_salt.secret_file", secret_file)
    r.env_is_set("cache_salt.secret_env", secret_env)
    return CacheSaltConfig(secret_file=secret_file, secret_env=secret_env)


def _event_bus(r: Reader, raw: Any) -> EventBusConfig | None:
    if raw is None:
        return None
    p = "event_bus"
    allowed = {f.name for f in dataclasses.fields(EventBusConfig)} - {
        "connect_timeout_s",
        "drain_deadline_s",
    } | {"connect_timeout", "drain_deadline"}
    data = r.mapping(raw, p, allowed)
    n_errors = len(r.errors)
    url = r.typed(data, "url", p, str, "")
    if "url" not in data:
        r.error(f"{p}.url", "is required")
    else:
        check_url(r, f"{p}.url", url, ("https",))
    client_id = r.typed(data, "client_id", p, str, "kv-listener-a")
    if not BACKEND_NAME_RE.match(client_id):
        r.error(f"{p}.client_id", f"must match [A-Za-z0-9_-]{{1,64}}, got {client_id!r}")
    # The optional strings, by their field names (they are passed to EventBusConfig as they are).
    opt: dict[str, str | None] = {
        key: r.typed(data, key, p, str, None, nullable=True)
        for key in ("ca_file", "tls_server_name", "credential_file", "credential_env",
                    "client_cert_file", "client_key_file")
    }
    for key in ("ca_file", "credential_file", "client_cert_file", "client_key_file"):
        r.existing_file(f"{p}.{key}", opt[key])
    r.not_both(p, ("credential_file", opt["credential_file"]), ("credential_env", opt["credential_env"]))
    if (opt["client_cert_file"] is None) != (opt["client_key_file"] is None):
        r.error(p, "client_cert_file and client_key_file go together")
    if opt["credential_file"] is None and opt["credential_env"] is None and opt["client_cert_file"] is None:
        r.error(p, "no credential: set credential_file, credential_env or client_cert_file/client_key_file")
    r.env_is_set(f"{p}.credential_env", opt["credential_env"])
    bo = r.mapping(data.get("reconnect_backoff"), f"{p}.reconnect_backoff", {"initial", "max"})
    backoff = BackoffConfig(
        initial_s=r.duration(bo, "initial", f"{p}.reconnect_backoff", 1.0),
        max_s=r.duration(bo, "max", f"{p}.reconnect_backoff", 60.0),
    )
    if backoff.max_s < backoff.initial_s:
        r.error(f"{p}.reconnect_backoff", "max must not be below initial")
    connect_timeout = r.duration(data, "connect_timeout", p, 5.0, hi=600.0)
    drain_deadline = r.duration(data, "drain_deadline", p, 5.0, hi=600.0)
    if len(r.errors) != n_errors:
        return None
    return EventBusConfig(url=url, client_id=client_id, reconnect_backoff=backoff,
                          connect_timeout_s=connect_timeout, drain_deadline_s=drain_deadline, **opt)


LISTENER_TOP_KEYS = frozenset(
    {
        "listen",
        "log",
        "limits",
        "max_prefix_length",
        "history_size",
        "max_lag",
        "update_interval",
        "max_sse_clients",
        "cache_salt",
        "event_bus",
        "sources",
    }
)


def parse_config(raw: Any) -> ListenerConfig:
    """YAML tree -> `ListenerConfig`. Raises `ConfigError` listing every problem."""
    r = Reader()
    data = root_mapping(r, raw, LISTENER_TOP_KEYS)
    host, port = r.address(data, "listen", "", "127.0.0.1:7817") or ("127.0.0.1", 7817)
    log = parse_log(r, data.get("log"))
    limits = _limits(r, data.get("limits"), "limits", Limits())
    max_prefix_length = r.int_range(data, "max_prefix_length", "", 1024, 16, 1 << 20)
    history_size = r.int_range(data, "history_size", "", 100000, 1, 100_000_000)
    max_lag = r.int_range(data, "max_lag", "", 10000, 1, 100_000_000)
    update_interval = r.duration(data, "update_interval", "", 0.25, lo=0.0, hi=3600.0)
    max_sse_clients = r.int_range(data, "max_sse_clients", "", 256, 1, 1_000_000)
    cache_salt = _cache_salt(r, data.get("cache_salt"))
    event_bus = _event_bus(r, data.get("event_bus"))

    sources: list[SourceConfig] = []
    raw_sources = data.get("sources", [])
    if raw_sources is None:
        raw_sources = []
    if not isinstance(raw_sources, list):
        r.error("sources", f"expected a list, got {type_name(raw_sources)}")
        raw_sources = []
    seen: dict[str, int] = {}
    endpoints: dict[str, int] = {}
    for i, item in enumerate(raw_sources):
        src = _source(r, item, f"sources[{i}]", limits, cache_salt.enabled)
        # A duplicate name is reported whatever else is wrong with either entry: fixing the
        # other error first must not be what reveals it.
        name = item.get("backend_name") if isinstance(item, Mapping) else None
        if isinstance(name, str):
            if name in seen:
                r.error(f"sources[{i}].backend_name",
                        f"duplicate {name!r} (also sources[{seen[name]}])")
                continue
            seen[name] = i
        if src is None:
            continue
        if src.zmq_endpoint is not None and src.zmq_mode == "bind":
            if src.zmq_endpoint in endpoints:
                r.error(
                    f"sources[{i}].zmq_endpoint",
                    f"{src.zmq_endpoint!r} is already bound by sources[{endpoints[src.zmq_endpoint]}]",
                )
            endpoints[src.zmq_endpoint] = i
        sources.append(src)
    if not raw_sources:
        r.warn("sources", "no sources configured: the listener will serve no backend")
    if max_lag > history_size:
        r.warn(
            "max_lag",
            "is larger than history_size: a lagging consumer will get a resync rather than a buffer_overflow",
        )
    if event_bus is not None and not sources:
        r.warn("event_bus", "push mode is configured but there is no source to announce")

    if r.errors:
        raise ConfigError(r.errors)
    return ListenerConfig(
        listen_host=host, listen_port=port, log=log, limits=limits,
        max_prefix_length=max_prefix_length, history_size=history_size, max_lag=max_lag,
        update_interval_s=update_interval, max_sse_clients=max_sse_clients,
        cache_salt=cache_salt, event_bus=event_bus, sources=tuple(sources),
        warnings=tuple(r.warnings),
    )


def load_config(path: str | Path) -> ListenerConfig:
    """A listener file, checked exactly as `config validate` checks it: at start and on every
    SIGHUP. An empty file, or a router file, is not a listener configuration (it would otherwise
    parse as "all defaults, no sources" and a reload would stop every source)."""
    raw = read_yaml(path)
    if raw is None or raw == {}:
        raise ConfigError([f"{path}: the file is empty: not a listener configuration"])
    if is_router_file(raw):
        raise ConfigError([f"{path}: this is a router configuration (top-level 'kv_cache_index'); "
                           "run it with 'continuum-kv-listener router --config'"])
    return parse_config(raw)
