"""The benchmarks' own documentation names only what exists (issue 14, finding 10): every path,
script and module named in a bench script's docstring or its argparse texts (description, help,
epilog, usage), and in bench/README.md, is in the tree, so a reader can run what they say.

Static and cheap: the texts are read with `ast`, nothing is imported or run. What is checked:

- interpreters: the project's venv as `.ci/install` makes it (`.venv/bin/python`), or `python`
  from PATH, never a machine's absolute path (the docstrings named `/work/venv/bin/python`);
- scripts and files: `bench/NAME.py`, `NAME.py` (next to the script), `docs/x.json`, ... exist;
- absolute paths outside /proc and /tmp (machine-specific) exist;
- modules: `kv_listener.sim.server`, `tests.support.daemon.Daemon`, `core.sse.SseParser` (short
  for `kv_listener.core...`), `peer_routers.ensure_installed` resolve to a module in the tree, and
  a trailing name to something that module defines at top level.

Plus: every script answers `--help` without running, and one quick bench run prints its figures
and nothing else (no library logs or advisories on stdout or stderr).

HTTP routes (`/detokenize`, `GET /events/{backend}`), output names (`--json peers.json`, a
bare `.peer-install.json`), placeholders (`bench/NAME.py`) and directories made on first use
(`.venv-peers/`) are not files of the tree.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
SCRIPTS = sorted(BENCH.glob("*.py"))
ARGPARSE_TEXTS = {"description", "epilog", "help", "usage"}
VENV_PYTHON = ".venv/bin/python"
#: The file kinds a text names as files of the tree (anything else with a slash is a route).
FILE_EXT = r"(?:py|md|json|png|ya?ml|toml|txt|sh)"
FILE_TOKEN = re.compile(rf"(?<![\w./-])(?:\.{{0,2}}/)?[\w.-]+(?:/[\w.-]+)*\.{FILE_EXT}(?![\w/])")
INTERPRETER = re.compile(r"(?<![\w./-])([^\s`'\"(]*/)?python3?(?=\s)")
ABSOLUTE = re.compile(r"(?<![\w.:/-])/(?:work|home|root|opt|usr|etc|var|srv|mnt)(?:/[\w.-]+)+")
OUTPUT_ARG = re.compile(rf"--(?:json|plots|out(?:put)?)[ =]\S+\.{FILE_EXT}")
OUR_PACKAGES = {"kv_listener", "tests"}
#: Short forms the docstrings use for the package's subpackages.
SHORT = {"core", "sim", "router", "resolver", "sources", "outputs"}


def texts_of(script: Path) -> list[str]:
    """The module docstring and every string constant given to argparse as a text."""
    tree = ast.parse(script.read_text())
    texts = [ast.get_docstring(tree) or ""]
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            for kw in node.keywords:
                if kw.arg in ARGPARSE_TEXTS:
                    texts += [c.value for c in ast.walk(kw.value)
                              if isinstance(c, ast.Constant) and isinstance(c.value, str)]
    return texts


def documents() -> list[tuple[str, str]]:
    docs = [(s.relative_to(ROOT).as_posix(), "\n".join(texts_of(s))) for s in SCRIPTS]
    return [*docs, ("bench/README.md", (BENCH / "README.md").read_text())]


def _defined_names(module_file: Path) -> set[str]:
    tree = ast.parse(module_file.read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def resolve_module(dotted: str) -> str | None:
    """None when `dotted` names a module of the tree (plus at most one name it defines), else
    what is missing."""
    parts = dotted.split(".")
    if parts[0] in SHORT:
        parts = ["kv_listener", *parts]
    base = BENCH if parts[0] in {s.stem for s in SCRIPTS} else ROOT
    for i in range(len(parts), 0, -1):
        path = base.joinpath(*parts[:i])
        module = path.with_suffix(".py") if path.with_suffix(".py").is_file() else (
            path / "__init__.py" if (path / "__init__.py").is_file() else None)
        if module is None:
            continue
        rest = parts[i:]
        if not rest:
            return None
        if len(rest) == 1 and rest[0] in _defined_names(module):
            return None
        return f"{'.'.join(rest)} is not defined in {module.relative_to(ROOT)}"
    return f"no module {'.'.join(parts)}"


def missing_paths(doc: str, text: str) -> list[str]:
    """What `text` (from the file `doc`) names that is not in the tree."""
    problems: list[str] = []
    here = (ROOT / doc).parent
    for m in INTERPRETER.finditer(text):
        exe = m.group(0)
        if exe not in ("python", "python3", VENV_PYTHON):
            problems.append(f"interpreter {exe} (use {VENV_PYTHON}, the venv .ci/install makes)")
    outputs = {m.group(0).split()[-1].split("=")[-1] for m in OUTPUT_ARG.finditer(text)}
    for m in FILE_TOKEN.finditer(text):
        name = m.group(0)
        if name in outputs or name.startswith("/") or Path(name).stem.isupper():
            continue  # an output, an absolute path (below), a placeholder (`bench/NAME.py`)
        if "/" not in name and not name.endswith(".py"):
            continue  # a bare data-file name is one a run writes (`.peer-install.json`)
        if not any((base / name).exists() for base in (ROOT, here, ROOT / "kv_listener")):
            problems.append(f"file {name}")
    for m in ABSOLUTE.finditer(text):
        if not Path(m.group(0)).exists():
            problems.append(f"absolute path {m.group(0)}")
    first = OUR_PACKAGES | SHORT | {s.stem for s in SCRIPTS}
    dotted = re.compile(rf"(?<![\w./-])(?:{'|'.join(sorted(first))})(?:\.[A-Za-z_]\w*)+")
    for m in dotted.finditer(text):
        if m.group(0).endswith((".py", ".md", ".json")):
            continue  # a file name, checked above
        why = resolve_module(m.group(0))
        if why is not None:
            problems.append(f"module {m.group(0)}: {why}")
    return problems


@pytest.mark.parametrize(("doc", "text"), documents(), ids=[d for d, _ in documents()])
def test_every_path_a_bench_names_exists(doc: str, text: str) -> None:
    assert missing_paths(doc, text) == []


def test_the_documented_venv_is_the_one_ci_makes() -> None:
    assert re.search(r"-m venv \.venv\b", (ROOT / ".ci" / "install").read_text())


def test_the_checker_catches_what_it_is_for() -> None:
    """The rules above would have caught the old docstrings, and let routes and outputs be."""
    doc = "bench/decode.py"
    assert missing_paths(doc, "    /work/venv/bin/python bench/decode.py [--seconds 1]\n") == [
        "interpreter /work/venv/bin/python (use .venv/bin/python, the venv .ci/install makes)",
        "absolute path /work/venv/bin/python"]
    assert missing_paths(doc, "see `bench/nope.py` and `kv_listener.sim.nope`") == [
        "file bench/nope.py",
        "module kv_listener.sim.nope: nope is not defined in kv_listener/sim/__init__.py"]
    assert missing_paths(doc, "`tests.support.daemon.Nope`") == [
        "module tests.support.daemon.Nope: Nope is not defined in tests/support/daemon.py"]
    assert missing_paths(doc, "GET /events/{backend} and /detokenize, `--json peers.json`, "
                              "`.venv-peers/<name>`, /proc/PID/status, `core.sse.SseParser`, "
                              "`.venv/bin/python bench/peers.py`, peer_routers.py") == []


@pytest.mark.timeout(120)
def test_every_bench_script_answers_help_without_running() -> None:
    """`--help` prints usage and exits 0 for every script with an entry point: none starts its
    measurement (peer_routers.py used to run its self-check whatever the arguments)."""
    for script in SCRIPTS:
        if 'if __name__ == "__main__":' not in script.read_text():
            continue
        proc = subprocess.run([sys.executable, str(script), "--help"], capture_output=True,
                              text=True, timeout=60, cwd=ROOT, check=False)
        assert proc.returncode == 0, (script.name, proc.stderr[-1000:])
        assert proc.stdout.startswith("usage: "), (script.name, proc.stdout[:200])
        assert proc.stderr == "", (script.name, proc.stderr[-1000:])


@pytest.mark.timeout(120)
def test_a_bench_prints_only_its_figures() -> None:
    """The benches' in-process servers and resolver log through structlog (whose default is
    stdout) and transformers advises installing PyTorch on import: `bench/quiet.py` keeps both
    out. detokenize_calls.py had both in its output; its short run takes about two seconds."""
    proc = subprocess.run([sys.executable, str(BENCH / "detokenize_calls.py"), "--requests", "40"],
                          capture_output=True, text=True, timeout=100, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr == ""
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("chat workload: 40 requests")
    assert len(lines) == 3 and all(x.startswith(("  http ", "  http+local ")) for x in lines[1:]), lines
