"""Cache salts (SPEC §3): a router-issued, listener-verified proof of a chain's prefix key.

Owns the salt format and its exact verification. The router calls `issue_cache_salt` and sends
the result as the request's `cache_salt`; the engine echoes it on the chain's first stored
block; the listener calls `verify_cache_salt` with its own `backend_name` and, on success, takes
the key without detokenizing anything.

    cache_salt = "crs1:" + hex(key) + ":" + hex(HMAC-SHA256(secret,
                  "crs1" 0x00 backend 0x00 key)[:16])

102 ASCII characters: fits vLLM >= 0.30's 128-character limit and avoids its forbidden
characters (`@`, `/`, `\\`, NUL). Pure: no I/O; secrets are passed in as bytes.
"""

from __future__ import annotations

import hmac
import re
from hashlib import sha256

SALT_PREFIX = "crs1:"
_MAC_DOMAIN = b"crs1"
KEY_BYTES = 32
_MAC_BYTES = 16
#: "crs1:" + 64 hex + ":" + 32 hex
SALT_LENGTH = len(SALT_PREFIX) + 2 * KEY_BYTES + 1 + 2 * _MAC_BYTES


def _mac(secret: bytes, backend: str, key: bytes) -> bytes:
    msg = _MAC_DOMAIN + b"\x00" + backend.encode("utf-8") + b"\x00" + key
    return hmac.new(secret, msg, sha256).digest()[:_MAC_BYTES]


def issue_cache_salt(secret: bytes, backend: str, key: bytes) -> str:
    """The `cache_salt` a router sends to `backend` for a request whose prefix key is `key`."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"key must be {KEY_BYTES} bytes, got {len(key)}")
    return f"{SALT_PREFIX}{key.hex()}:{_mac(secret, backend, key).hex()}"


#: The whole salt, exactly: lowercase hex only (no `$`: it would accept a trailing newline).
_SALT_RE = re.compile(r"crs1:([0-9a-f]{64}):([0-9a-f]{32})")


def verify_cache_salt(secret: bytes, backend: str, salt: str) -> bytes | None:
    """The 32-byte key a valid salt carries, or None.

    Exact: wrong length, wrong prefix or separator, uppercase or non-hex digits, and a MAC made
    for another backend or with another secret are all invalid. The MAC comparison is constant
    time (`hmac.compare_digest`). A listener verifying many salts uses `SaltVerifier`.
    """
    return SaltVerifier(secret, backend, cache_size=0)(salt)


class SaltVerifier:
    """`verify_cache_salt` bound to one secret and backend, for the hot path: the HMAC state of
    the fixed message head is computed once and copied per salt (1.5 us instead of 2.4 us for a
    fresh HMAC), and the last `cache_size` distinct salts are remembered (every request of the
    same prefix key carries the same salt, so a chat workload verifies each once). The cache is
    bounded: when full it starts over."""

    __slots__ = ("_base", "_cache", "_cache_size")

    def __init__(self, secret: bytes, backend: str, *, cache_size: int = 4096) -> None:
        self._base = hmac.new(secret, _MAC_DOMAIN + b"\x00" + backend.encode("utf-8") + b"\x00",
                              "sha256")
        self._cache: dict[str, bytes | None] = {}
        self._cache_size = cache_size

    def __call__(self, salt: str) -> bytes | None:
        if not isinstance(salt, str):
            return None
        cache = self._cache
        if salt in cache:
            return cache[salt]
        key = self._verify(salt)
        if self._cache_size:
            if len(cache) >= self._cache_size:
                cache.clear()
            cache[salt] = key
        return key

    def _verify(self, salt: str) -> bytes | None:
        if len(salt) != SALT_LENGTH:
            return None
        m = _SALT_RE.fullmatch(salt)
        if m is None:
            return None
        key_hex, mac_hex = m.groups()
        key = bytes.fromhex(key_hex)
        mac = self._base.copy()
        mac.update(key)
        if not hmac.compare_digest(mac.digest()[:_MAC_BYTES].hex(), mac_hex):
            return None
        return key
