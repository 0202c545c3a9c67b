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
from hashlib import sha256

SALT_PREFIX = "crs1:"
_MAC_DOMAIN = b"crs1"
KEY_BYTES = 32
_MAC_BYTES = 16
_HEX = frozenset("0123456789abcdef")
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


def _is_lower_hex(s: str) -> bool:
    return all(c in _HEX for c in s)


def verify_cache_salt(secret: bytes, backend: str, salt: str) -> bytes | None:
    """The 32-byte key a valid salt carries, or None.

    Exact: wrong length, wrong prefix or separator, uppercase or non-hex digits, and a MAC made
    for another backend or with another secret are all invalid. The MAC comparison is constant
    time (`hmac.compare_digest`).
    """
    if not isinstance(salt, str) or len(salt) != SALT_LENGTH or not salt.isascii():
        return None
    if not salt.startswith(SALT_PREFIX):
        return None
    key_hex = salt[len(SALT_PREFIX) : len(SALT_PREFIX) + 2 * KEY_BYTES]
    sep = salt[len(SALT_PREFIX) + 2 * KEY_BYTES]
    mac_hex = salt[len(SALT_PREFIX) + 2 * KEY_BYTES + 1 :]
    if sep != ":" or not _is_lower_hex(key_hex) or not _is_lower_hex(mac_hex):
        return None
    key = bytes.fromhex(key_hex)
    expected = _mac(secret, backend, key).hex()
    if not hmac.compare_digest(expected, mac_hex):
        return None
    return key
