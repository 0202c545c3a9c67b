"""Running a benchmark script of `bench/` as the tests' smoke runs do: the script in a child
Python process from the repository root, its `--json` document read back, its exit status
checked (the failure message carries the tails of its stdout and stderr)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent


def run_bench(script: str, args: list[str], out: Path, timeout_s: float) -> tuple[str, Any]:
    """Run `bench/<script> <args> --json <out>`: its stdout, and the JSON document it wrote."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args, "--json", str(out)],
        capture_output=True, text=True, timeout=timeout_s, check=False, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout, json.loads(out.read_text())
