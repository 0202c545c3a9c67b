"""The command line as an operator uses it: a real process, exit codes, one-line errors."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from kv_listener import __version__
from tests.conftest import ROOT
from tests.support.ports import free_port

CMD = [sys.executable, "-m", "kv_listener"]


def run(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CMD, *args], capture_output=True, text=True, timeout=timeout, check=False)


def assert_one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 2, proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert lines[0].startswith("continuum-kv-listener: error: ")
    return lines[0]


def test_version() -> None:
    proc = run("--version")
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"continuum-kv-listener {__version__}"


def test_help_lists_commands() -> None:
    proc = run("--help")
    assert proc.returncode == 0
    assert "--config" in proc.stdout
    assert "config" in proc.stdout


def test_unknown_subcommand_is_one_line_exit_2() -> None:
    line = assert_one_line_error(run("frobnicate"))
    assert "frobnicate" in line


def test_unknown_option_is_one_line_exit_2() -> None:
    assert_one_line_error(run("--frobnicate"))


def test_nothing_to_do_is_exit_2() -> None:
    assert "nothing to do" in assert_one_line_error(run())


def test_missing_config_file_is_one_line_exit_2(tmp_path: Path) -> None:
    line = assert_one_line_error(run("--config", str(tmp_path / "nope.yaml")))
    assert "no such file" in line


def test_validate_missing_file_is_one_line_exit_2(tmp_path: Path) -> None:
    assert "no such file" in assert_one_line_error(run("config", "validate", str(tmp_path / "x.yaml")))


def test_validate_without_action() -> None:
    assert_one_line_error(run("config"))


def test_validate_example_exits_0_without_warnings() -> None:
    proc = run("config", "validate", str(ROOT / "config.kv-listener.yaml.example"))
    assert proc.returncode == 0, proc.stderr
    assert "valid listener configuration (3 sources)" in proc.stdout
    assert "warning" not in proc.stdout + proc.stderr


def test_validate_prints_every_error_and_exits_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"listen": "x", "sources": [
        {"backend_name": "a b", "engine": "vllm", "model": "m", "zmq_endpoint": "tcp://127.0.0.1:1"},
        {"backend_name": "t", "engine": "trtllm", "model": "m"},
    ]}))
    proc = run("config", "validate", str(bad))
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert f"{bad}: error: listen: invalid address" in proc.stderr
    assert f"{bad}: error: sources[0].backend_name: must match" in proc.stderr
    assert f"{bad}: error: sources[1].trtllm_endpoint: is required for engine trtllm" in proc.stderr
    assert f"{bad}: 3 error(s)" in proc.stderr


def test_validate_reports_invalid_yaml_like_any_other_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("sources: [\n")
    proc = run("config", "validate", str(bad))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 2, proc.stderr
    assert lines[0].startswith(f"{bad}: error: line 2, column 1: invalid YAML: ")
    assert lines[1] == f"{bad}: 1 error(s)"


def test_validate_reports_every_duplicate_key(tmp_path: Path) -> None:
    bad = tmp_path / "dup.yaml"
    bad.write_text('listen: "127.0.0.1:7817"\nsources: []\nlisten: "0.0.0.0:7817"\n'
                   "max_lag: 5\nmax_lag: 6\n")
    proc = run("config", "validate", str(bad))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"{bad}: error: line 3, column 1: duplicate key 'listen' (first at line 1); remove one",
        f"{bad}: error: line 5, column 1: duplicate key 'max_lag' (first at line 4); remove one",
        f"{bad}: 2 error(s)",
    ]


@pytest.mark.parametrize("command", [["demo"], ["router", "--config", "r.yaml"],
                                     ["config", "validate", "x.yaml"]])
def test_a_global_config_before_a_command_is_refused(command: list[str]) -> None:
    line = assert_one_line_error(run("--config", "listener.yaml", *command))
    assert f"cannot be combined with '{command[0]}'" in line


def test_validate_has_help_text() -> None:
    proc = run("config", "validate", "--help")
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    assert "top-level 'sources'" in text and "top-level 'kv_cache_index'" in text
    assert "Exit status: 0 valid (warnings allowed), 2 invalid or unreadable." in text
    assert "the YAML file to check" in text


def test_validate_rejects_a_file_of_neither_kind(tmp_path: Path) -> None:
    bad = tmp_path / "odd.yaml"
    bad.write_text("hello: world\n")
    assert "neither a listener file" in assert_one_line_error(run("config", "validate", str(bad)))


def test_run_with_invalid_config_exits_2_listing_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("max_lag: -3\nsources: []\n")
    proc = run("--config", str(bad))
    assert proc.returncode == 2
    assert "max_lag: must be between" in proc.stderr
    assert "Traceback" not in proc.stderr


@contextlib.contextmanager
def _running(config: Path) -> Iterator[subprocess.Popen[str]]:
    """The listener started on `config`; killed, reaped and its pipes closed however the test ends."""
    proc = subprocess.Popen([*CMD, "--config", str(config)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()
        for s in (proc.stdout, proc.stderr):
            assert s is not None
            s.close()


def _read_event(proc: subprocess.Popen[str], name: str) -> dict[str, object]:
    """Read JSON log lines from stderr until the named event (blocking read: the process writes it)."""
    assert proc.stderr is not None
    for raw in proc.stderr:
        line = raw.strip()
        if not line.startswith("{"):
            continue
        rec = json.loads(line)
        if rec.get("event") == name:
            return dict(rec)
    raise AssertionError(f"process ended before logging {name!r}")


def _minimal_config(tmp_path: Path, **extra: object) -> Path:
    path = tmp_path / "listener.yaml"
    path.write_text(yaml.safe_dump({"listen": f"127.0.0.1:{free_port()}", "sources": [], **extra}))
    return path


@pytest.mark.timeout(30)
def test_run_then_sigterm_exits_0(tmp_path: Path) -> None:
    with _running(_minimal_config(tmp_path)) as proc:
        started = _read_event(proc, "listener_started")
        assert started["level"] == "info"
        proc.send_signal(signal.SIGTERM)
        _read_event(proc, "listener_stopped")
        assert proc.wait(timeout=15) == 0


@pytest.mark.timeout(30)
def test_sighup_with_invalid_file_keeps_running(tmp_path: Path) -> None:
    config = _minimal_config(tmp_path)
    with _running(config) as proc:
        _read_event(proc, "listener_started")
        good = config.read_text()
        config.write_text("max_lag: nope\n")
        proc.send_signal(signal.SIGHUP)
        failed = _read_event(proc, "config_reload_failed")
        assert any("max_lag" in e for e in failed["errors"])  # type: ignore[attr-defined]
        assert proc.poll() is None
        config.write_text(good)
        proc.send_signal(signal.SIGHUP)
        _read_event(proc, "config_reloaded")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
