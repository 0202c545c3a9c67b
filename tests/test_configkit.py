"""The configuration toolkit both files are read with: its helpers, and the import rule that
lets the router use it without the listener's configuration (issue 15)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kv_listener import config, configkit
from kv_listener.configkit import (
    ConfigError,
    LogConfig,
    Reader,
    YamlContentError,
    is_router_file,
    parse_log,
    read_yaml,
    root_mapping,
)
from kv_listener.errors import ConfigError as ExitConfigError
from tests.conftest import ROOT


def _imports(path: Path) -> set[str]:
    """Every module `path` imports (absolute imports only: the package uses no relative ones)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            found.add(node.module)
    return found


def test_the_toolkit_imports_no_listener_or_router_module() -> None:
    own = {m for m in _imports(ROOT / "kv_listener" / "configkit.py") if m.startswith("kv_listener")}
    assert own <= {"kv_listener.errors"}, own
    assert not {m for m in _imports(ROOT / "kv_listener" / "errors.py") if m.startswith("kv_listener")}


def test_no_router_module_imports_the_listeners_configuration() -> None:
    offenders = sorted(p.name for p in (ROOT / "kv_listener" / "router").glob("*.py")
                       if "kv_listener.config" in _imports(p))
    assert not offenders, offenders


def test_one_config_error_class_for_every_layer() -> None:
    # `except ConfigError` in the CLI must catch what either file's parser raises.
    assert configkit.ConfigError is ExitConfigError is config.ConfigError
    assert issubclass(YamlContentError, ConfigError)


def test_listener_config_re_exports_what_callers_import() -> None:
    for name in ("BACKEND_NAME_RE", "LogConfig", "Reader", "read_secret", "read_yaml", "is_loopback",
                 "parse_duration", "parse_listen", "check_url", "type_name", "did_you_mean"):
        assert getattr(config, name) is getattr(configkit, name), name
    assert "Backoff" not in vars(config)  # renamed BackoffConfig: kv_listener.backoff owns the name


def test_address_default_valid_and_invalid() -> None:
    r = Reader()
    assert r.address({}, "listen", "admin", "127.0.0.1:8090") == ("127.0.0.1", 8090)
    assert r.address({"listen": "[::1]:9"}, "listen", "", "x") == ("::1", 9)
    assert r.address({"listen": "nohost"}, "listen", "", "127.0.0.1:1") is None
    assert r.address({"listen": "h:0"}, "listen", "admin", "127.0.0.1:1") is None
    assert r.errors == [
        "listen: invalid address 'nohost' (expected 'host:port')",
        "admin.listen: invalid address 'h:0' (expected 'host:port')",
    ]


def test_not_both_and_env_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVL_TEST_UNSET", raising=False)
    monkeypatch.setenv("KVL_TEST_SET", "x")
    r = Reader()
    r.not_both("p", ("a_file", "f"), ("a_env", None))
    r.not_both("p", ("a_file", None), ("a_env", None))
    r.not_both("q", ("a_file", "f"), ("a_env", "E"))
    r.env_is_set("q.a_env", None)
    r.env_is_set("q.a_env", "KVL_TEST_SET")
    r.env_is_set("q.a_env", "KVL_TEST_UNSET")
    assert r.errors == ["q: set a_file or a_env, not both"]
    assert r.warnings == ["q.a_env: environment variable 'KVL_TEST_UNSET' is not set here"]


def test_log_block_defaults_and_errors() -> None:
    r = Reader()
    assert parse_log(r, None) == LogConfig()
    assert parse_log(r, {"level": "debug", "format": "console"}) == LogConfig("debug", "console")
    assert parse_log(r, {"level": "loud", "colour": 1}) == LogConfig()
    assert r.errors == [
        "log.colour: unknown key (allowed: format, level)",
        "log.level: must be one of debug, info, warning, error, got 'loud'",
    ]


def test_root_mapping_refuses_a_non_mapping_at_once() -> None:
    r = Reader()
    assert root_mapping(r, None, {"a"}) == {}
    assert root_mapping(r, {"a": 1, "b": 2}, {"a"}) == {"a": 1}
    assert r.errors == ["b: unknown key (allowed: a)"]
    with pytest.raises(ConfigError) as info:
        root_mapping(Reader(), [1], {"a"})
    assert info.value.errors == ["<root>: expected a mapping, got a list"]


def test_read_yaml_reports_every_duplicate_key(tmp_path: Path) -> None:
    p = tmp_path / "f.yaml"
    p.write_text("a: 1\nb: {c: 1, c: 2}\na: 3\n")
    with pytest.raises(YamlContentError) as info:
        read_yaml(p)
    assert info.value.problems == [
        "line 2, column 11: duplicate key 'c' (first at line 2); remove one",
        "line 3, column 1: duplicate key 'a' (first at line 1); remove one",
    ]


def test_entry_must_be_a_mapping() -> None:
    r = Reader()
    assert r.entry({"id": "a", "x": 1}, "brokers[0]", {"id"}) == {"id": "a"}
    assert r.entry(None, "brokers[1]", {"id"}) is None
    assert r.entry("a", "brokers[2]", {"id"}) is None
    assert r.errors == [
        "brokers[0].x: unknown key (allowed: id)",
        "brokers[1]: expected a mapping, got null",
        "brokers[2]: expected a mapping, got a string",
    ]


@pytest.mark.parametrize(("raw", "router"), [
    ({"kv_cache_index": None}, True),
    ({"kv_cache_index": {}, "sources": []}, False),
    ({"sources": []}, False),
    ([{"kv_cache_index": None}], False),
    (None, False),
])
def test_is_router_file_by_top_level_keys(raw: object, router: bool) -> None:
    assert is_router_file(raw) is router
