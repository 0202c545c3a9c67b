"""Operator-facing files: man page renders cleanly, systemd unit is hardened and verifies,
metrics use the SPEC prefix and fixed labels, logging emits JSON lines."""

from __future__ import annotations

import io
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import structlog

from kv_listener.logging import configure_logging, get_logger
from kv_listener.metrics import BusView, ListenerCollector, SourceView, StreamView, new_registry, render
from kv_listener.stats import SourceStats
from tests.conftest import ROOT

MAN = ROOT / "man" / "continuum-kv-listener.1"
UNITS = [ROOT / "systemd" / "continuum-kv-listener.service",
         ROOT / "systemd" / "continuum-kv-listener-router.service"]


@pytest.mark.skipif(shutil.which("man") is None, reason="man-db is installed by .ci/install")
def test_man_page_renders_without_warnings() -> None:
    proc = subprocess.run(["man", "--warnings", "-l", str(MAN)], capture_output=True, text=True,
                          env={"MANWIDTH": "80", "PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"},
                          check=False, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip() == ""
    for section in ["NAME", "SYNOPSIS", "DESCRIPTION", "OPTIONS", "CONFIGURATION", "SIGNALS",
                    "FILES", "EXIT STATUS", "EXAMPLES", "SEE ALSO"]:
        assert re.search(rf"^{section}$", proc.stdout, re.M), section


def test_man_page_documents_every_config_key() -> None:
    text = MAN.read_text().replace("\\-", "-")
    for key in ["listen", "log.level", "max_chain_tokens", "max_tracked_blocks",
                "max_retained_tokens", "max_prefix_length", "history_size", "max_lag",
                "update_interval", "max_sse_clients", "cache_salt.secret_file", "tls_server_name",
                "client_id", "credential_file", "client_cert_file", "reconnect_backoff",
                "drain_deadline", "backend_name", "zmq_mode", "replay_endpoint",
                "detokenize_endpoint", "trtllm_endpoint", "poll_interval", "allowed_publishers",
                "chat_template", "SIGHUP", "SIGTERM"]:
        assert key in text, key


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_systemd_unit_is_hardened(unit: Path) -> None:
    text = unit.read_text()
    for directive in ["DynamicUser=yes", "ProtectSystem=strict", "NoNewPrivileges=yes",
                      "PrivateTmp=yes", "ProtectHome=yes", "RestrictAddressFamilies=",
                      "ExecReload=/bin/kill -HUP $MAINPID", "Restart=on-failure"]:
        assert re.search(rf"^{re.escape(directive)}", text, re.M), directive


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_metrics_have_prefix_and_fixed_labels() -> None:
    stats = SourceStats(engine="vllm", events_received=7)
    stats.events_dropped["unknown_tag"] += 2
    stats.clears["gap"] += 1
    reg = new_registry(ListenerCollector(
        lambda: [SourceView("vllm-1", stats, {"blocks_tracked": 5, "prefixes_live": 1})],
        lambda: [StreamView("vllm-1", clients=2, records={"cache_created": 3})],
    ))
    text = render(reg).decode()
    assert 'continuum_kv_listener_events_received_total{backend="vllm-1"} 7.0' in text
    assert 'continuum_kv_listener_events_dropped_total{backend="vllm-1",reason="unknown_tag"} 2.0' in text
    assert 'continuum_kv_listener_source_clears_total{backend="vllm-1",reason="gap"} 1.0' in text
    # Reasons not seen yet are there at 0, so an alert's increase() sees their first step.
    assert 'continuum_kv_listener_source_clears_total{backend="vllm-1",reason="engine_down"} 0.0' in text
    assert 'continuum_kv_listener_events_dropped_total{backend="vllm-1",reason="queue_overflow"} 0.0' in text
    assert 'continuum_kv_listener_detokenize_errors_total{backend="vllm-1",reason="timeout"} 0.0' in text
    assert "continuum_kv_listener_poll_errors_total{" not in text  # a vLLM source never polls
    assert 'continuum_kv_listener_blocks_tracked{backend="vllm-1"} 5.0' in text
    assert 'continuum_kv_listener_sse_clients{backend="vllm-1"} 2.0' in text
    assert 'continuum_kv_listener_records_total{backend="vllm-1",event="cache_created"} 3.0' in text
    names = {m.group(1) for m in re.finditer(r"^# TYPE (\S+)", text, re.M)}
    ours = {n for n in names if n.startswith("continuum_kv_listener_")}
    # Beside ours only the standard process and platform metrics every exporter has.
    assert ours and all(n.startswith(("process_", "python_")) for n in names - ours), names - ours


def test_json_logs_one_event_per_line_with_bound_context() -> None:
    buf = io.StringIO()
    configure_logging("info", "json", stream=buf)
    try:
        log = get_logger("t", backend="vllm-1", engine="vllm")
        log.debug("hidden")
        log.info("zmq_gap", expected=3, got=5)
        lines = buf.getvalue().splitlines()
        assert len(lines) == 1
        rec = json.loads(lines[0])
        assert rec["event"] == "zmq_gap"
        assert (rec["backend"], rec["engine"], rec["level"]) == ("vllm-1", "vllm", "info")
        assert {"expected", "got", "timestamp"} <= rec.keys()
    finally:
        structlog.reset_defaults()


def test_console_format_and_debug_level() -> None:
    buf = io.StringIO()
    configure_logging("debug", "console", stream=buf)
    try:
        get_logger("t").debug("visible_now", n=1)
        out = buf.getvalue()
        assert "visible_now" in out
        assert not out.lstrip().startswith("{")
    finally:
        structlog.reset_defaults()


def test_push_mode_metrics_only_when_configured() -> None:
    stats = SourceStats(engine="vllm")
    without = render(new_registry(ListenerCollector(lambda: [SourceView("b", stats)]))).decode()
    assert "bus_connected" not in without
    bus = BusView(connected=True, connects=3, sessions=2, failures={"tls": 1}, bytes_pushed=99)
    text = render(new_registry(ListenerCollector(lambda: [SourceView("b", stats)],
                                                 bus=lambda: bus))).decode()
    assert "continuum_kv_listener_bus_connected 1.0" in text
    assert "continuum_kv_listener_bus_connects_total 3.0" in text
    assert 'continuum_kv_listener_bus_failures_total{reason="tls"} 1.0' in text
    assert "continuum_kv_listener_bus_bytes_pushed_total 99.0" in text


def test_the_license_is_apache_2_and_ships_with_the_package() -> None:
    from importlib import metadata  # noqa: PLC0415

    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    meta = metadata.metadata("continuum-kv-listener")
    assert meta.get("License-Expression") == "Apache-2.0"
    assert "LICENSE" in (meta.get_all("License-File") or [])
