"""Build: the ingestion hot path compiled to C with mypyc, when it can be; pure Python otherwise.

Everything else about the package is in pyproject.toml. The modules of `NATIVE_MODULES` (the
decoder, tracker, event log and SSE encoder: what every engine event goes through) are strictly
typed, so mypyc compiles them as they are; compiled, they run the same frames in about a fifth
fewer CPU instructions (bench/instructions.py). Nothing in them changes: the .py files stay
beside the extension modules and are what runs when these are absent.

The build is all or nothing. mypyc emits one shared library for the group plus one small shim per
module; a shim without its library would fail to import. So when mypyc is missing or any part
fails to compile (no C compiler, no Python headers), every extension of the group is dropped
and the package installs as pure Python, with a warning in pip's output. `KVL_PURE_PYTHON=1`
in the environment of the build skips the compilation on purpose.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from setuptools import setup
from setuptools.command.build_ext import build_ext

#: The compiled modules (paths from the project root). tests/test_native.py checks that an
#: installed build imports each of them compiled and that they agree with the pure modules.
NATIVE_MODULES = [
    "kv_listener/core/blocks.py",
    "kv_listener/core/chains.py",
    "kv_listener/core/decode.py",
    "kv_listener/core/decode_events.py",
    "kv_listener/core/decode_trtllm.py",
    "kv_listener/core/eventlog.py",
    "kv_listener/core/limits.py",
    "kv_listener/core/record_state.py",
    "kv_listener/core/records.py",
    "kv_listener/core/salt.py",
    "kv_listener/core/sse.py",
    "kv_listener/core/tracker.py",
]
GROUP = "kv_listener_native"  # the shared library: kv_listener_native__mypyc.*.so


def _warn(message: str) -> None:
    print(f"continuum-kv-listener: {message}; installing the pure-Python core", file=sys.stderr)


class OptionalNativeBuild(build_ext):
    """`build_ext` that falls back to no extension at all when any of them fails."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # a compiler or linker failure of any kind
            _warn(f"compiling the native core failed ({type(exc).__name__}: {exc})")
            self._drop_all()

    def _drop_all(self) -> None:
        for path in self.get_outputs():
            Path(path).unlink(missing_ok=True)
        self.extensions = []
        self.distribution.ext_modules = []


def _extensions() -> list[Any]:
    if os.environ.get("KVL_PURE_PYTHON") == "1":
        return []
    try:
        from mypyc.build import mypycify  # noqa: PLC0415 (a build requirement, optional)
    except ImportError:
        _warn("mypyc is not installed")
        return []
    here = Path(__file__).resolve().parent
    os.chdir(here)  # mypyc works from the project root (module names from relative paths)
    try:
        # The type checking is the project's (pyproject's [tool.mypy]); its sections for modules
        # outside the group are not "unused" here.
        return list(mypycify(["--no-warn-unused-configs", *NATIVE_MODULES], opt_level="3",
                             group_name=GROUP))
    except BaseException as exc:  # mypyc exits through SystemExit
        _warn(f"mypyc could not translate the core ({type(exc).__name__}: {exc})")
        return []


if __name__ == "__main__":  # setuptools runs this file as __main__; tests import its parts
    setup(ext_modules=_extensions(), cmdclass={"build_ext": OptionalNativeBuild})
