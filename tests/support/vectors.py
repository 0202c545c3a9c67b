"""The SPEC's golden vectors (§2 prefix keys, §3 cache salt), loaded from `fixtures/vectors/spec.json`
so that every test checks against one copy of them instead of its own retyped hex."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

_SPEC: dict[str, Any] = json.loads(
    (Path(__file__).resolve().parents[2] / "fixtures" / "vectors" / "spec.json").read_text("utf-8"))


class PrefixVector(NamedTuple):
    model: str
    system: str | None
    first_message: str | None
    prefix_hash: str


class SaltVector(NamedTuple):
    secret: bytes
    backend: str
    key_vector: PrefixVector  # the §2 vector whose key the salt carries
    salt: str


PREFIX_VECTORS: dict[str, PrefixVector] = {
    v["name"]: PrefixVector(v["model"], v["system"], v["first_message"], v["prefix_hash"])
    for v in _SPEC["prefix_keys"]
}
_salt = _SPEC["cache_salt"]
SALT_VECTOR = SaltVector(_salt["secret"].encode(), _salt["backend"], PREFIX_VECTORS[_salt["key_of"]],
                         _salt["salt"])
