"""Listener configuration: defaults, every validation rule, error paths, the example file."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from kv_listener.config import ListenerConfig, load_config, parse_config
from kv_listener.configkit import ConfigError, YamlContentError, parse_duration, read_secret
from kv_listener.core.limits import Limits
from kv_listener.core.model import Engine
from tests.conftest import ROOT
from tests.support.config_errors import error_helpers

VLLM: dict[str, Any] = {
    "backend_name": "vllm-1",
    "engine": "vllm",
    "model": "meta-llama/Llama-3.1-8B-Instruct",
    "zmq_endpoint": "tcp://127.0.0.1:5557",
    "detokenize_endpoint": "http://127.0.0.1:8000/detokenize",
}
TRT: dict[str, Any] = {
    "backend_name": "trt-1",
    "engine": "trtllm",
    "model": "m",
    "trtllm_endpoint": "http://127.0.0.1:8001/kv_cache_events",
}


errors_of, one_error = error_helpers(parse_config)


def with_source(**changes: Any) -> dict[str, Any]:
    src = copy.deepcopy(VLLM)
    for k, v in changes.items():
        if v is ...:
            src.pop(k, None)
        else:
            src[k] = v
    return {"sources": [src]}


def test_defaults_are_the_spec_defaults() -> None:
    cfg = parse_config({"sources": [VLLM]})
    assert (cfg.listen_host, cfg.listen_port) == ("127.0.0.1", 7817)
    assert (cfg.log.level, cfg.log.format) == ("info", "json")
    assert cfg.limits == Limits(16384, 100000, 16777216)
    assert cfg.max_prefix_length == 1024
    assert cfg.history_size == 100000
    assert cfg.max_lag == 10000
    assert cfg.update_interval_s == pytest.approx(0.25)
    assert cfg.max_sse_clients == 256
    assert not cfg.cache_salt.enabled
    assert cfg.event_bus is None
    src = cfg.sources[0]
    assert src.engine is Engine.VLLM
    assert (src.zmq_mode, src.zmq_topic, src.replay_endpoint) == ("bind", "", None)
    assert src.poll_interval_s == pytest.approx(0.1)
    assert src.allowed_publishers == ("127.0.0.1",)
    assert src.limits == cfg.limits


def test_config_is_frozen() -> None:
    cfg = parse_config({"sources": [VLLM]})
    with pytest.raises(AttributeError):
        cfg.max_lag = 5  # type: ignore[misc]


def test_empty_file_is_all_defaults_with_a_warning() -> None:
    cfg = parse_config(None)
    assert cfg == ListenerConfig()
    assert any("no sources" in w for w in cfg.warnings)


def test_per_source_limits_override_only_given_keys() -> None:
    cfg = parse_config({"limits": {"max_chain_tokens": 4096},
                        "sources": [dict(VLLM, limits={"max_tracked_blocks": 10})]})
    assert cfg.limits.max_chain_tokens == 4096
    assert cfg.sources[0].limits == Limits(4096, 10, 16777216)


@pytest.mark.parametrize(("text", "seconds"), [("250ms", 0.25), ("5s", 5.0), ("1m", 60.0),
                                               ("1.5s", 1.5), ("2h", 7200.0)])
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("bad", ["5", "5 sec", "-1s", "s", "1d", ""])
def test_bad_durations_name_their_path(bad: str) -> None:
    err = one_error({"update_interval": bad, "sources": [VLLM]})
    assert err.startswith("update_interval: invalid duration")
    err = one_error(with_source(poll_interval=bad))
    assert err.startswith("sources[0].poll_interval: invalid duration")


def test_duration_must_be_a_string() -> None:
    assert one_error({"update_interval": 5, "sources": [VLLM]}).startswith(
        "update_interval: expected a duration string")


def test_unknown_keys_at_every_level() -> None:
    errs = errors_of({"listen_addr": "x", "log": {"colour": True}, "limits": {"max_blocks": 1},
                      "sources": [dict(VLLM, zmq_endpiont="tcp://x:1")]})
    assert [e.split(":")[0] for e in errs] == ["listen_addr", "log.colour", "limits.max_blocks",
                                              "sources[0].zmq_endpiont"]
    assert all("unknown key" in e for e in errs)


@pytest.mark.parametrize(
    ("raw", "path", "fragment"),
    [
        ({"max_lag": "10"}, "max_lag", "expected an integer, got a string"),
        ({"max_lag": True}, "max_lag", "got a boolean"),
        ({"history_size": 0}, "history_size", "between 1 and"),
        ({"max_sse_clients": 1.5}, "max_sse_clients", "expected an integer"),
        ({"max_prefix_length": 8}, "max_prefix_length", "between 16 and"),
        ({"log": {"level": "verbose"}}, "log.level", "must be one of debug, info, warning, error"),
        ({"log": {"format": "xml"}}, "log.format", "must be one of json, console"),
        ({"log": "info"}, "log", "expected a mapping"),
        ({"listen": "7817"}, "listen", "invalid address"),
        ({"listen": "127.0.0.1:99999"}, "listen", "invalid address"),
        ({"limits": {"max_chain_tokens": 0}}, "limits.max_chain_tokens", "between 1 and"),
        ({"sources": {"a": 1}}, "sources", "expected a list"),
    ],
)
def test_wrong_types_and_ranges(raw: dict[str, Any], path: str, fragment: str) -> None:
    raw.setdefault("sources", [VLLM])
    err = one_error(raw)
    assert err.startswith(f"{path}: "), err
    assert fragment in err


def test_listen_accepts_ipv6() -> None:
    cfg = parse_config({"listen": "[::1]:9000", "sources": [VLLM]})
    assert (cfg.listen_host, cfg.listen_port) == ("::1", 9000)


@pytest.mark.parametrize("name", ["a b", "", "x" * 65, "vllm/1", "é"])
def test_invalid_backend_name(name: str) -> None:
    err = one_error(with_source(backend_name=name))
    assert err.startswith("sources[0].backend_name: must match [A-Za-z0-9_-]{1,64}")


def test_backend_name_of_64_chars_is_fine() -> None:
    assert parse_config(with_source(backend_name="a" * 64)).sources[0].backend_name == "a" * 64


def test_duplicate_backend_name_names_both() -> None:
    other = dict(VLLM, zmq_endpoint="tcp://127.0.0.1:5558")
    err = one_error({"sources": [VLLM, other]})
    assert err == "sources[1].backend_name: duplicate 'vllm-1' (also sources[0])"


def test_duplicate_backend_name_is_reported_when_the_first_entry_has_another_error() -> None:
    broken = dict(VLLM, zmq_endpoint="nope")
    other = dict(VLLM, zmq_endpoint="tcp://127.0.0.1:5558")
    errs = errors_of({"sources": [broken, other]})
    assert "sources[1].backend_name: duplicate 'vllm-1' (also sources[0])" in errs, errs
    assert any(e.startswith("sources[0].zmq_endpoint: ") for e in errs), errs


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ({"lisen": "127.0.0.1:1"}, "lisen: unknown key (did you mean 'listen'?)"),
        ({"max-lag": 5}, "max-lag: unknown key (did you mean 'max_lag'?)"),
        ({"History_Size": 5}, "History_Size: unknown key (did you mean 'history_size'?)"),
        ({"log": {"formt": "json"}}, "log.formt: unknown key (did you mean 'format'?)"),
        ({"log": {"format": "jsno"}},
         "log.format: must be one of json, console, got 'jsno' (did you mean 'json'?)"),
        (with_source(zmq_endpont="tcp://127.0.0.1:1"),
         "sources[0].zmq_endpont: unknown key (did you mean 'zmq_endpoint'?)"),
        (with_source(engine="vlm"),
         "sources[0].engine: must be one of vllm, sglang, trtllm, got 'vlm' (did you mean 'vllm'?)"),
        (with_source(engine="SGLang"),
         "sources[0].engine: must be one of vllm, sglang, trtllm, got 'SGLang' "
         "(did you mean 'sglang'?)"),
    ],
)
def test_typos_get_a_did_you_mean(raw: dict[str, Any], expected: str) -> None:
    raw.setdefault("sources", [VLLM])
    assert one_error(raw) == expected


def test_an_unknown_key_far_from_any_lists_the_allowed_ones() -> None:
    err = one_error({"colour": "blue", "sources": [VLLM]})
    assert err.startswith("colour: unknown key (allowed: cache_salt, event_bus, history_size,")


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "listener.yaml"
    path.write_text(text)
    return path


def test_duplicate_yaml_keys_are_errors_each_with_its_line(tmp_path: Path) -> None:
    """PyYAML keeps the last of two equal keys: a second `listen:` further down would have
    exposed the listener on all interfaces without a word."""
    path = write(tmp_path, """listen: "127.0.0.1:7817"
sources:
  - backend_name: a
    engine: vllm
    model: m
    model: n
    zmq_endpoint: "tcp://127.0.0.1:5557"
listen: "0.0.0.0:7817"
""")
    with pytest.raises(YamlContentError) as info:
        load_config(path)
    assert info.value.problems == [
        "line 6, column 5: duplicate key 'model' (first at line 5); remove one",
        "line 8, column 1: duplicate key 'listen' (first at line 1); remove one",
    ]
    assert info.value.errors[0].startswith(f"{path}: line 6, column 5: ")


def test_a_duplicate_in_a_flow_mapping_on_one_line_is_found(tmp_path: Path) -> None:
    path = write(tmp_path, "log: {level: info, level: debug}\nsources: []\n")
    with pytest.raises(YamlContentError) as info:
        load_config(path)
    assert info.value.problems == [
        "line 1, column 20: duplicate key 'level' (first at line 1); remove one"]


def test_merge_keys_may_still_be_overridden(tmp_path: Path) -> None:
    text = """sources:
  - <<: {engine: vllm, model: m, zmq_mode: connect}
    backend_name: a
    zmq_mode: bind
    zmq_endpoint: "tcp://127.0.0.1:5557"
"""
    path = write(tmp_path, text)
    cfg = load_config(path)
    assert cfg.sources[0].zmq_mode == "bind"


def test_a_yaml_syntax_error_names_line_and_column(tmp_path: Path) -> None:
    path = write(tmp_path, "sources: [\n")
    with pytest.raises(YamlContentError) as info:
        load_config(path)
    assert len(info.value.problems) == 1
    assert info.value.problems[0].startswith("line 2, column 1: invalid YAML: ")


def test_two_sources_cannot_bind_the_same_endpoint() -> None:
    err = one_error({"sources": [VLLM, dict(VLLM, backend_name="vllm-2")]})
    assert err.startswith("sources[1].zmq_endpoint: 'tcp://127.0.0.1:5557' is already bound")


def test_required_source_keys() -> None:
    errs = errors_of({"sources": [{}]})
    assert errs == [
        "sources[0].backend_name: is required",
        "sources[0].engine: is required (vllm, sglang or trtllm)",
        "sources[0].model: is required (the router-facing model name)",
    ]


def test_unknown_engine() -> None:
    assert one_error(with_source(engine="tgi")) == \
        "sources[0].engine: must be one of vllm, sglang, trtllm, got 'tgi'"


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_zmq_engines_need_zmq_endpoint(engine: str) -> None:
    assert one_error(with_source(engine=engine, zmq_endpoint=...)) == \
        f"sources[0].zmq_endpoint: is required for engine {engine}"


def test_zmq_engine_refuses_trtllm_endpoint() -> None:
    err = one_error(with_source(trtllm_endpoint="http://127.0.0.1:1/kv_cache_events"))
    assert err == "sources[0].trtllm_endpoint: is only for engine trtllm, not vllm"


def test_trtllm_needs_trtllm_endpoint_and_refuses_zmq() -> None:
    src = dict(TRT)
    del src["trtllm_endpoint"]
    src["zmq_endpoint"] = "tcp://127.0.0.1:5557"
    errs = errors_of({"sources": [src]})
    assert errs == ["sources[0].trtllm_endpoint: is required for engine trtllm",
                    "sources[0].zmq_endpoint: is only for engines vllm and sglang, not trtllm"]


def test_trtllm_has_no_detokenize() -> None:
    err = one_error({"sources": [dict(TRT, detokenize_endpoint="http://127.0.0.1:1/detokenize")]})
    assert err.startswith("sources[0].detokenize_endpoint: trtllm-serve has no /detokenize")


def test_trtllm_host_must_be_an_allowed_publisher() -> None:
    err = one_error({"sources": [dict(TRT, trtllm_endpoint="http://10.0.0.5:8000/kv_cache_events")]})
    assert err == "sources[0].trtllm_endpoint: host '10.0.0.5' is not in allowed_publishers"
    ok = parse_config({"sources": [dict(TRT, trtllm_endpoint="http://10.0.0.5:8000/kv_cache_events",
                                        allowed_publishers=["10.0.0.0/24"])]})
    assert ok.sources[0].allowed_publishers == ("10.0.0.0/24",)


@pytest.mark.parametrize(
    ("key", "value", "fragment"),
    [
        ("zmq_endpoint", "127.0.0.1:5557", "invalid ZMQ endpoint"),
        ("zmq_endpoint", "udp://127.0.0.1:5557", "invalid ZMQ endpoint"),
        ("zmq_endpoint", "tcp://127.0.0.1", "tcp needs host:port"),
        ("replay_endpoint", "tcp:/x", "invalid ZMQ endpoint"),
        ("detokenize_endpoint", "ftp://127.0.0.1/detokenize", "URL scheme must be http or https"),
        ("detokenize_endpoint", "http:///detokenize", "has no host"),
        ("detokenize_endpoint", "http://127.0.0.1:notaport/x", "invalid URL"),
        ("zmq_mode", "listen", "must be one of bind, connect"),
        ("allowed_publishers", "127.0.0.1", "expected a list"),
        ("allowed_publishers", [], "must not be empty"),
        ("tokenizer", "/definitely/not/here", "does not exist"),
        ("chat_template", "/definitely/not/here.jinja", "does not exist"),
    ],
)
def test_bad_source_values(key: str, value: Any, fragment: str) -> None:
    err = one_error(with_source(**{key: value}))
    assert err.startswith(f"sources[0].{key}: "), err
    assert fragment in err


def test_bad_publisher_entry_has_its_index() -> None:
    err = one_error(with_source(allowed_publishers=["127.0.0.1", "not an address!"]))
    assert err.startswith("sources[0].allowed_publishers[1]: ")


def test_url_with_inline_credentials_is_refused() -> None:
    err = one_error(with_source(detokenize_endpoint="http://user:pw@127.0.0.1:8000/detokenize"))
    assert err == "sources[0].detokenize_endpoint: inline credentials in URLs are refused"


BUS: dict[str, Any] = {"url": "https://router.example.com:9443", "credential_env": "KV_BUS_TOKEN"}


def test_event_bus_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KV_BUS_TOKEN", "t")
    cfg = parse_config({"event_bus": dict(BUS, reconnect_backoff={"initial": "500ms"},
                                          drain_deadline="2s"), "sources": [VLLM]})
    bus = cfg.event_bus
    assert bus is not None
    assert (bus.client_id, bus.connect_timeout_s, bus.drain_deadline_s) == ("kv-listener-a", 5.0, 2.0)
    assert (bus.reconnect_backoff.initial_s, bus.reconnect_backoff.max_s) == (0.5, 60.0)
    assert not cfg.warnings[1:]  # only the "neither detokenize" style warnings may appear


def test_event_bus_must_be_https() -> None:
    err = one_error({"event_bus": dict(BUS, url="http://router:9443"), "sources": [VLLM]})
    assert err == "event_bus.url: URL scheme must be https, got 'http://router:9443'"


@pytest.mark.parametrize("key", ["token", "credential", "password", "secret"])
def test_inline_credentials_are_refused(key: str) -> None:
    err = one_error({"event_bus": dict(BUS, **{key: "abc"}), "sources": [VLLM]})
    assert err.startswith(f"event_bus.{key}: inline credentials are refused")
    err = one_error({"cache_salt": {key: "abc"}, "sources": [VLLM]})
    assert err.startswith(f"cache_salt.{key}: inline credentials are refused")


def test_event_bus_credential_rules(tmp_path: Path) -> None:
    cert = tmp_path / "c.pem"
    cert.write_text("x")
    assert one_error({"event_bus": {"url": BUS["url"]}, "sources": [VLLM]}).startswith(
        "event_bus: no credential")
    assert one_error({"event_bus": dict(BUS, credential_file=str(cert)), "sources": [VLLM]}) == \
        "event_bus: set credential_file or credential_env, not both"
    assert one_error({"event_bus": dict(BUS, client_cert_file=str(cert)), "sources": [VLLM]}) == \
        "event_bus: client_cert_file and client_key_file go together"
    assert one_error({"event_bus": dict(BUS, ca_file=str(tmp_path / "none.pem")),
                      "sources": [VLLM]}).startswith("event_bus.ca_file: file ")
    assert one_error({"event_bus": dict(BUS, client_id="a b"), "sources": [VLLM]}).startswith(
        "event_bus.client_id: must match")
    assert one_error({"event_bus": dict(BUS, reconnect_backoff={"initial": "10s", "max": "1s"}),
                      "sources": [VLLM]}) == "event_bus.reconnect_backoff: max must not be below initial"


def test_cache_salt_one_of_two(tmp_path: Path) -> None:
    f = tmp_path / "secret"
    f.write_text("s3cret\n")
    assert one_error({"cache_salt": {"secret_file": str(f), "secret_env": "X"}, "sources": [VLLM]}) \
        == "cache_salt: set secret_file or secret_env, not both"
    cfg = parse_config({"cache_salt": {"secret_file": str(f)}, "sources": [VLLM]})
    assert cfg.cache_salt.enabled
    assert read_secret(cfg.cache_salt.secret_file, None) == b"s3cret"


def test_read_secret_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KV_SALT", "s3cret \n")
    assert read_secret(None, "KV_SALT") == b"s3cret"
    monkeypatch.setenv("KV_SALT", "  \n")
    with pytest.raises(ConfigError, match="secret is empty"):
        read_secret(None, "KV_SALT")
    monkeypatch.delenv("KV_SALT")
    with pytest.raises(ConfigError, match="is not set"):
        read_secret(None, "KV_SALT")
    assert read_secret(None, None) is None


def test_all_errors_are_reported_at_once() -> None:
    errs = errors_of({
        "listen": "nope",
        "max_lag": -1,
        "sources": [dict(VLLM, backend_name="bad name"), dict(TRT, engine="tgi"), "not a mapping"],
    })
    paths = [e.split(": ")[0] for e in errs]
    assert paths == ["listen", "max_lag", "sources[0].backend_name", "sources[1].engine", "sources[2]"]


def test_warnings_do_not_fail() -> None:
    cfg = parse_config({"max_lag": 500, "history_size": 100,
                        "sources": [dict(VLLM, detokenize_endpoint=None)]})
    assert any(w.startswith("sources[0]: neither detokenize_endpoint nor tokenizer") for w in cfg.warnings)
    assert any(w.startswith("max_lag: ") for w in cfg.warnings)


def test_root_must_be_a_mapping() -> None:
    assert errors_of(["a"]) == ["<root>: expected a mapping, got a list"]


def test_load_config_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("sources: [\n  - a: b\n  c")
    with pytest.raises(ConfigError, match=r"line 2, column 3: invalid YAML"):
        load_config(bad)
    bad.write_text("[" * 100_000)  # PyYAML raises RecursionError, not YAMLError
    with pytest.raises(ConfigError, match="nested too deeply"):
        load_config(bad)


def test_example_config_validates_and_has_every_option() -> None:
    example = ROOT / "config.kv-listener.yaml.example"
    cfg = load_config(example)
    assert len(cfg.sources) >= 2
    text = example.read_text()
    # every option appears (event_bus keys are in its commented block)
    for key in ["listen", "level", "format", "max_chain_tokens", "max_tracked_blocks",
                "max_retained_tokens", "max_prefix_length", "history_size", "max_lag",
                "update_interval", "max_sse_clients", "secret_file", "secret_env", "event_bus",
                "url", "ca_file", "tls_server_name", "client_id", "credential_file", "credential_env",
                "client_cert_file", "client_key_file", "reconnect_backoff", "connect_timeout",
                "drain_deadline", "backend_name", "engine", "model", "zmq_endpoint", "zmq_mode",
                "zmq_topic", "replay_endpoint", "detokenize_endpoint", "tokenizer", "trtllm_endpoint",
                "poll_interval", "allowed_publishers", "chat_template", "limits", "health_endpoint",
                "health_interval", "engine_down_after", "max_message_bytes", "max_event_tokens",
                "max_event_hashes"]:
        assert f"{key}:" in text, key
    # the commented event_bus block is itself valid once uncommented
    block = [line[2:] for line in text.splitlines() if line.startswith("# event_bus:") or
             line.startswith("#   ")]
    bus = yaml.safe_load("\n".join(block))
    bus["event_bus"]["credential_env"] = "HOME"
    assert parse_config({"event_bus": bus["event_bus"], "sources": [VLLM]}).event_bus is not None


def test_liveness_keys() -> None:
    src = parse_config(with_source()).sources[0]
    assert (src.health_endpoint, src.health_interval_s, src.engine_down_after_s) == (None, 1.0, 10.0)
    src = parse_config(with_source(health_endpoint="http://127.0.0.1:8000/health",
                                   health_interval="250ms", engine_down_after="3s")).sources[0]
    assert (src.health_endpoint, src.health_interval_s, src.engine_down_after_s) == \
        ("http://127.0.0.1:8000/health", 0.25, 3.0)
    assert parse_config(with_source(engine_down_after=None)).sources[0].engine_down_after_s is None
    assert one_error(with_source(health_interval="2s", engine_down_after="1s")) == \
        "sources[0].engine_down_after: must be at least health_interval (2s), got 1s"
    assert "URL scheme" in one_error(with_source(health_endpoint="tcp://127.0.0.1:1"))
    trt = {"sources": [dict(TRT, health_endpoint="http://127.0.0.1:8001/health")]}
    assert one_error(trt).startswith("sources[0].health_endpoint: is only for engines vllm")


def test_a_zmq_source_without_any_http_endpoint_warns_that_liveness_is_off() -> None:
    cfg = parse_config(with_source(detokenize_endpoint=...))
    assert any("engine liveness is not checked" in w for w in cfg.warnings)
    quiet = parse_config(with_source(detokenize_endpoint=..., engine_down_after=None))
    assert not any("liveness" in w for w in quiet.warnings)


def test_hostile_input_caps_are_limits() -> None:
    lim = parse_config({"limits": {"max_message_bytes": 65536, "max_event_tokens": 100,
                                   "max_event_hashes": 10}, "sources": [VLLM]}).limits
    assert (lim.max_message_bytes, lim.max_event_tokens, lim.max_event_hashes) == (65536, 100, 10)
    assert Limits().max_message_bytes == 8 << 20
    assert "sources[0].limits.max_event_hashes" in one_error(with_source(limits={"max_event_hashes": 0}))
