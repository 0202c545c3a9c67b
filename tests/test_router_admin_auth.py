"""Bearer-token authentication of the router's admin API (`admin.auth`, issue 14): the config
block's validation (every error with its YAML path, plaintext refused and never echoed), the
admin app under real uvicorn on 127.0.0.1 with a real aiohttp client (auth off: unchanged; on:
401 without, with a malformed or a wrong token, 200 with a right one, for every endpoint; the
exempt endpoints; the refusal counter and its bounded log line), and a real `Router` that
rotates its tokens on reload."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from kv_listener.config import ConfigError
from kv_listener.httpserver import serve
from kv_listener.router.admin import create_admin_app
from kv_listener.router.app import Router
from kv_listener.router.config import (
    AdminAuthConfig,
    AdminConfig,
    AdminTokenConfig,
    KvCacheIndexConfig,
    RouterConfig,
    load_router_config,
    parse_router_config,
)
from kv_listener.router.index import IndexEvent, InMemoryKvIndex, PrefixEventType
from kv_listener.router.metrics import RouterMetrics
from kv_listener.router.scorer import KvOverlapScorer
from tests.support.ports import free_port

TOKEN = "adm-7f3c9a1e5b2d4c6f8a0b1c2d3e4f5a6b"
OTHER_TOKEN = "adm-second-token-for-the-oncall-rota"
WRONG = "adm-not-a-configured-token"


def digest(token: str) -> str:
    return "sha256:" + hashlib.sha256(token.encode()).hexdigest()


P = "5a" * 32
KV: dict[str, Any] = {"event_sources": [
    {"backend_name": "vllm-1", "endpoint": "http://127.0.0.1:7817/events/vllm-1"}]}
AUTH = {"tokens": [{"id": "ops", "token_hash": digest(TOKEN)},
                   {"id": "oncall", "token_hash": digest(OTHER_TOKEN)}]}
TIMEOUT = aiohttp.ClientTimeout(total=10)
#: (method, path) of every admin endpoint.
ADMIN_ENDPOINTS = [("GET", "/admin/kv-index/stats"), ("GET", "/admin/kv-index/backends"),
                   ("GET", f"/admin/kv-index/prefix/{P}"), ("POST", "/admin/kv-index/clear")]


def config(admin: Any = None, **extra: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {"kv_cache_index": dict(KV), **extra}
    if admin is not None:
        raw["admin"] = admin
    return raw


def errors_of(raw: Any) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_router_config(raw)
    return info.value.errors


# --- configuration ------------------------------------------------------------------------------

def test_auth_block_parses_like_the_bus_credentials() -> None:
    cfg = parse_router_config(config({"listen": "0.0.0.0:8090", "auth": AUTH}))
    auth = cfg.admin.auth
    assert auth == AdminAuthConfig(tokens=(AdminTokenConfig("ops", digest(TOKEN)),
                                           AdminTokenConfig("oncall", digest(OTHER_TOKEN))))
    assert auth.protect_metrics is False
    # A non-loopback listen with tokens is what auth is for: no warning.
    assert cfg.warnings == ()
    assert auth.match(TOKEN) == AdminTokenConfig("ops", digest(TOKEN))
    assert auth.match(OTHER_TOKEN.encode()) == AdminTokenConfig("oncall", digest(OTHER_TOKEN))
    assert auth.match(WRONG) is None
    assert auth.match(TOKEN + " ") is None  # exact bytes, no normalisation on the router side
    assert [auth.exempt(p) for p in ("/healthz", "/metrics", "/admin/kv-index/stats", "/")] == [
        True, True, False, False]
    protected = parse_router_config(config({"auth": {**AUTH, "protect_metrics": True}})).admin.auth
    assert protected is not None and protected.protect_metrics is True
    assert (protected.exempt("/metrics"), protected.exempt("/healthz")) == (False, True)


def test_without_auth_nothing_changes_and_non_loopback_warns() -> None:
    cfg = parse_router_config(config({"listen": "127.0.0.1:8090"}))
    assert cfg.admin == AdminConfig("127.0.0.1", 8090, None)
    assert cfg.warnings == ()
    for listen in ("0.0.0.0:8090", "10.1.2.3:8090", "[::]:8090"):
        warnings = parse_router_config(config({"listen": listen})).warnings
        assert len(warnings) == 1
        assert warnings[0].startswith("admin.listen: is not a loopback address and admin.auth "
                                      "is not set")


@pytest.mark.parametrize(("auth", "expected"), [
    ({"tokens": [{"id": "ops", "token_hash": "sha256:" + "A" * 64}]},
     ["admin.auth.tokens[0].token_hash: must be 'sha256:' followed by 64 lowercase hex digits"]),
    ({"tokens": [{"id": "ops", "token_hash": "md5:abc"}]},
     ["admin.auth.tokens[0].token_hash: must be 'sha256:'"]),
    ({"tokens": [{"id": "ops"}]}, ["admin.auth.tokens[0].token_hash: is required"]),
    ({"tokens": [{"token_hash": digest(TOKEN)}]}, ["admin.auth.tokens[0].id: is required"]),
    ({"tokens": [{"id": "has space", "token_hash": digest(TOKEN)}]},
     ["admin.auth.tokens[0].id: must match"]),
    ({"tokens": [{"id": "ops", "token_hash": digest(TOKEN), "backends": []}]},
     ["admin.auth.tokens[0].backends: unknown key"]),
    ({"tokens": [{"id": "ops", "token_hash": digest(TOKEN)},
                 {"id": "ops", "token_hash": digest(OTHER_TOKEN)}]},
     ["admin.auth.tokens[1].id: duplicate 'ops' (also tokens[0])"]),
    ({"tokens": [{"id": "a", "token_hash": digest(TOKEN)}, {"id": "b", "token_hash": digest(TOKEN)}]},
     ["admin.auth.tokens[1].token_hash: same token as tokens[0]"]),
    ({"tokens": []}, ["admin.auth.tokens: is empty"]),
    ({}, ["admin.auth.tokens: is required"]),
    ({"tokens": {"id": "ops"}}, ["admin.auth.tokens: expected a list, got a mapping"]),
    ({"tokens": [7]}, ["admin.auth.tokens[0]: expected a mapping, got an integer"]),
    ({**AUTH, "protect_metrics": "yes"}, ["admin.auth.protect_metrics: expected a boolean"]),
    ({**AUTH, "protect_metric": True}, ["admin.auth.protect_metric: unknown key"]),
    ("on", ["admin.auth: expected a mapping, got a string"]),
])
def test_auth_errors_name_their_path(auth: Any, expected: list[str]) -> None:
    errors = errors_of(config({"auth": auth}))
    assert len(errors) == len(expected), errors
    for error, prefix in zip(errors, expected, strict=True):
        assert error.startswith(prefix), (error, prefix)


def test_plaintext_tokens_are_refused_and_never_echoed() -> None:
    plain = "my-plaintext-admin-token"
    errors = errors_of(config({"auth": {"token": plain, "tokens": [plain]}}))
    assert sorted(e.split(":")[0] for e in errors) == ["admin.auth.token", "admin.auth.tokens[0]"]
    assert all("refused" in e for e in errors), errors
    assert not any(plain in e for e in errors)
    # A token_hash that is really the token itself is not echoed either.
    errors = errors_of(config({"auth": {"tokens": [{"id": "ops", "token_hash": plain}]}}))
    assert len(errors) == 1 and plain not in errors[0]


def test_an_event_bus_credential_cannot_be_an_admin_token() -> None:
    bus = {"event_bus": {"enabled": False, "brokers": [
        {"id": "kv-a", "role": "kv_listener", "token_hash": digest(TOKEN), "backends": ["vllm-1"]}]}}
    errors = errors_of(config({"auth": AUTH}, dynamo=bus))
    assert errors == ["admin.auth.tokens[0].token_hash: same token as "
                      "dynamo.event_bus.brokers[0]: a listener's bus credential must not open the "
                      "admin API"]


def test_auth_errors_come_with_the_others_at_once() -> None:
    errors = errors_of({"kv_cache_index": {"max_entries": 1},
                        "admin": {"listen": "nowhere", "auth": {"tokens": [{"id": "x"}]}}})
    assert sorted(e.split(":")[0] for e in errors) == [
        "admin.auth.tokens[0].token_hash", "admin.listen", "kv_cache_index.max_entries"]


# --- the admin app under uvicorn ------------------------------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Admin:
    def __init__(self, base: str, http: aiohttp.ClientSession, registry: CollectorRegistry,
                 clock: Clock) -> None:
        self.base, self.http, self.registry, self.clock = base, http, registry, clock

    async def call(self, method: str, path: str, token: str | None = None,
                   authorization: str | None = None) -> tuple[int, dict[str, str], str]:
        headers = {}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        if authorization is not None:
            headers["Authorization"] = authorization
        async with self.http.request(method, self.base + path, headers=headers) as resp:
            return resp.status, dict(resp.headers), await resp.text()

    def failures(self, reason: str) -> float | None:
        return self.registry.get_sample_value("continuum_kv_admin_auth_failures_total",
                                              {"reason": reason})


@contextlib.asynccontextmanager
async def admin_app(admin: Any) -> AsyncIterator[Admin]:
    cfg = parse_router_config(config(admin))
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry, ["vllm-1"])
    index = InMemoryKvIndex()
    await index.apply(IndexEvent(PrefixEventType.CACHE_CREATED, "vllm-1", P, 64))
    scorer = KvOverlapScorer(index, cfg.kv_cache_index.scoring, metrics=metrics)
    clock = Clock()
    app = create_admin_app(cfg, index, scorer, registry=registry, metrics=metrics, clock=clock)
    server = await serve(app, "127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
            yield Admin(f"http://127.0.0.1:{server.port}", http, registry, clock)
    finally:
        await server.stop()


async def test_auth_off_every_endpoint_answers_without_a_header() -> None:
    async with admin_app({"listen": "127.0.0.1:8090"}) as admin:
        for method, path in [*ADMIN_ENDPOINTS, ("GET", "/metrics"), ("GET", "/healthz")]:
            status, headers, _ = await admin.call(method, path)
            assert status == 200, path
            assert "www-authenticate" not in {k.lower() for k in headers}
        # A header is ignored when nothing is configured.
        assert (await admin.call("GET", "/admin/kv-index/stats", WRONG))[0] == 200
        assert admin.failures("missing") == 0


async def test_auth_on_each_endpoint_needs_a_right_token() -> None:
    async with admin_app({"auth": AUTH}) as admin:
        for method, path in ADMIN_ENDPOINTS:
            status, headers, body = await admin.call(method, path)
            assert status == 401, path
            assert headers["WWW-Authenticate"] == 'Bearer realm="continuum-kv-router"'
            assert "missing bearer token" in body
            status, headers, body = await admin.call(method, path, WRONG)
            assert status == 401, path
            assert headers["WWW-Authenticate"] == ('Bearer realm="continuum-kv-router", '
                                                   'error="invalid_token"')
            assert WRONG not in body
            for bad in ("Basic YWRtaW46YWRtaW4=", "Bearer", "Bearer ", f"Bearer {TOKEN} extra",
                        TOKEN):
                assert (await admin.call(method, path, authorization=bad))[0] == 401, (path, bad)
            assert (await admin.call(method, path, TOKEN))[0] == 200, path
            assert (await admin.call(method, path, OTHER_TOKEN))[0] == 200, path
            # The scheme is case-insensitive.
            assert (await admin.call(method, path, authorization=f"bearer {TOKEN}"))[0] == 200
        # A route's existence is not revealed without a token; with one, a 404 is a 404.
        assert (await admin.call("GET", "/admin/nothing-here"))[0] == 401
        assert (await admin.call("GET", "/admin/nothing-here", TOKEN))[0] == 404
        assert (await admin.call("GET", "/admin/kv-index/prefix/NOT-HEX", TOKEN))[0] == 400
        n = len(ADMIN_ENDPOINTS)
        assert (admin.failures("missing"), admin.failures("invalid"),
                admin.failures("malformed")) == (n + 1, n, 5 * n)


async def test_exempt_endpoints_stay_open() -> None:
    async with admin_app({"auth": AUTH}) as admin:
        status, _, body = await admin.call("GET", "/metrics")
        assert status == 200
        assert 'continuum_kv_admin_auth_failures_total{reason="invalid"} 0.0' in body
        assert (await admin.call("GET", "/healthz"))[0] == 200
        assert (await admin.call("GET", "/healthz", WRONG))[0] == 200
        assert admin.failures("missing") == admin.failures("invalid") == 0
    async with admin_app({"auth": {**AUTH, "protect_metrics": True}}) as admin:
        assert (await admin.call("GET", "/metrics"))[0] == 401
        status, _, body = await admin.call("GET", "/metrics", TOKEN)
        assert status == 200
        assert 'continuum_kv_admin_auth_failures_total{reason="missing"} 1.0' in body
        assert (await admin.call("GET", "/healthz"))[0] == 200


async def test_refusals_are_logged_bounded_and_without_the_token() -> None:
    async with admin_app({"auth": AUTH}) as admin:
        with capture_logs() as logs:
            for _ in range(5):
                await admin.call("GET", "/admin/kv-index/stats", WRONG)
            await admin.call("POST", "/admin/kv-index/clear")
            admin.clock.now += 61  # a minute later the same refusal is logged again, with a count
            await admin.call("GET", "/admin/kv-index/backends", WRONG)
            await admin.call("GET", "/admin/kv-index/stats", TOKEN)
        lines = [e for e in logs if e["event"] == "admin_auth_failed"]
        assert [(e["reason"], e["method"], e["path"], e["suppressed"]) for e in lines] == [
            ("invalid", "GET", "/admin/kv-index/stats", 0),
            ("missing", "POST", "/admin/kv-index/clear", 0),
            ("invalid", "GET", "/admin/kv-index/backends", 4),
        ]
        assert all(e["log_level"] == "warning" and e["client"] == "127.0.0.1" for e in lines)
        assert not any(WRONG in repr(e) or TOKEN in repr(e) or "sha256" in repr(e) for e in logs)
        assert admin.failures("invalid") == 6


# --- the router process's wiring ----------------------------------------------------------------

def write_router_file(path: Path, admin_port: int, tokens: list[tuple[str, str]]) -> Path:
    doc = {"kv_cache_index": {"event_sources": []},
           "admin": {"listen": f"127.0.0.1:{admin_port}",
                     "auth": {"tokens": [{"id": i, "token_hash": digest(t)} for i, t in tokens]}},
           "log": {"level": "info", "format": "json"}}
    path.write_text(yaml.safe_dump(doc))
    return path


async def test_router_counts_refusals_and_rotates_tokens_on_reload(tmp_path: Path) -> None:
    port = free_port()
    path = write_router_file(tmp_path / "router.yaml", port, [("ops", TOKEN)])
    router = Router(load_router_config(path), path, index=InMemoryKvIndex())
    stats = f"http://127.0.0.1:{port}/admin/kv-index/stats"
    await router.start()
    try:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
            async def status(token: str | None) -> int:
                headers = {"Authorization": f"Bearer {token}"} if token else {}
                async with http.get(stats, headers=headers) as resp:
                    return resp.status

            assert (await status(None), await status(OTHER_TOKEN), await status(TOKEN)) == (
                401, 401, 200)
            # Rotation: the new token is added, the old one removed, no restart.
            write_router_file(path, port, [("oncall", OTHER_TOKEN)])
            with capture_logs() as logs:
                assert await router.reload() is True
            assert not [e for e in logs if e["event"] == "config_change_needs_restart"]
            assert (await status(TOKEN), await status(OTHER_TOKEN)) == (401, 200)
            async with http.get(f"http://127.0.0.1:{port}/metrics") as resp:
                assert resp.status == 200
                text = await resp.text()
        assert 'continuum_kv_admin_auth_failures_total{reason="missing"} 1.0' in text
        assert 'continuum_kv_admin_auth_failures_total{reason="invalid"} 2.0' in text
        assert router.config.admin.auth == AdminAuthConfig(
            tokens=(AdminTokenConfig("oncall", digest(OTHER_TOKEN)),))
    finally:
        await router.stop()


def test_router_config_without_admin_block_has_no_auth() -> None:
    assert RouterConfig(kv_cache_index=KvCacheIndexConfig()).admin.auth is None
