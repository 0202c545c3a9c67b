"""`fixtures/make_push_golden.py` loaded as a module: the scripted event sequence behind
`fixtures/push_stream_golden.sse`, shared by the push-mode tests on both sides."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from tests.conftest import FIXTURES


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_push_golden", FIXTURES / "make_push_golden.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("make_push_golden", module)
    spec.loader.exec_module(module)
    return module


golden = _load()
