"""The hand-written C modules of setup.py's `C_MODULES`, each optional: `c_attr` gives one of
their attributes, or None where that module was not built (no compiler, no OpenSSL headers,
`KVL_PURE_PYTHON=1`), and the caller's Python stand-in runs. Pure: no I/O beyond the import.
"""

from __future__ import annotations

import importlib
from typing import Any


def c_attr(module: str, name: str) -> Any:
    """`kv_listener.core.<module>.<name>`, or None when the module is absent."""
    try:
        return getattr(importlib.import_module(f"kv_listener.core.{module}"), name)
    except ImportError:
        return None
