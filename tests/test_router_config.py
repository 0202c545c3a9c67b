"""Router configuration: defaults, every validation rule with its YAML path, the seed's warnings,
the seed's own example blocks, and the shipped example file."""

from __future__ import annotations

import copy
import hashlib
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from kv_listener.configkit import ConfigError, is_router_file
from kv_listener.router.config import (
    BrokerRole,
    IndexBackend,
    RouterConfig,
    ScoringConfig,
    Transport,
    load_router_config,
    parse_router_config,
)
from kv_listener.router.redis_index import RedisKvIndex
from tests.conftest import ROOT
from tests.support.config_errors import error_helpers

EXAMPLE = ROOT / "config.router.yaml.example"
SRC = {"backend_name": "vllm-1", "endpoint": "http://kv:7817/events/vllm-1"}
TOKEN_HASH = "sha256:" + hashlib.sha256(b"s3cret-token").hexdigest()


def base(**kv: Any) -> dict[str, Any]:
    return {"kv_cache_index": {"event_sources": [dict(SRC)], **kv}}


errors_of, one_error = error_helpers(parse_router_config)


def tls_files(tmp_path: Path) -> dict[str, str]:
    out = {}
    for name in ("cert", "key", "client_ca"):
        p = tmp_path / f"{name}.pem"
        p.write_text("x")
        out[name] = str(p)
    return out


def test_defaults() -> None:
    cfg = parse_router_config({"kv_cache_index": None})
    kv = cfg.kv_cache_index
    assert (kv.enabled, kv.backend, kv.key_prefix) == (True, IndexBackend.MEMORY, "cr:kvidx:")
    assert (kv.max_entries, kv.entry_ttl_seconds) == (100000, 600)
    assert kv.scoring == ScoringConfig(0.6, 0.3, 0.1, 0.3, 1.0, 0.6)
    assert (kv.storage_offloading.enabled, kv.storage_offloading.treat_eviction_as_offload) \
        == (False, True)
    assert (cfg.admin.listen_host, cfg.admin.listen_port) == ("127.0.0.1", 8090)
    assert (cfg.log.level, cfg.log.format) == ("info", "json")
    assert cfg.redis is None
    assert cfg.event_bus.enabled is False
    assert (cfg.event_bus.listen_host, cfg.event_bus.listen_port) == ("0.0.0.0", 9443)
    assert cfg.warnings == ("kv_cache_index.event_sources: no event source: the index will stay "
                            "empty",)


def test_event_source_defaults() -> None:
    src = parse_router_config(base()).kv_cache_index.event_sources[0]
    assert (src.backend_name, src.transport, src.endpoint) == ("vllm-1", Transport.SSE,
                                                               SRC["endpoint"])
    assert (src.reconnect_interval_ms, src.reconnect_interval_s) == (1000, 1.0)
    assert parse_router_config(base()).warnings == ()


@pytest.mark.parametrize("raw", [None, [], "text", 3])
def test_root_must_be_a_mapping_with_kv_cache_index(raw: Any) -> None:
    errors = errors_of(raw)
    assert errors[0].startswith(("<root>", "kv_cache_index"))


def test_kv_cache_index_is_required() -> None:
    assert one_error({"admin": {}}).startswith("kv_cache_index: is required")


@pytest.mark.parametrize(
    ("raw", "path"),
    [
        ({**base(), "sources": []}, "sources: unknown key"),
        (base(color=1), "kv_cache_index.color: unknown key"),
        (base(scoring={"weight": 1}), "kv_cache_index.scoring.weight: unknown key"),
        (base(storage_offloading={"on": True}), "kv_cache_index.storage_offloading.on: unknown"),
        ({"kv_cache_index": {"event_sources": [{**SRC, "url": "x"}]}},
         "kv_cache_index.event_sources[0].url: unknown key"),
        ({**base(), "dynamo": {"bus": {}}}, "dynamo.bus: unknown key"),
        ({**base(), "dynamo": {"event_bus": {"port": 1}}}, "dynamo.event_bus.port: unknown key"),
        ({**base(), "response_cache": {"redis": {"key_prefix": "x"}}},
         "response_cache.redis.key_prefix: unknown key"),
        ({**base(), "response_cache": {"capacity": 1}}, "response_cache.capacity: unknown key"),
        ({**base(), "admin": {"port": 1}}, "admin.port: unknown key"),
        ({**base(), "log": {"colour": 1}}, "log.colour: unknown key"),
    ],
)
def test_unknown_keys_name_their_path(raw: dict[str, Any], path: str) -> None:
    assert one_error(raw).startswith(path)


@pytest.mark.parametrize(
    ("kv", "message"),
    [
        ({"enabled": "yes"}, "kv_cache_index.enabled: expected a boolean, got a string"),
        ({"backend": "etcd"}, "kv_cache_index.backend: must be one of memory, redis"),
        ({"max_entries": 99}, "kv_cache_index.max_entries: must be between 100 and 10000000"),
        ({"max_entries": 10_000_001}, "kv_cache_index.max_entries: must be between"),
        ({"max_entries": True}, "kv_cache_index.max_entries: expected an integer, got a boolean"),
        ({"entry_ttl_seconds": 0}, "kv_cache_index.entry_ttl_seconds: must be between 1 and 86400"),
        ({"entry_ttl_seconds": 86401}, "kv_cache_index.entry_ttl_seconds: must be between"),
        ({"entry_ttl_seconds": "10m"}, "kv_cache_index.entry_ttl_seconds: expected an integer"),
        ({"key_prefix": "cr:*:"}, "kv_cache_index.key_prefix: must not contain glob characters"),
        ({"key_prefix": ""}, "kv_cache_index.key_prefix: must not be empty"),
        ({"scoring": {"gpu_tier_weight": 1.5}},
         "kv_cache_index.scoring.gpu_tier_weight: must be between 0 and 1, got 1.5"),
        ({"scoring": {"min_overlap_threshold": -0.1}},
         "kv_cache_index.scoring.min_overlap_threshold: must be between 0 and 1"),
        ({"scoring": {"load_weight": "0.3"}},
         "kv_cache_index.scoring.load_weight: expected an integer or a number, got a string"),
        ({"scoring": {"overlap_weight": 0.5}},
         "kv_cache_index.scoring: overlap_weight + load_weight + health_weight must sum to 1.0, "
         "got 0.9"),
        ({"scoring": []}, "kv_cache_index.scoring: expected a mapping, got a list"),
        ({"storage_offloading": {"enabled": 1}},
         "kv_cache_index.storage_offloading.enabled: expected a boolean, got an integer"),
        ({"event_sources": {"vllm-1": {}}}, "kv_cache_index.event_sources: expected a list"),
    ],
)
def test_index_values(kv: dict[str, Any], message: str) -> None:
    assert one_error(base(**kv)).startswith(message)


@pytest.mark.parametrize("weights", [(0.6, 0.3, 0.1), (0.6, 0.3, 0.1000005), (1, 0, 0),
                                     (0.2, 0.2, 0.6)])
def test_weight_sum_tolerance(weights: tuple[float, float, float]) -> None:
    w = dict(zip(("overlap_weight", "load_weight", "health_weight"), weights, strict=True))
    assert parse_router_config(base(scoring=w)).kv_cache_index.scoring.overlap_weight == weights[0]


def test_weight_sum_beyond_tolerance() -> None:
    w = {"overlap_weight": 0.6, "load_weight": 0.3, "health_weight": 0.10001}
    assert "must sum to 1.0" in one_error(base(scoring=w))


def warnings_of(raw: dict[str, Any]) -> list[str]:
    return list(parse_router_config(raw).warnings)


def test_warning_gpu_tier_weight_below_threshold() -> None:
    w = warnings_of(base(scoring={"gpu_tier_weight": 0.2}))
    assert any(x.startswith("kv_cache_index.scoring.gpu_tier_weight: 0.2 is below "
                            "min_overlap_threshold 0.3") for x in w), w


def test_warning_storage_tier_weight_below_threshold_only_with_offloading() -> None:
    scoring = {"storage_tier_weight": 0.2}
    assert warnings_of(base(scoring=scoring)) == []
    w = warnings_of(base(scoring=scoring, storage_offloading={"enabled": True}))
    assert [x.split(":")[0] for x in w] == ["kv_cache_index.scoring.storage_tier_weight"]


def test_warning_no_backend_can_exceed_the_pool_threshold() -> None:
    scoring = {"overlap_weight": 0.2, "load_weight": 0.0, "health_weight": 0.8,
               "gpu_tier_weight": 0.3}
    w = warnings_of(base(scoring=scoring))
    assert not any("never pick" in x for x in w)
    scoring = {"overlap_weight": 1.0, "load_weight": 0.0, "health_weight": 0.0,
               "gpu_tier_weight": 0.3, "storage_tier_weight": 0.3}
    w = warnings_of(base(scoring=scoring))
    assert any(x.startswith("kv_cache_index.scoring: the best possible composite score is 0.3")
               for x in w), w


def test_warning_storage_above_gpu() -> None:
    w = warnings_of(base(scoring={"storage_tier_weight": 1.0, "gpu_tier_weight": 0.9}))
    assert w == ["kv_cache_index.scoring.storage_tier_weight: is above gpu_tier_weight: "
                 "storage-warm copies would outrank GPU-resident ones"]


@pytest.mark.parametrize(
    ("src", "message"),
    [
        ({"endpoint": SRC["endpoint"]}, "kv_cache_index.event_sources[0].backend_name: is required"),
        ({**SRC, "backend_name": "vllm 1"}, "kv_cache_index.event_sources[0].backend_name: must "
                                            "match"),
        ({"backend_name": "vllm-1"}, "kv_cache_index.event_sources[0].endpoint: is required"),
        ({**SRC, "endpoint": "ftp://kv/events/vllm-1"},
         "kv_cache_index.event_sources[0].endpoint: URL scheme must be http or https or ws or wss"),
        ({**SRC, "endpoint": "http://user:pw@kv/events/vllm-1"},
         "kv_cache_index.event_sources[0].endpoint: inline credentials in URLs are refused"),
        ({**SRC, "endpoint": "http:///events/vllm-1"},
         "kv_cache_index.event_sources[0].endpoint: URL 'http:///events/vllm-1' has no host"),
        ({**SRC, "transport": "grpc"},
         "kv_cache_index.event_sources[0].transport: must be one of sse, event_bus"),
        ({**SRC, "transport": "event_bus"},
         "kv_cache_index.event_sources[0].endpoint: must not be set with transport: event_bus"),
        ({"backend_name": "vllm-1", "transport": "event_bus"},
         "kv_cache_index.event_sources[0].transport: is event_bus but dynamo.event_bus is not "
         "enabled"),
        ({**SRC, "reconnect_interval_ms": 5},
         "kv_cache_index.event_sources[0].reconnect_interval_ms: must be between 10 and 600000"),
        ("vllm-1", "kv_cache_index.event_sources[0]: expected a mapping, got a string"),
    ],
)
def test_event_source_errors(src: Any, message: str) -> None:
    assert one_error({"kv_cache_index": {"event_sources": [src]}}).startswith(message)


def test_event_source_schemes_and_duplicates() -> None:
    sources = [{"backend_name": f"b{i}", "endpoint": f"{scheme}://kv:1/events/b{i}"}
               for i, scheme in enumerate(("http", "https", "ws", "wss"))]
    cfg = parse_router_config({"kv_cache_index": {"event_sources": sources}})
    assert [s.endpoint for s in cfg.kv_cache_index.event_sources] == [s["endpoint"]
                                                                     for s in sources]
    dup = {"kv_cache_index": {"event_sources": [SRC, {**SRC}]}}
    assert one_error(dup) == ("kv_cache_index.event_sources[1].backend_name: duplicate 'vllm-1' "
                              "(also event_sources[0])")


def test_endpoint_of_another_backend_warns() -> None:
    w = warnings_of({"kv_cache_index": {"event_sources": [
        {"backend_name": "vllm-2", "endpoint": "http://kv:7817/events/vllm-1"}]}})
    assert w == ["kv_cache_index.event_sources[0].endpoint: does not end in /events/vllm-2: "
                 "records naming another backend will be dropped (backend_mismatch)"]


def bus(tmp_path: Path, **over: Any) -> dict[str, Any]:
    files = tls_files(tmp_path)
    raw: dict[str, Any] = {
        "kv_cache_index": {"event_sources": [{"backend_name": "vllm-1",
                                              "transport": "event_bus",
                                              "reconnect_interval_ms": 5000}]},
        "dynamo": {"event_bus": {
            "enabled": True, "listen": "127.0.0.1:9443",
            "tls": {"cert": files["cert"], "key": files["key"]},
            "brokers": [{"id": "kv-listener-a", "role": "kv_listener", "token_hash": TOKEN_HASH,
                         "backends": ["vllm-1", "vllm-2"]}],
        }},
    }
    raw["dynamo"]["event_bus"].update(over)
    return raw


def test_event_bus_push_mode_config(tmp_path: Path) -> None:
    cfg = parse_router_config(bus(tmp_path))
    assert cfg.warnings == ()
    b = cfg.event_bus
    assert (b.enabled, b.listen_host, b.listen_port) == (True, "127.0.0.1", 9443)
    assert b.tls is not None and b.tls.client_ca is None
    broker = b.broker("kv-listener-a")
    assert broker is not None
    assert (broker.role, broker.backends) == (BrokerRole.KV_LISTENER, ("vllm-1", "vllm-2"))
    assert broker.token_matches("s3cret-token")
    assert broker.token_matches(b"s3cret-token")
    assert not broker.token_matches("s3cret-token ")
    assert b.broker("nobody") is None
    src = cfg.kv_cache_index.source("vllm-1")
    assert src is not None and (src.transport, src.endpoint) == (Transport.EVENT_BUS, None)


def test_event_bus_unannounced_backend_warns(tmp_path: Path) -> None:
    raw = bus(tmp_path)
    raw["dynamo"]["event_bus"]["brokers"][0]["backends"] = ["vllm-2"]
    assert warnings_of(raw) == [
        "kv_cache_index.event_sources[0]: no kv_listener broker lists 'vllm-1' in its backends: "
        "no listener may announce it"]


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda b: b.pop("tls"), "dynamo.event_bus.tls.cert: is required when the event bus is "
                                 "enabled"),
        (lambda b: b["tls"].update(cert="/nonexistent/c.pem"),
         "dynamo.event_bus.tls.cert: file '/nonexistent/c.pem' does not exist"),
        (lambda b: b.update(listen="9443"), "dynamo.event_bus.listen: invalid address '9443'"),
        (lambda b: b["brokers"][0].update(token_hash="sha256:ABC"),
         "dynamo.event_bus.brokers[0].token_hash: must be 'sha256:' followed by 64 lowercase hex"),
        (lambda b: b["brokers"][0].update(token_hash=TOKEN_HASH.upper().replace("SHA", "sha")),
         "dynamo.event_bus.brokers[0].token_hash: must be 'sha256:'"),
        (lambda b: b["brokers"][0].pop("role"), "dynamo.event_bus.brokers[0].role: is required"),
        (lambda b: b["brokers"][0].update(role="admin"),
         "dynamo.event_bus.brokers[0].role: must be one of kv_listener, broker"),
        (lambda b: b["brokers"][0].pop("id"), "dynamo.event_bus.brokers[0].id: is required"),
        (lambda b: b["brokers"][0].pop("token_hash"),
         "dynamo.event_bus.brokers[0]: no credential: set token_hash, or "
         "dynamo.event_bus.tls.client_ca"),
        (lambda b: b["brokers"][0].update(token="s3cret"),
         "dynamo.event_bus.brokers[0].token: inline credentials are refused"),
        (lambda b: b["brokers"][0].update(backends=["ok", "not ok"]),
         "dynamo.event_bus.brokers[0].backends[1]: must be a backend name"),
        (lambda b: b["brokers"][0].update(backends=["vllm-1", "vllm-1"]),
         "dynamo.event_bus.brokers[0].backends[1]: duplicate 'vllm-1'"),
        (lambda b: b["brokers"].append({**b["brokers"][0], "token_hash": "sha256:" + "0" * 64}),
         "dynamo.event_bus.brokers[1].id: duplicate 'kv-listener-a'"),
        (lambda b: b["brokers"].append({**b["brokers"][0], "id": "other"}),
         "dynamo.event_bus.brokers[1].token_hash: same token as brokers[0]"),
        (lambda b: b.update(enabled="on"), "dynamo.event_bus.enabled: expected a boolean"),
    ],
)
def test_event_bus_errors(tmp_path: Path, mutate: Any, message: str) -> None:
    raw = bus(tmp_path)
    mutate(raw["dynamo"]["event_bus"])
    errors = errors_of(raw)
    assert any(e.startswith(message) for e in errors), errors


def test_event_bus_mtls_needs_no_token_hash(tmp_path: Path) -> None:
    raw = bus(tmp_path)
    b = raw["dynamo"]["event_bus"]
    b["tls"]["client_ca"] = tls_files(tmp_path)["client_ca"]
    del b["brokers"][0]["token_hash"]
    cfg = parse_router_config(raw)
    assert cfg.event_bus.tls is not None and cfg.event_bus.tls.client_ca is not None
    assert not cfg.event_bus.brokers[0].token_matches("anything")


def test_disabled_event_bus_does_not_check_files() -> None:
    raw = {**base(), "dynamo": {"event_bus": {"enabled": False,
                                              "tls": {"cert": "/no/c", "key": "/no/k"}}}}
    assert parse_router_config(raw).event_bus.enabled is False


def redis_raw(**redis: Any) -> dict[str, Any]:
    return {**base(backend="redis"), "response_cache": {"redis": redis}}


def test_redis_settings(tmp_path: Path) -> None:
    pw = tmp_path / "pw"
    pw.write_text("secret\n")
    cfg = parse_router_config(redis_raw(url="redis://redis:6379/2", tls=True, pool_size=16,
                                        connect_timeout_ms=500, command_timeout_ms=200,
                                        password_file=str(pw), username="router",
                                        fallback_to_memory=False))
    r = cfg.redis
    assert r is not None
    assert (r.url, r.use_tls, r.pool_size, r.connect_timeout_ms, r.command_timeout_ms) == (
        "redis://redis:6379/2", True, 16, 500, 200)
    assert (r.username, r.password_file, r.fallback_to_memory) == ("router", str(pw), False)
    assert parse_router_config(redis_raw(url="rediss://r:6380")).redis.use_tls  # type: ignore[union-attr]
    d = parse_router_config(redis_raw()).redis
    assert d is not None
    assert (d.url, d.pool_size, d.connect_timeout_ms, d.command_timeout_ms, d.fallback_to_memory,
            d.use_tls) == ("redis://127.0.0.1:6379", 8, 3000, 1000, True, False)


@pytest.mark.parametrize(
    ("redis", "message"),
    [
        ({"url": "http://r:6379"}, "response_cache.redis.url: URL scheme must be redis or rediss"),
        ({"url": "redis://:pw@r:6379"}, "response_cache.redis.url: inline credentials"),
        ({"password": "pw"}, "response_cache.redis.password: inline credentials are refused"),
        ({"pool_size": 0}, "response_cache.redis.pool_size: must be between 1 and 1024"),
        ({"command_timeout_ms": "1s"}, "response_cache.redis.command_timeout_ms: expected an "
                                       "integer"),
        ({"ca_file": "/nonexistent/ca.pem"}, "response_cache.redis.ca_file: file"),
        ({"password_file": "/nonexistent/pw", "password_env": "PW"},
         "response_cache.redis.password_file: file"),
        ({"tls": "yes"}, "response_cache.redis.tls: expected a boolean"),
    ],
)
def test_redis_errors(redis: dict[str, Any], message: str) -> None:
    errors = errors_of(redis_raw(**redis))
    assert any(e.startswith(message) for e in errors), errors


def test_redis_backend_needs_redis_settings() -> None:
    assert one_error(base(backend="redis")) == (
        "kv_cache_index.backend: is redis but response_cache.redis is not configured")


def test_redis_cluster_switch() -> None:
    r = parse_router_config(redis_raw(url="rediss://node-3:7002", cluster=True)).redis
    assert r is not None and (r.cluster, r.use_tls, r.failover_wait_ms) == (True, True, 15000)
    assert parse_router_config(redis_raw(url="redis://node-1:7000/0", cluster=True,
                                         failover_wait_ms=0)).redis.failover_wait_ms == 0  # type: ignore[union-attr]
    assert parse_router_config(redis_raw()).redis.cluster is False  # type: ignore[union-attr]
    assert one_error(redis_raw(url="redis://node-1:7000/2", cluster=True)) == (
        "response_cache.redis.url: names a database, which Redis Cluster does not have "
        "(cluster: true)")
    assert one_error(redis_raw(cluster="yes")).startswith(
        "response_cache.redis.cluster: expected a boolean")


def test_redis_probe_interval() -> None:
    assert parse_router_config(redis_raw()).redis.probe_interval_ms == 30000  # type: ignore[union-attr]
    assert parse_router_config(redis_raw(probe_interval_ms=250)).redis.probe_interval_ms == 250  # type: ignore[union-attr]
    assert one_error(redis_raw(probe_interval_ms=50)).startswith(
        "response_cache.redis.probe_interval_ms: must be between 100 and 3600000")
    # ... and it is the index's probe interval (an explicit argument still wins).
    cfg = parse_router_config(redis_raw(probe_interval_ms=250))
    assert cfg.redis is not None
    assert RedisKvIndex.from_config(cfg.redis, cfg.kv_cache_index).probe_interval_s == 0.25
    assert RedisKvIndex.from_config(cfg.redis, cfg.kv_cache_index,
                                    probe_interval_s=2.0).probe_interval_s == 2.0


def lease_raw(**lease: Any) -> dict[str, Any]:
    raw = redis_raw()
    raw["kv_cache_index"]["writer_lease"] = lease
    return raw


def test_writer_lease_defaults_and_settings() -> None:
    off = parse_router_config(redis_raw()).kv_cache_index.writer_lease
    assert (off.enabled, off.ttl_ms, off.renew_interval_ms, off.holder_id) == (
        False, 10000, 3000, None)
    on = parse_router_config(lease_raw(enabled=True, ttl_ms=2000, holder_id="router-a")
                             ).kv_cache_index.writer_lease
    # The renewal defaults to a third of a shorter lease.
    assert (on.enabled, on.ttl_ms, on.renew_interval_ms, on.holder_id) == (
        True, 2000, 666, "router-a")


@pytest.mark.parametrize(
    ("lease", "message"),
    [
        ({"ttl_ms": 100}, "kv_cache_index.writer_lease.ttl_ms: must be between 500 and 600000"),
        ({"ttl_ms": 4000, "renew_interval_ms": 2500},
         "kv_cache_index.writer_lease.renew_interval_ms: 2500 is more than half of ttl_ms 4000"),
        ({"holder_id": "two words"},
         "kv_cache_index.writer_lease.holder_id: must be 1-200 characters without spaces"),
        ({"lease_ms": 10}, "kv_cache_index.writer_lease.lease_ms: unknown key"),
    ],
)
def test_writer_lease_errors(lease: dict[str, Any], message: str) -> None:
    errors = errors_of(lease_raw(**lease))
    assert any(e.startswith(message) for e in errors), errors


def test_writer_lease_needs_the_redis_index() -> None:
    assert one_error(base(writer_lease={"enabled": True})) == (
        "kv_cache_index.writer_lease.enabled: needs kv_cache_index.backend: redis (the lease "
        "lives in the Redis the routers share)")


def test_admin_and_log() -> None:
    cfg = parse_router_config({**base(), "admin": {"listen": "[::1]:9000"},
                               "log": {"level": "debug", "format": "console"}})
    assert (cfg.admin.listen_host, cfg.admin.listen_port) == ("::1", 9000)
    assert (cfg.log.level, cfg.log.format) == ("debug", "console")
    assert cfg.warnings == ()
    assert one_error({**base(), "admin": {"listen": "nowhere"}}).startswith("admin.listen: invalid")
    assert one_error({**base(), "log": {"level": "trace"}}).startswith("log.level: must be one of")
    w = warnings_of({**base(), "admin": {"listen": "0.0.0.0:8090"}})
    assert w == ["admin.listen: is not a loopback address and admin.auth is not set: anyone "
                 "who reaches it can use the admin API (POST /admin/kv-index/clear empties the "
                 "index); set admin.auth.tokens"]


def test_all_errors_at_once() -> None:
    raw = {
        "kv_cache_index": {"max_entries": 1, "backend": "redis",
                           "event_sources": [{"backend_name": "x"}]},
        "admin": {"listen": "bad"},
        "extra": 1,
    }
    errors = errors_of(raw)
    assert sorted(e.split(":")[0] for e in errors) == sorted([
        "extra", "kv_cache_index.max_entries", "kv_cache_index.event_sources[0].endpoint",
        "admin.listen", "kv_cache_index.backend"])


# --- The seed's own blocks, and the shipped example --------------------------------------------

SEED_ALL_TIERS = """
response_cache:
  redis:
    url: "redis://redis-service:6379"
    pool_size: 16

kv_cache_index:
  enabled: true
  backend: redis
  max_entries: 500000
  entry_ttl_seconds: 900
  scoring:
    overlap_weight: 0.6
    load_weight: 0.3
    health_weight: 0.1
    min_overlap_threshold: 0.25
    gpu_tier_weight: 1.0
    storage_tier_weight: 0.6
  storage_offloading:
    enabled: true
    treat_eviction_as_offload: true
  event_sources:
    - backend_name: vllm-1
      endpoint: "http://kv-listener.internal:7817/events/vllm-1"
    - backend_name: vllm-2
      endpoint: "http://kv-listener.internal:7817/events/vllm-2"
"""


def test_seed_all_tiers_block_validates() -> None:
    cfg = parse_router_config(yaml.safe_load(SEED_ALL_TIERS))
    assert cfg.warnings == ()
    kv = cfg.kv_cache_index
    assert (kv.backend, kv.max_entries, kv.entry_ttl_seconds) == (IndexBackend.REDIS, 500000, 900)
    assert kv.scoring.min_overlap_threshold == 0.25
    assert [s.backend_name for s in kv.event_sources] == ["vllm-1", "vllm-2"]


def test_example_file_validates_cleanly() -> None:
    cfg = load_router_config(EXAMPLE)
    assert cfg.warnings == ()
    assert cfg == RouterConfig(
        kv_cache_index=cfg.kv_cache_index, event_bus=cfg.event_bus, redis=cfg.redis)
    # The example states the defaults: parsing it equals parsing its sources with defaults only.
    defaults = parse_router_config({"kv_cache_index": {"event_sources": [
        {"backend_name": s.backend_name, "endpoint": s.endpoint}
        for s in cfg.kv_cache_index.event_sources]}})
    assert cfg.kv_cache_index == defaults.kv_cache_index
    assert cfg.admin == defaults.admin and cfg.log == defaults.log


def test_example_file_mentions_every_option() -> None:
    text = EXAMPLE.read_text()
    keys = {
        "enabled", "backend", "key_prefix", "max_entries", "entry_ttl_seconds", "scoring",
        "overlap_weight", "load_weight", "health_weight", "min_overlap_threshold",
        "gpu_tier_weight", "storage_tier_weight", "storage_offloading",
        "treat_eviction_as_offload", "event_sources", "backend_name", "endpoint", "transport",
        "reconnect_interval_ms", "dynamo", "event_bus", "listen", "tls", "cert", "key",
        "client_ca", "brokers", "id", "role", "token_hash", "backends", "response_cache", "redis",
        "url", "ca_file", "username", "password_file", "password_env", "pool_size",
        "connect_timeout_ms", "command_timeout_ms", "fallback_to_memory", "admin", "log", "level",
        "format", "cluster", "failover_wait_ms", "writer_lease", "ttl_ms", "renew_interval_ms", "holder_id",
        "probe_interval_ms",
    }
    present = set(re.findall(r"^\s*(?:-\s+|#\s*-?\s*)?([a-z_]+):", text, re.MULTILINE))
    assert keys - present == set()
    # Every line that sets an option explains it.
    for line in text.splitlines():
        if re.match(r"^\s+[a-z_]+: \S", line) and "backend_name: vllm-2" not in line \
                and "endpoint:" not in line:
            assert "#" in line, line


def test_load_errors_and_file_kind(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_router_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("kv_cache_index: [\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_router_config(bad)
    assert is_router_file(yaml.safe_load(EXAMPLE.read_text()))
    assert not is_router_file({"sources": []})
    assert not is_router_file([])


def test_config_is_frozen() -> None:
    cfg = parse_router_config(base())
    with pytest.raises(AttributeError):
        cfg.kv_cache_index.max_entries = 5  # type: ignore[misc]
    assert copy.deepcopy(cfg) == cfg
