"""The router file's Redis keys (SPEC §8): `response_cache.redis` (the connection the Redis KV
index uses, a single server or a Redis Cluster) and `kv_cache_index.writer_lease` (one writer per
backend among the routers sharing that Redis, issue 16). Read with `kv_listener.configkit` like
the rest of the router file (`router.config` re-exports both types).

- `response_cache.redis.cluster: true`: the URL names any startup node of a Redis Cluster
  (redis-py's cluster client discovers the others); the index's keys of one prefix then carry a
  hash tag (`cr:kvidx:{<prefix_hash>}`, `cr:kvidx:warm:{<prefix_hash>}`) so that each write stays
  one transaction on one slot; `failover_wait_ms` (default 15 s, Redis' default
  `cluster-node-timeout`) is how long writes retry through a slot move or a master's failover
  before the in-memory fallback takes over (0: at the first error, as with one server).
- `probe_interval_ms` (default 30 s, the seed's): while the fallback holds the index, how often
  Redis is PINGed to see whether it is back.
- `kv_cache_index.writer_lease`: while enabled (only with `backend: redis`), a router consumes a
  backend's stream and writes its entries only while it holds that backend's lease in Redis
  (`SET <key_prefix>lease:<backend> <holder_id> NX PX ttl_ms`, renewed every
  `renew_interval_ms`); the other routers read the shared index only. A dead writer's lease
  expires after `ttl_ms` and another router takes over, starting with a full resync.
"""

from __future__ import annotations

import os
import secrets
import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from kv_listener.configkit import Reader, check_url

#: The lease key names a router: host, process and a random part (two routers in one process,
#: or a restarted one reusing a PID, never share an identity).
HOLDER_ID_MAX = 200


@dataclass(frozen=True, slots=True)
class RedisConfig:
    """`response_cache.redis`: the connection the Redis KV index uses."""

    url: str = "redis://127.0.0.1:6379"
    tls: bool = False  # with a redis:// URL: connect with TLS anyway (rediss:// implies it)
    ca_file: str | None = None  # CA bundle for TLS; None = the system roots
    username: str | None = None  # an ACL user (Redis 6+)
    password_file: str | None = None  # or password_env; never inline
    password_env: str | None = None
    pool_size: int = 8  # connections (per cluster node with `cluster: true`)
    connect_timeout_ms: int = 3000
    command_timeout_ms: int = 1000
    fallback_to_memory: bool = True
    cluster: bool = False  # the URL names any startup node of a Redis Cluster
    failover_wait_ms: int = 15000  # cluster: how long writes retry through a failover
    probe_interval_ms: int = 30000  # in the fallback: how often Redis is asked whether it is back

    @property
    def use_tls(self) -> bool:
        return self.tls or self.url.startswith("rediss://")


def default_holder_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


@dataclass(frozen=True, slots=True)
class WriterLeaseConfig:
    """`kv_cache_index.writer_lease`: one writer per backend among routers sharing a Redis."""

    enabled: bool = False
    ttl_ms: int = 10000  # how long a dead writer holds a backend before another router takes it
    renew_interval_ms: int = 3000  # at most ttl_ms / 2: a renewal may fail once and still be in time
    holder_id: str | None = None  # this router's name in the lease; None: host:pid:random


def parse_redis(r: Reader, raw: Any) -> RedisConfig:
    p = "response_cache.redis"
    d = RedisConfig()
    allowed = {"url", "tls", "ca_file", "username", "password_file", "password_env", "pool_size",
               "connect_timeout_ms", "command_timeout_ms", "fallback_to_memory", "cluster",
               "failover_wait_ms", "probe_interval_ms"}
    data = r.mapping(raw, p, allowed)
    url = r.typed(data, "url", p, str, d.url)
    check_url(r, f"{p}.url", url, ("redis", "rediss"))
    ca_file = r.typed(data, "ca_file", p, str, None, nullable=True)
    r.existing_file(f"{p}.ca_file", ca_file)
    password_file = r.typed(data, "password_file", p, str, None, nullable=True)
    password_env = r.typed(data, "password_env", p, str, None, nullable=True)
    r.existing_file(f"{p}.password_file", password_file)
    r.not_both(p, ("password_file", password_file), ("password_env", password_env))
    cluster = r.typed(data, "cluster", p, bool, False)
    if cluster and urlsplit(url).path not in ("", "/", "/0"):
        # redis://host:port/3: a cluster has database 0 only.
        r.error(f"{p}.url", "names a database, which Redis Cluster does not have (cluster: true)")
    return RedisConfig(
        url=url, tls=r.typed(data, "tls", p, bool, False), ca_file=ca_file,
        username=r.typed(data, "username", p, str, None, nullable=True),
        password_file=password_file, password_env=password_env,
        pool_size=r.int_range(data, "pool_size", p, d.pool_size, 1, 1024),
        connect_timeout_ms=r.int_range(data, "connect_timeout_ms", p, d.connect_timeout_ms, 1, 600_000),
        command_timeout_ms=r.int_range(data, "command_timeout_ms", p, d.command_timeout_ms, 1, 600_000),
        fallback_to_memory=r.typed(data, "fallback_to_memory", p, bool, True),
        cluster=cluster,
        failover_wait_ms=r.int_range(data, "failover_wait_ms", p, d.failover_wait_ms, 0, 600_000),
        probe_interval_ms=r.int_range(data, "probe_interval_ms", p, d.probe_interval_ms, 100,
                                      3_600_000),
    )


def parse_writer_lease(r: Reader, raw: Any) -> WriterLeaseConfig:
    p = "kv_cache_index.writer_lease"
    d = WriterLeaseConfig()
    data = r.mapping(raw, p, {"enabled", "ttl_ms", "renew_interval_ms", "holder_id"})
    ttl = r.int_range(data, "ttl_ms", p, d.ttl_ms, 500, 600_000)
    renew = r.int_range(data, "renew_interval_ms", p, min(d.renew_interval_ms, ttl // 3), 100,
                        600_000)
    if renew * 2 > ttl:
        r.error(f"{p}.renew_interval_ms", f"{renew} is more than half of ttl_ms {ttl}: one late "
                                          "renewal would lose the lease")
    holder = r.typed(data, "holder_id", p, str, None, nullable=True)
    if holder is not None and (not holder or len(holder) > HOLDER_ID_MAX
                               or any(c.isspace() for c in holder)):
        r.error(f"{p}.holder_id", f"must be 1-{HOLDER_ID_MAX} characters without spaces")
    return WriterLeaseConfig(enabled=r.typed(data, "enabled", p, bool, False), ttl_ms=ttl,
                             renew_interval_ms=renew, holder_id=holder)
