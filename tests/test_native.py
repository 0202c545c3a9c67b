"""The compiled hot path (setup.py, mypyc): built where it can be, equal to the pure Python it is
compiled from, and never half there.

The installed build is expected compiled (the install needs only gcc and the Python headers,
which .ci/install provides); `KVL_PURE_PYTHON=1` in the environment says the build was pure on
purpose, and then only the pure path is checked.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT

DRIVER = ROOT / "tests" / "support" / "native_driver.py"
PURE_ON_PURPOSE = os.environ.get("KVL_PURE_PYTHON") == "1"


def setup_constant(name: str) -> object:
    """A constant of setup.py (read, not imported: it is a build file)."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if (isinstance(node, ast.AnnAssign | ast.Assign)
                and name in ast.unparse(node).split("=")[0]):
            assert node.value is not None
            value: object = ast.literal_eval(node.value)
            return value
    raise AssertionError(f"setup.py has no {name}")


def native_modules() -> list[str]:
    """`NATIVE_MODULES` of setup.py, as module names."""
    paths = setup_constant("NATIVE_MODULES")
    assert isinstance(paths, list)
    return [p.removesuffix(".py").replace("/", ".") for p in paths]


def compiled(module: str) -> bool:
    path = importlib.import_module(module).__file__
    assert path is not None
    return not path.endswith(".py")


def test_the_group_is_compiled_whole_or_not_at_all() -> None:
    modules = native_modules()
    assert "kv_listener.core.tracker" in modules and "kv_listener.core.decode" in modules
    state = {m: compiled(m) for m in modules}
    if PURE_ON_PURPOSE:
        assert not any(state.values()), state
    else:
        assert all(state.values()), f"the build fell back to pure Python: {state}"


def c_modules() -> list[str]:
    """`C_MODULES` of setup.py: its hand-written C extensions, by module name."""
    modules = setup_constant("C_MODULES")
    assert isinstance(modules, dict)
    return list(modules)


def test_the_hand_written_c_modules_are_built() -> None:
    """Each is optional on its own (its Python runs without it), but the installed build has
    them all: .ci/install provides the compiler and OpenSSL's headers."""
    modules = c_modules()
    assert "kv_listener.core._saltmac" in modules
    if PURE_ON_PURPOSE:
        for name in modules:
            with pytest.raises(ImportError):
                importlib.import_module(name)
        return
    from kv_listener.core import salt  # noqa: PLC0415

    for name in modules:
        assert compiled(name), name
    assert salt._NATIVE is importlib.import_module("kv_listener.core._saltmac").Verifier


def test_the_structs_of_compiled_modules_keep_their_declared_options() -> None:
    """mypyc drops class keywords (python/mypy#21938): a `msgspec.Struct` declared
    `frozen=True, gc=False` in a compiled module came out mutable and tracked by the cyclic GC
    unless it derives from `core.structs`' bases, which keep the options uncompiled. Each Struct
    of a compiled module has the options its class statement names (read from the source)."""
    import gc  # noqa: PLC0415

    import msgspec  # noqa: PLC0415

    checked = 0
    for name in native_modules():
        module = importlib.import_module(name)
        tree = ast.parse((ROOT / (name.replace(".", "/") + ".py")).read_text())
        for node in tree.body:
            if not isinstance(node, ast.ClassDef):
                continue
            cls = getattr(module, node.name)
            if not (isinstance(cls, type) and issubclass(cls, msgspec.Struct)):
                continue
            declared = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            config = cls.__struct_config__
            assert declared, f"{name}.{node.name} declares no options"
            for option, value in declared.items():
                assert getattr(config, option) == value, (name, node.name, option, compiled(name))
            fields = msgspec.structs.fields(cls)
            if not config.gc:
                instance = cls(*(None for _ in fields))
                assert not gc.is_tracked(instance), (name, node.name)
            checked += 1
    assert checked >= 8  # Record, Replay, the decoders' batches, SseEvent, the log's entries


def run_driver(seed: int, pure_copy: Path | None) -> dict[str, object]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if pure_copy is not None:
        env["PYTHONPATH"] = str(pure_copy)  # ahead of the installed package
    done = subprocess.run([sys.executable, str(DRIVER), str(seed)], capture_output=True,
                          text=True, env=env, cwd=pure_copy or ROOT, timeout=60, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    out: dict[str, object] = json.loads(done.stdout)
    return out


@pytest.fixture(scope="module")
def pure_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package's .py files alone: what runs where nothing was compiled."""
    root = tmp_path_factory.mktemp("pure")
    shutil.copytree(ROOT / "kv_listener", root / "kv_listener",
                    ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__"))
    return root


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_compiled_and_pure_hot_paths_give_the_same_bytes(seed: int, pure_copy: Path) -> None:
    """The same seeded engine stream (shared prefixes, valid / forged / missing salts, LRU tails,
    a CPU medium, bounds that prune, a clear) through decode, tracker, resolver answers, event log and SSE
    encoding: the SSE bytes, the final snapshot and every counter are equal."""
    installed = run_driver(seed, None)
    pure = run_driver(seed, pure_copy)
    assert pure.pop("compiled") is False
    assert installed.pop("compiled") is (not PURE_ON_PURPOSE)
    assert installed == pure
    stats = pure["stats"]
    assert isinstance(stats, dict)
    # the stream exercised what it is meant to
    assert stats["salt_rejected"] > 0 and stats["pruned"] > 0 and stats["resolve_requests"] > 0
    assert stats["clears"] == 1
    assert pure["records"] and pure["live"]


def import_setup() -> Any:
    """setup.py as a module (its build command and constants)."""
    sys.path.insert(0, str(ROOT))
    try:
        return importlib.import_module("setup")
    finally:
        sys.path.remove(str(ROOT))


def run_build(setup_module: Any, extensions: list[Any], tmp_path: Path) -> Any:
    """setup.py's OptionalNativeBuild run for real on `extensions`, into tmp_path / "lib"."""
    from setuptools import Distribution  # noqa: PLC0415

    dist = Distribution({"name": "continuum-kv-listener", "ext_modules": extensions})
    cmd = setup_module.OptionalNativeBuild(dist)
    cmd.build_lib = str(tmp_path / "lib")
    cmd.build_temp = str(tmp_path / "temp")
    cmd.ensure_finalized()
    cmd.run()
    return cmd


def test_a_build_without_a_working_compiler_installs_the_pure_core(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fallback of setup.py, run for real with a C compiler that always fails: mypyc
    translates the group, every compilation fails (the hand-written C modules' on their own,
    the group's as a whole), no extension is left in the build."""
    pytest.importorskip("mypyc.build")
    setup_module = import_setup()
    monkeypatch.setenv("CC", "/bin/false")
    monkeypatch.setenv("LDSHARED", "/bin/false")
    monkeypatch.delenv("KVL_PURE_PYTHON", raising=False)
    work = tmp_path / "src"
    shutil.copytree(ROOT / "kv_listener", work / "kv_listener",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    shutil.copy(ROOT / "setup.py", work / "setup.py")
    shutil.copy(ROOT / "pyproject.toml", work / "pyproject.toml")
    monkeypatch.chdir(work)
    monkeypatch.setattr(setup_module, "__file__", str(work / "setup.py"))
    extensions = setup_module._extensions()
    # a shim each, the group's library, and the C modules
    assert len(extensions) == len(native_modules()) + 1 + len(c_modules())
    cmd = run_build(setup_module, extensions, tmp_path)
    assert list((tmp_path / "lib").rglob("*.so")) == []
    assert cmd.extensions == []


def test_a_c_module_that_cannot_be_built_is_left_out_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hand-written C module whose build fails (here: its library is missing, as OpenSSL's
    is on a machine without libssl-dev) is dropped on its own; the other extensions of the
    same build are built and kept."""
    from setuptools import Extension  # noqa: PLC0415

    setup_module = import_setup()
    name = c_modules()[0]
    source, _ = setup_module.C_MODULES[name]
    (tmp_path / "ok.c").write_text(
        '#include <Python.h>\nstatic struct PyModuleDef m = {PyModuleDef_HEAD_INIT, "ok"};\n'
        "PyMODINIT_FUNC PyInit_ok(void) { return PyModule_Create(&m); }\n")
    monkeypatch.chdir(ROOT)
    extensions = [Extension(name, [source], libraries=["kvl_no_such_library"]),
                  Extension("ok", [str(tmp_path / "ok.c")])]
    cmd = run_build(setup_module, extensions, tmp_path)
    assert [p.name.split(".")[0] for p in (tmp_path / "lib").rglob("*.so")] == ["ok"]
    assert [e.name for e in cmd.extensions] == ["ok"]


def test_a_struct_read_by_position_is_pinned_to_its_field_order() -> None:
    """The hot paths unpack `astuple` tuples by position (decode, tracker, event log, SSE
    encoder); `fields_in_order` makes a moved field an import error, not a wrong value."""
    from kv_listener.core.model import PrefixTransition  # noqa: PLC0415
    from kv_listener.core.structs import fields_in_order  # noqa: PLC0415

    order = ("kind", "prefix_hash", "token_count", "tier")
    assert fields_in_order(PrefixTransition, order) == order
    with pytest.raises(ImportError, match="PrefixTransition's fields"):
        fields_in_order(PrefixTransition, ("prefix_hash", "kind", "token_count", "tier"))
