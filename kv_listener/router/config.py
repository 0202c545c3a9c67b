"""Typed, frozen configuration of the standalone companion router (SPEC §8 "Standalone run").

Owns: the router file's key names, defaults and validation. The file holds the seed's
`kv_cache_index` block, the seed's `dynamo.event_bus` block, Redis settings in the seed's
`response_cache.redis` shape (used when `kv_cache_index.backend: redis`), `admin` (`listen`, and
the optional bearer tokens of `auth`, stored as SHA-256 hashes as the bus's brokers are) and
`log`. It is read with `kv_listener.configkit`, as the listener's file is (and never with the
listener's `kv_listener.config`): unknown keys, wrong types and out-of-range values are errors
naming their YAML path, all reported at once in one `ConfigError`; settings that work but
probably do not do what the operator meant (the seed's `gpu_tier_weight < min_overlap_threshold`,
...) come back as `RouterConfig.warnings`.
"""

from __future__ import annotations

import dataclasses
import enum
import hmac
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
    check_url,
    is_loopback,
    parse_log,
    read_yaml,
    root_mapping,
    type_name,
)
from kv_listener.core import bus_protocol
from kv_listener.router.config_redis import (
    RedisConfig,
    WriterLeaseConfig,
    parse_redis,
    parse_writer_lease,
)

#: The seed's pool threshold (DEFAULT_SCORER_THRESHOLD): a KV-aware pick needs a composite > this.
POOL_THRESHOLD = 0.3
#: Tolerance of the "weights sum to 1.0" check (YAML decimals are binary floats).
WEIGHT_SUM_TOLERANCE = 1e-6
DEFAULT_KEY_PREFIX = "cr:kvidx:"
_TOKEN_HASH_HINT = ("must be 'sha256:' followed by 64 lowercase hex digits "
                    "(printf %s \"$TOKEN\" | sha256sum)")
# SCAN MATCH patterns are built from the key prefix (admin clear); glob characters in it would
# widen the match to other applications' keys.
_GLOB_CHARS = frozenset("*?[]\\")


class IndexBackend(enum.StrEnum):
    MEMORY = "memory"
    REDIS = "redis"


class Transport(enum.StrEnum):
    SSE = "sse"  # the consumer connects to the listener's GET /events/{backend}
    EVENT_BUS = "event_bus"  # the listener pushes into this router's event bus (SPEC §7)


class BrokerRole(enum.StrEnum):
    KV_LISTENER = "kv_listener"
    BROKER = "broker"


@dataclass(frozen=True, slots=True)
class ScoringConfig:
    """The six scoring parameters of the seed (`kv_cache_index.scoring`); the formula that uses
    them is `kv_listener.router.scorer`'s."""

    # The composite's three terms (overlap, spare load, health): they must sum to 1.0.
    overlap_weight: float = 0.6
    load_weight: float = 0.3
    health_weight: float = 0.1
    # A holder whose tiered overlap is below this scores 0.0, as if it had no copy.
    min_overlap_threshold: float = 0.3
    # The tier multipliers of the raw overlap: GPU-resident, then storage-warm copies.
    gpu_tier_weight: float = 1.0
    storage_tier_weight: float = 0.6

    def weight_sum_error(self) -> str | None:
        """None when the three main weights sum to 1.0 (within 1e-6), else the reason."""
        total = self.overlap_weight + self.load_weight + self.health_weight
        if abs(total - 1.0) > WEIGHT_SUM_TOLERANCE:
            return (f"overlap_weight + load_weight + health_weight must sum to 1.0, "
                    f"got {total:.6g}")
        return None


@dataclass(frozen=True, slots=True)
class StorageOffloadingConfig:
    enabled: bool = False
    treat_eviction_as_offload: bool = True


@dataclass(frozen=True, slots=True)
class EventSourceConfig:
    backend_name: str
    transport: Transport = Transport.SSE
    endpoint: str | None = None  # http, https, ws or wss; None with transport event_bus
    reconnect_interval_ms: int = 1000

    @property
    def reconnect_interval_s(self) -> float:
        return self.reconnect_interval_ms / 1000.0


@dataclass(frozen=True, slots=True)
class KvCacheIndexConfig:
    enabled: bool = True
    backend: IndexBackend = IndexBackend.MEMORY
    key_prefix: str = DEFAULT_KEY_PREFIX  # Redis key namespace (SPEC §8)
    max_entries: int = 100000  # (prefix, backend) entries of the in-memory index
    entry_ttl_seconds: int = 600
    scoring: ScoringConfig = field(default_factory=ScoringConfig)
    storage_offloading: StorageOffloadingConfig = field(default_factory=StorageOffloadingConfig)
    event_sources: tuple[EventSourceConfig, ...] = ()
    writer_lease: WriterLeaseConfig = field(default_factory=WriterLeaseConfig)

    def source(self, backend_name: str) -> EventSourceConfig | None:
        return next((s for s in self.event_sources if s.backend_name == backend_name), None)


def token_digest(token: str | bytes) -> str:
    """`sha256:<64 lowercase hex>` of a bearer token: the form the router file stores tokens in
    (`dynamo.event_bus.brokers[].token_hash`, `admin.auth.tokens[].token_hash`)."""
    return bus_protocol.token_hash(token.encode("utf-8") if isinstance(token, str) else token)


@dataclass(frozen=True, slots=True)
class BrokerConfig:
    """One credential of the event bus (`dynamo.event_bus.brokers[]`)."""

    id: str
    role: BrokerRole
    token_hash: str | None = None  # "sha256:<64 lowercase hex>" of the bearer token
    backends: tuple[str, ...] = ()

    def token_matches(self, token: str | bytes) -> bool:
        """Constant-time check of a presented bearer token against `token_hash`."""
        if self.token_hash is None:
            return False
        return hmac.compare_digest(token_digest(token), self.token_hash)


@dataclass(frozen=True, slots=True)
class BusTlsConfig:
    cert: str
    key: str
    client_ca: str | None = None  # enables mTLS client certificates (DNS SAN == broker id)


@dataclass(frozen=True, slots=True)
class EventBusServerConfig:
    enabled: bool = False
    listen_host: str = "0.0.0.0"  # noqa: S104 - the bus is meant for listeners elsewhere; TLS only
    listen_port: int = 9443
    tls: BusTlsConfig | None = None
    brokers: tuple[BrokerConfig, ...] = ()

    def broker(self, broker_id: str) -> BrokerConfig | None:
        return next((b for b in self.brokers if b.id == broker_id), None)


@dataclass(frozen=True, slots=True)
class AdminTokenConfig:
    """One bearer token of the admin API (`admin.auth.tokens[]`), stored as a broker's is: its
    SHA-256, never the token. `id` names the entry (rotation: add the new one, remove the old)."""

    id: str
    token_hash: str  # "sha256:<64 lowercase hex>"


@dataclass(frozen=True, slots=True)
class AdminAuthConfig:
    """`admin.auth`: when present, every admin request needs `authorization: Bearer <token>`
    except the ones `exempt()` names (`/healthz`, and `/metrics` unless `protect_metrics`)."""

    tokens: tuple[AdminTokenConfig, ...]
    protect_metrics: bool = False  # true: Prometheus must send a token too

    def match(self, token: str | bytes) -> AdminTokenConfig | None:
        """The entry whose hash the presented token has, else None. Every entry is compared
        (in constant time each), so the time taken does not tell which one, if any, matched."""
        digest = token_digest(token)
        found: AdminTokenConfig | None = None
        for entry in self.tokens:
            if hmac.compare_digest(digest, entry.token_hash) and found is None:
                found = entry
        return found

    def exempt(self, path: str) -> bool:
        """Paths served without a token: the liveness probe (a kubelet sends no credential)
        and, by default, the Prometheus scrape (nothing under /admin, which the seed says is
        what needs authentication)."""
        return path == "/healthz" or (path == "/metrics" and not self.protect_metrics)


@dataclass(frozen=True, slots=True)
class AdminConfig:
    listen_host: str = "127.0.0.1"
    listen_port: int = 8090
    auth: AdminAuthConfig | None = None  # None: no authentication (loopback only, warned)


@dataclass(frozen=True, slots=True)
class RouterConfig:
    kv_cache_index: KvCacheIndexConfig = field(default_factory=KvCacheIndexConfig)
    event_bus: EventBusServerConfig = field(default_factory=EventBusServerConfig)
    redis: RedisConfig | None = None
    admin: AdminConfig = field(default_factory=AdminConfig)
    log: LogConfig = field(default_factory=LogConfig)
    warnings: tuple[str, ...] = field(default=(), compare=False)


ROUTER_TOP_KEYS = frozenset({"kv_cache_index", "dynamo", "response_cache", "admin", "log"})


def _number(r: Reader, data: dict[str, Any], key: str, path: str, default: float,
            lo: float, hi: float) -> float:
    value = float(r.typed(data, key, path, (int, float), default))
    if not lo <= value <= hi:
        r.error(f"{path}.{key}", f"must be between {lo:g} and {hi:g}, got {value:g}")
        return default
    return value


def _entries(r: Reader, data: dict[str, Any], key: str, path: str) -> list[Any]:
    """The list under `key`; absent, null or empty is no entries (an error when not a list)."""
    raw = data.get(key) or []
    if not isinstance(raw, list):
        r.error(f"{path}.{key}", f"expected a list, got {type_name(raw)}")
        return []
    return raw


def _scoring(r: Reader, raw: Any) -> ScoringConfig:
    p = "kv_cache_index.scoring"
    d = ScoringConfig()
    names = tuple(f.name for f in dataclasses.fields(ScoringConfig))  # errors come in this order
    data = r.mapping(raw, p, set(names))
    n_errors = len(r.errors)
    # Every scoring parameter, weight or threshold, is a number in [0, 1].
    cfg = ScoringConfig(**{name: _number(r, data, name, p, getattr(d, name), 0.0, 1.0) for name in names})
    if len(r.errors) == n_errors and (reason := cfg.weight_sum_error()) is not None:
        r.error(p, reason)
    return cfg


def _event_source(r: Reader, raw: Any, path: str) -> EventSourceConfig | None:
    data = r.entry(raw, path, {"backend_name", "endpoint", "transport", "reconnect_interval_ms"})
    if data is None:
        return None
    n_errors = len(r.errors)
    name = r.name(data, "backend_name", path)
    transport = Transport(r.choice(data, "transport", path, "sse", tuple(t.value for t in Transport)))
    endpoint = r.typed(data, "endpoint", path, str, None, nullable=True)
    if transport is Transport.SSE:
        if endpoint is None:
            r.error(f"{path}.endpoint", "is required (or set transport: event_bus)")
        else:
            endpoint = check_url(r, f"{path}.endpoint", endpoint, ("http", "https", "ws", "wss"))
            segments = urlsplit(endpoint).path.rstrip("/").split("/") if endpoint else []
            if endpoint and name and segments[-2:] != ["events", name]:
                r.warn(f"{path}.endpoint", f"does not end in /events/{name}: records naming "
                                           f"another backend will be dropped (backend_mismatch)")
    elif endpoint is not None:
        r.error(f"{path}.endpoint", "must not be set with transport: event_bus (the listener "
                                    "connects to this router)")
    interval = r.int_range(data, "reconnect_interval_ms", path, 1000, 10, 600_000)
    if len(r.errors) != n_errors:
        return None
    return EventSourceConfig(backend_name=name, transport=transport, endpoint=endpoint,
                             reconnect_interval_ms=interval)


def _kv_cache_index(r: Reader, raw: Any) -> KvCacheIndexConfig:
    p = "kv_cache_index"
    allowed = {"enabled", "backend", "key_prefix", "max_entries", "entry_ttl_seconds", "scoring",
               "storage_offloading", "event_sources", "writer_lease"}
    data = r.mapping(raw, p, allowed)
    enabled = r.typed(data, "enabled", p, bool, True)
    backend = IndexBackend(r.choice(data, "backend", p, "memory", tuple(b.value for b in IndexBackend)))
    key_prefix = r.typed(data, "key_prefix", p, str, DEFAULT_KEY_PREFIX)
    if not key_prefix:
        r.error(f"{p}.key_prefix", "must not be empty (clear would delete every key of the database)")
    elif _GLOB_CHARS & set(key_prefix) or any(c.isspace() for c in key_prefix):
        r.error(f"{p}.key_prefix", f"must not contain glob characters or spaces, got {key_prefix!r}")
    max_entries = r.int_range(data, "max_entries", p, 100000, 100, 10_000_000)
    ttl = r.int_range(data, "entry_ttl_seconds", p, 600, 1, 86400)
    scoring = _scoring(r, data.get("scoring"))
    so = r.mapping(data.get("storage_offloading"), f"{p}.storage_offloading",
                   {"enabled", "treat_eviction_as_offload"})
    offloading = StorageOffloadingConfig(
        enabled=r.typed(so, "enabled", f"{p}.storage_offloading", bool, False),
        treat_eviction_as_offload=r.typed(so, "treat_eviction_as_offload",
                                          f"{p}.storage_offloading", bool, True),
    )
    sources: list[EventSourceConfig] = []
    raw_sources = _entries(r, data, "event_sources", p)
    seen: dict[str, int] = {}
    for i, item in enumerate(raw_sources):
        src = _event_source(r, item, f"{p}.event_sources[{i}]")
        if src is None:
            continue
        if src.backend_name in seen:
            r.error(f"{p}.event_sources[{i}].backend_name",
                    f"duplicate {src.backend_name!r} (also event_sources[{seen[src.backend_name]}])")
            continue
        seen[src.backend_name] = i
        sources.append(src)

    # The seed's warnings: combinations that validate but can never route KV-aware.
    sp = f"{p}.scoring"
    if scoring.gpu_tier_weight < scoring.min_overlap_threshold:
        r.warn(f"{sp}.gpu_tier_weight",
               f"{scoring.gpu_tier_weight:g} is below min_overlap_threshold "
               f"{scoring.min_overlap_threshold:g}: no backend can pass the threshold, every "
               "request falls back to the default strategy")
    if offloading.enabled and scoring.storage_tier_weight < scoring.min_overlap_threshold:
        r.warn(f"{sp}.storage_tier_weight",
               f"{scoring.storage_tier_weight:g} is below min_overlap_threshold "
               f"{scoring.min_overlap_threshold:g}: backends holding only a storage-warm copy "
               "are never scored")
    best = scoring.overlap_weight * scoring.gpu_tier_weight + scoring.load_weight + scoring.health_weight
    if best <= POOL_THRESHOLD:
        r.warn(sp, f"the best possible composite score is {best:.3g}, not above the pool "
                   f"threshold {POOL_THRESHOLD}: the scorer can never pick a backend")
    if scoring.storage_tier_weight > scoring.gpu_tier_weight:
        r.warn(f"{sp}.storage_tier_weight", "is above gpu_tier_weight: storage-warm copies "
                                            "would outrank GPU-resident ones")
    if enabled and not sources:
        r.warn(f"{p}.event_sources", "no event source: the index will stay empty")
    return KvCacheIndexConfig(
        enabled=enabled, backend=backend, key_prefix=key_prefix, max_entries=max_entries,
        entry_ttl_seconds=ttl, scoring=scoring, storage_offloading=offloading,
        event_sources=tuple(sources),
        writer_lease=parse_writer_lease(r, data.get("writer_lease")),
    )


def _broker(r: Reader, raw: Any, path: str, mtls: bool) -> BrokerConfig | None:
    data = r.entry(raw, path, {"id", "role", "token_hash", "backends"})
    if data is None:
        return None
    n_errors = len(r.errors)
    broker_id = r.name(data, "id", path, " (the listener's event_bus.client_id)")
    role = r.enum(data, "role", path, BrokerRole)
    token_hash = r.typed(data, "token_hash", path, str, None, nullable=True)
    if token_hash is not None and not bus_protocol.is_token_hash(token_hash):
        r.error(f"{path}.token_hash", _TOKEN_HASH_HINT)
    if token_hash is None and not mtls:
        r.error(path, "no credential: set token_hash, or dynamo.event_bus.tls.client_ca for "
                      "mTLS client certificates")
    backends: list[str] = []
    raw_backends = data.get("backends", [])
    if not isinstance(raw_backends, list):
        r.error(f"{path}.backends", f"expected a list, got {type_name(raw_backends)}")
        raw_backends = []
    for j, name in enumerate(raw_backends):
        sub = f"{path}.backends[{j}]"
        if not isinstance(name, str) or not BACKEND_NAME_RE.match(name):
            r.error(sub, f"must be a backend name matching [A-Za-z0-9_-]{{1,64}}, got {name!r}")
        elif name in backends:
            r.error(sub, f"duplicate {name!r}")
        else:
            backends.append(name)
    if role is BrokerRole.KV_LISTENER and not raw_backends:
        r.warn(f"{path}.backends", "is empty: this listener may not announce any backend")
    if len(r.errors) != n_errors or role is None:
        return None
    return BrokerConfig(id=broker_id, role=role, token_hash=token_hash, backends=tuple(backends))


def _event_bus(r: Reader, raw: Any) -> EventBusServerConfig:
    p = "dynamo.event_bus"
    data = r.mapping(raw, p, {"enabled", "listen", "tls", "brokers"})
    enabled = r.typed(data, "enabled", p, bool, False)
    default = ("0.0.0.0", 9443)  # noqa: S104 - see EventBusServerConfig
    host, port = r.address(data, "listen", p, "0.0.0.0:9443") or default
    tls_data = r.mapping(data.get("tls"), f"{p}.tls", {"cert", "key", "client_ca"})
    cert = r.typed(tls_data, "cert", f"{p}.tls", str, None, nullable=True)
    key = r.typed(tls_data, "key", f"{p}.tls", str, None, nullable=True)
    client_ca = r.typed(tls_data, "client_ca", f"{p}.tls", str, None, nullable=True)
    if enabled:
        # Files are checked only when the bus is on, so a disabled block (the example file)
        # may keep placeholder paths.
        for name, value in (("cert", cert), ("key", key)):
            if value is None:
                r.error(f"{p}.tls.{name}", "is required when the event bus is enabled (TLS only)")
            r.existing_file(f"{p}.tls.{name}", value)
        r.existing_file(f"{p}.tls.client_ca", client_ca)
    tls = BusTlsConfig(cert, key, client_ca) if cert is not None and key is not None else None
    brokers: list[BrokerConfig] = []
    raw_brokers = _entries(r, data, "brokers", p)
    ids: dict[str, int] = {}
    hashes: dict[str, int] = {}
    for i, item in enumerate(raw_brokers):
        b = _broker(r, item, f"{p}.brokers[{i}]", mtls=client_ca is not None)
        if b is None:
            continue
        if b.id in ids:
            r.error(f"{p}.brokers[{i}].id", f"duplicate {b.id!r} (also brokers[{ids[b.id]}])")
            continue
        if b.token_hash is not None and b.token_hash in hashes:
            r.error(f"{p}.brokers[{i}].token_hash",
                    f"same token as brokers[{hashes[b.token_hash]}]: a token must name one broker")
            continue
        ids[b.id] = i
        if b.token_hash is not None:
            hashes[b.token_hash] = i
        brokers.append(b)
    if enabled and not raw_brokers:
        r.warn(f"{p}.brokers", "is empty: no listener can open a session")
    return EventBusServerConfig(enabled=enabled, listen_host=host, listen_port=port, tls=tls,
                                brokers=tuple(brokers))


#: Keys an operator may write for a plaintext token under `admin.auth`; refused with a hint.
_ADMIN_PLAINTEXT_KEYS = frozenset({"token", "bearer_token", "password", "secret", "credential",
                                   "api_key"})


def _admin_token(r: Reader, raw: Any, path: str) -> AdminTokenConfig | None:
    if isinstance(raw, str):
        # Never echo the value: it may be the plaintext token itself.
        r.error(path, "expected a mapping {id: ..., token_hash: 'sha256:<hex>'}; plaintext "
                      "tokens are refused (store the token's SHA-256, as for the event bus)")
        return None
    data = r.entry(raw, path, {"id", "token_hash"})
    if data is None:
        return None
    n_errors = len(r.errors)
    token_id = r.name(data, "id", path)
    token_hash = r.typed(data, "token_hash", path, str, "")
    if "token_hash" not in data:
        r.error(f"{path}.token_hash", "is required")
    elif not bus_protocol.is_token_hash(token_hash):
        r.error(f"{path}.token_hash", _TOKEN_HASH_HINT)
    if len(r.errors) != n_errors:
        return None
    return AdminTokenConfig(id=token_id, token_hash=token_hash)


def _admin_auth(r: Reader, raw: Any) -> AdminAuthConfig | None:
    p = "admin.auth"
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        r.error(p, f"expected a mapping, got {type_name(raw)}")
        return None
    for key in sorted(k for k in raw if k in _ADMIN_PLAINTEXT_KEYS):
        r.error(f"{p}.{key}", "inline plaintext tokens are refused: list the token's SHA-256 "
                              "under admin.auth.tokens[].token_hash")
    data = r.mapping({k: v for k, v in raw.items() if k not in _ADMIN_PLAINTEXT_KEYS}, p,
                     {"tokens", "protect_metrics"})
    protect_metrics = r.typed(data, "protect_metrics", p, bool, False)
    raw_tokens = data.get("tokens")
    if raw_tokens is None:
        r.error(f"{p}.tokens", "is required (at least one token), or remove admin.auth")
        raw_tokens = []
    elif not isinstance(raw_tokens, list):
        r.error(f"{p}.tokens", f"expected a list, got {type_name(raw_tokens)}")
        raw_tokens = []
    elif not raw_tokens:
        r.error(f"{p}.tokens", "is empty: nobody could use the admin API (remove admin.auth "
                               "to turn authentication off)")
    tokens: list[AdminTokenConfig] = []
    ids: dict[str, int] = {}
    hashes: dict[str, int] = {}
    for i, item in enumerate(raw_tokens):
        sub = f"{p}.tokens[{i}]"
        entry = _admin_token(r, item, sub)
        if entry is None:
            continue
        if entry.id in ids:
            r.error(f"{sub}.id", f"duplicate {entry.id!r} (also tokens[{ids[entry.id]}])")
            continue
        if entry.token_hash in hashes:
            r.error(f"{sub}.token_hash", f"same token as tokens[{hashes[entry.token_hash]}]")
            continue
        ids[entry.id] = i
        hashes[entry.token_hash] = i
        tokens.append(entry)
    return AdminAuthConfig(tokens=tuple(tokens), protect_metrics=protect_metrics)


def _admin(r: Reader, raw: Any) -> AdminConfig:
    data = r.mapping(raw, "admin", {"listen", "auth"})
    auth = _admin_auth(r, data.get("auth"))
    address = r.address(data, "listen", "admin", "127.0.0.1:8090")
    if address is None:
        return AdminConfig(auth=auth)
    host, port = address
    if auth is None and not is_loopback(host):
        r.warn("admin.listen", "is not a loopback address and admin.auth is not set: anyone who "
                               "reaches it can use the admin API (POST /admin/kv-index/clear "
                               "empties the index); set admin.auth.tokens")
    return AdminConfig(listen_host=host, listen_port=port, auth=auth)


def parse_router_config(raw: Any) -> RouterConfig:
    """YAML tree -> `RouterConfig`. Raises `ConfigError` listing every problem."""
    r = Reader()
    data = root_mapping(r, raw, ROUTER_TOP_KEYS)
    if "kv_cache_index" not in data:
        r.error("kv_cache_index", "is required (this is what tells a router file from a "
                                  "listener file)")
    kv = _kv_cache_index(r, data.get("kv_cache_index"))

    dynamo = r.mapping(data.get("dynamo"), "dynamo", {"event_bus"})
    bus = _event_bus(r, dynamo.get("event_bus"))

    rc = r.mapping(data.get("response_cache"), "response_cache", {"redis"})
    redis = parse_redis(r, rc["redis"]) if rc.get("redis") is not None else None

    admin = _admin(r, data.get("admin"))

    log = parse_log(r, data.get("log"))

    # Cross-block rules.
    if admin.auth is not None:
        bus_hashes = {b.token_hash: i for i, b in enumerate(bus.brokers) if b.token_hash}
        for i, entry in enumerate(admin.auth.tokens):
            if entry.token_hash in bus_hashes:
                r.error(f"admin.auth.tokens[{i}].token_hash",
                        f"same token as dynamo.event_bus.brokers[{bus_hashes[entry.token_hash]}]: "
                        "a listener's bus credential must not open the admin API")
    if kv.backend is IndexBackend.REDIS and redis is None:
        r.error("kv_cache_index.backend", "is redis but response_cache.redis is not configured")
    if kv.writer_lease.enabled and kv.backend is not IndexBackend.REDIS:
        r.error("kv_cache_index.writer_lease.enabled", "needs kv_cache_index.backend: redis (the "
                "lease lives in the Redis the routers share)")
    announced = {name for b in bus.brokers if b.role is BrokerRole.KV_LISTENER for name in b.backends}
    bus_sources = 0
    for i, src in enumerate(kv.event_sources):
        if src.transport is not Transport.EVENT_BUS:
            continue
        bus_sources += 1
        if not bus.enabled:
            r.error(f"kv_cache_index.event_sources[{i}].transport",
                    "is event_bus but dynamo.event_bus is not enabled")
        elif src.backend_name not in announced:
            r.warn(f"kv_cache_index.event_sources[{i}]",
                   f"no kv_listener broker lists {src.backend_name!r} in its backends: no "
                   "listener may announce it")
    if bus.enabled and bus_sources == 0:
        r.warn("dynamo.event_bus", "is enabled but no event source uses transport: event_bus")

    if r.errors:
        raise ConfigError(r.errors)
    return RouterConfig(kv_cache_index=kv, event_bus=bus, redis=redis, admin=admin, log=log,
                        warnings=tuple(r.warnings))


def load_router_config(path: str | Path) -> RouterConfig:
    return parse_router_config(read_yaml(path))
