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

`C_MODULES` are C written by hand, for steps whose cost mypyc cannot take away (the salt
check's SHA-256, the SSE encoder's reads of a Struct's fields, token IDs made Python ints only
to be copied into an array). Each is optional on its own: a compiler or library missing for one
leaves that module out, with a warning, and the Python it stands in for runs;
`KVL_PURE_PYTHON=1` skips them too.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from setuptools import Extension, setup
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
#: Hand-written C modules (module: source, libraries), each optional on its own: one that fails
#: to build is left out and the Python it stands in for runs (a warning in pip's output).
#: tests/test_native.py checks that an installed build has them.
C_MODULES = {
    # core/salt.py's HMAC from precomputed pad states, over OpenSSL's SHA-256 (libssl-dev)
    "kv_listener.core._saltmac": ("kv_listener/core/_saltmac.c", ["crypto"]),
    # core/sse.py's encode_record_list: the fields of a Record read at their slots' offsets
    "kv_listener.core._sseenc": ("kv_listener/core/_sseenc.c", []),
    # core/decode_events.py's raw_tokens: msgpack token IDs straight into an array("I")
    "kv_listener.core._wiretok": ("kv_listener/core/_wiretok.c", []),
}


def _warn(message: str) -> None:
    print(f"continuum-kv-listener: {message}; installing the pure-Python core", file=sys.stderr)


class OptionalNativeBuild(build_ext):
    """`build_ext` that falls back to no mypyc extension at all when any of them fails, and
    leaves out a `C_MODULES` extension that fails on its own."""

    def run(self) -> None:
        self._failed: set[str] = set()  # C_MODULES left out
        try:
            super().run()
        except Exception as exc:  # a compiler or linker failure of any kind
            _warn(f"compiling the native core failed ({type(exc).__name__}: {exc})")
            self._drop(lambda ext: ext.name not in C_MODULES)
        # after the build loop, which iterates the list
        self._drop(lambda ext: ext.name in self._failed)

    def build_extension(self, ext: Any) -> None:
        if ext.name not in C_MODULES:
            super().build_extension(ext)
            return
        try:
            super().build_extension(ext)
        except Exception as exc:  # no compiler, no OpenSSL headers: its Python stays
            print(f"continuum-kv-listener: building {ext.name} failed ({type(exc).__name__}: "
                  f"{exc}); its pure-Python version runs instead", file=sys.stderr)
            self._failed.add(ext.name)

    def _drop(self, which: Any) -> None:
        for ext in [e for e in self.extensions if which(e)]:
            Path(self.get_ext_fullpath(ext.name)).unlink(missing_ok=True)
            self.extensions.remove(ext)
            if ext in (self.distribution.ext_modules or []):
                self.distribution.ext_modules.remove(ext)


def _extensions() -> list[Any]:
    if os.environ.get("KVL_PURE_PYTHON") == "1":
        return []
    c_modules = [Extension(name, [source], libraries=libraries, extra_compile_args=["-O2"])
                 for name, (source, libraries) in C_MODULES.items()]
    return c_modules + _mypyc_extensions()


def _mypyc_extensions() -> list[Any]:
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
