"""The house rules of issue 15, checked on the source: small rooms, layers that point one way.

Read with `ast` (nothing is imported): every module of `kv_listener/` has a docstring and at most
600 lines; no two classes share a name; `kv_listener.core` imports nothing of the package outside
the core and no module that does I/O (sockets, files, processes, clocks, the event loop); the
router (`kv_listener.router`) never imports the listener's configuration, sources, outputs or
resolver.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "kv_listener"
MAX_LINES = 600
#: Modules the pure core must not import: I/O, clocks, the event loop, processes, environment.
IO_MODULES = frozenset({
    "asyncio", "socket", "ssl", "select", "selectors", "subprocess", "os", "io", "pathlib",
    "shutil", "tempfile", "time", "datetime", "threading", "multiprocessing", "signal", "logging",
    "zmq", "aiohttp", "httpx", "h2", "uvicorn", "hypercorn", "starlette", "redis", "yaml",
    "structlog", "prometheus_client", "transformers", "tokenizers",
})
#: What the router may not import from the listener's side.
LISTENER_EDGES = ("kv_listener.config", "kv_listener.sources", "kv_listener.outputs",
                  "kv_listener.resolver", "kv_listener.app")


def modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def dotted(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Every module an `import` or `from ... import` names, anywhere in the file (function-level
    imports count too), resolved against the package for relative imports."""
    tree = ast.parse(path.read_text("utf-8"))
    here = dotted(path).split(".")
    if path.name != "__init__.py":
        here = here[:-1]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)  # `from pkg import module`
    return out


def test_every_module_has_a_docstring_and_at_most_600_lines() -> None:
    too_long = {}
    undocumented = []
    for p in modules():
        text = p.read_text("utf-8")
        n = text.count("\n")
        if n > MAX_LINES:
            too_long[dotted(p)] = n
        if text.strip() and ast.get_docstring(ast.parse(text)) is None:
            undocumented.append(dotted(p))
    assert not too_long, f"modules over {MAX_LINES} lines: {too_long}"
    assert not undocumented, f"modules without a docstring: {undocumented}"


def test_no_two_classes_share_a_name() -> None:
    where: dict[str, list[str]] = defaultdict(list)
    for p in modules():
        for node in ast.walk(ast.parse(p.read_text("utf-8"))):
            if isinstance(node, ast.ClassDef):
                where[node.name].append(dotted(p))
    clashes = {name: mods for name, mods in where.items() if len(mods) > 1}
    assert not clashes, clashes


def test_the_core_is_pure() -> None:
    bad: dict[str, set[str]] = {}
    for p in (PACKAGE / "core").rglob("*.py"):
        found = {m for m in imports_of(p)
                 if (m.startswith("kv_listener.") and not m.startswith("kv_listener.core"))
                 or m.split(".")[0] in IO_MODULES}
        if found:
            bad[dotted(p)] = found
    assert not bad, bad


def test_the_router_imports_none_of_the_listeners_edges() -> None:
    bad: dict[str, set[str]] = {}
    for p in (PACKAGE / "router").rglob("*.py"):
        found = {m for m in imports_of(p)
                 if any(m == e or m.startswith(e + ".") for e in LISTENER_EDGES)}
        if found:
            bad[dotted(p)] = found
    assert not bad, bad


def test_the_checks_see_imports_and_would_catch_a_leak() -> None:
    """The rule checkers above read real imports: the listener's app imports its config, and a
    relative import resolves against the package."""
    assert "kv_listener.config" in imports_of(PACKAGE / "app.py")
    assert any(m.startswith("kv_listener.core") for m in imports_of(PACKAGE / "core" / "tracker.py"))
