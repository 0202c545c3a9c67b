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
import importlib
import re
from hashlib import sha256
from typing import Any, Final

from kv_listener.core.cmodules import c_attr


def _cheap_sha256() -> Any:
    """A SHA-256 constructor whose objects copy cheaply: CPython's own (3.11: `_sha256`, 3.12+:
    `_sha2`), whose copy() is a struct copy; else OpenSSL's (the same digests, dearer copies)."""
    for name in ("_sha256", "_sha2"):
        try:
            return importlib.import_module(name).sha256
        except (ImportError, AttributeError):  # pragma: no cover - other Pythons
            continue
    return sha256  # pragma: no cover


_state: Final[Any] = _cheap_sha256()


#: `_saltmac.Verifier`: the same check in one C call, or None where it was not built (then
#: SaltVerifier's own Python runs)
_NATIVE: Final[Any] = c_attr("_saltmac", "Verifier")

# The state type's methods, looked up once: compiled (setup.py), `obj.copy()` on an untyped
# object looks the name up on every call; a method descriptor held as a C static is called
# directly (a salt takes five such calls).
_STATE_TYPE: Final[Any] = type(_state(b""))
_copy: Final[Any] = _STATE_TYPE.copy
_update: Final[Any] = _STATE_TYPE.update
_digest: Final[Any] = _STATE_TYPE.digest
_hexdigest: Final[Any] = _STATE_TYPE.hexdigest
_compare_digest: Final = hmac.compare_digest
# The same for the str and bytes methods a salt's form check calls (compiled, `s.isascii()` is a
# call by name: a method lookup on every call, about 150 instructions each).
_isascii: Final[Any] = str.isascii
_fromhex: Final[Any] = bytes.fromhex
_hex: Final[Any] = bytes.hex

# Final: compiled (setup.py), constants are C statics, not a module dict lookup per read
SALT_PREFIX: Final = "crs1:"
_MAC_DOMAIN: Final = b"crs1"
KEY_BYTES: Final = 32
_MAC_BYTES: Final = 16
#: "crs1:" + 64 hex + ":" + 32 hex
SALT_LENGTH: Final = len(SALT_PREFIX) + 2 * KEY_BYTES + 1 + 2 * _MAC_BYTES
_KEY_END: Final = len(SALT_PREFIX) + 2 * KEY_BYTES  # index of the ":" before the MAC
_BLOCK: Final = 64  # SHA-256's block size: HMAC's key pad length
# RFC 2104's pads as byte maps (the stdlib `hmac` module's own way: one C call per pad)
_IPAD: Final = bytes(x ^ 0x36 for x in range(256))
_OPAD: Final = bytes(x ^ 0x5C for x in range(256))


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


def verify_cache_salt(secret: bytes, backend: str, salt: object) -> bytes | None:
    """The 32-byte key a valid salt carries, or None.

    Exact: wrong length, wrong prefix or separator, uppercase or non-hex digits, and a MAC made
    for another backend or with another secret are all invalid. The MAC comparison is constant
    time (`hmac.compare_digest`). A listener verifying many salts uses `SaltVerifier`.
    """
    return SaltVerifier(secret, backend, cache_size=0)(salt)


class SaltVerifier:
    """`verify_cache_salt` bound to one secret and backend, for the hot path: the HMAC's inner
    and outer SHA-256 states after the key pads and the fixed message head are computed once and
    copied per salt (RFC 2104 over CPython's built-in SHA-256, whose copy is a struct copy: the
    `hmac` module's objects are OpenSSL HMAC contexts, and copying, finishing and freeing one
    per salt cost about 12k instructions, the two hash states about 7k; `hmac` itself has no
    precomputed-pad interface), the salt's form is checked without a regular expression (same
    verdicts as `_SALT_RE`, about a third of the cost), and the last `cache_size` distinct salts
    are remembered (every request of the same prefix key carries the same salt, so a chat
    workload verifies each once). The cache is bounded: when full it starts over.

    Where setup.py built `core._saltmac`, the whole check is one C call with the same verdicts
    (its HMAC over OpenSSL's SHA-256: about a tenth of the instructions of the Python below,
    which stays as the reference and runs where the module is absent), and the last verdicts
    are kept there: a table of `cache_size` slots (rounded up to a power of two, 65 bytes
    each) indexed by the salt's key, where a new salt costs one comparison, not a dict entry."""

    __slots__ = ("_cache", "_cache_size", "_inner", "_native", "_outer")

    def __init__(self, secret: bytes, backend: str, *, cache_size: int = 4096,
                 native: bool = True) -> None:
        head = _MAC_DOMAIN + b"\x00" + backend.encode("utf-8") + b"\x00"
        # RFC 2104: a key longer than the block (64 bytes) is hashed first, then zero-padded
        k = (sha256(secret).digest() if len(secret) > _BLOCK else secret).ljust(_BLOCK, b"\x00")
        self._inner: Any = _state(k.translate(_IPAD) + head)
        self._outer: Any = _state(k.translate(_OPAD))
        # `native=False`: this class's own Python even where the C module is built (tests)
        self._native: Any = (_NATIVE(k, head, cache_size).verify_hex
                             if native and _NATIVE is not None else None)
        self._cache: dict[str, str] = {}  # salt -> its key's hex, "" for an invalid salt
        self._cache_size = cache_size

    def __call__(self, salt: object) -> bytes | None:
        return self.verify(salt)

    def verify(self, salt: object) -> bytes | None:
        """The key `salt` carries, or None (`verify_cache_salt`)."""
        key_hex = self.verify_hex(salt)
        return None if key_hex is None else bytes.fromhex(key_hex)

    def verify_hex(self, salt: object) -> str | None:
        """The key `salt` carries as 64 lowercase hex digits (its `prefix_hash`), or None: the
        tracker's call, which keeps the key as that text only. Compiled callers call this
        method: mypyc calls a method directly, an object's `__call__` through Python."""
        native = self._native
        if native is not None:
            verdict: str | None = native(salt)  # its own form check and verdict table
            return verdict
        if not isinstance(salt, str):
            return None
        cache = self._cache
        known = cache.get(salt)  # one lookup: a salt is hashed once, its str keeps the hash
        if known is not None:
            return known or None
        key_hex = self._verify(salt)
        if self._cache_size:
            if len(cache) >= self._cache_size:
                cache.clear()
            cache[salt] = key_hex or ""
        return key_hex

    def _verify(self, salt: str) -> str | None:
        # What `_SALT_RE.fullmatch` accepts, checked piecewise: ASCII (compare_digest refuses
        # other text), the exact length, prefix and separator; a key part of 64 hex digits that
        # are all lowercase (fromhex also takes uppercase and skips whitespace: its bytes must
        # give the same text back); a MAC part equal to the lowercase hex of the MAC.
        if (len(salt) != SALT_LENGTH or not _isascii(salt) or not salt.startswith(SALT_PREFIX)
                or salt[_KEY_END] != ":"):
            return None
        key_hex = salt[len(SALT_PREFIX):_KEY_END]
        try:
            key: bytes = _fromhex(key_hex)
        except ValueError:
            return None
        if _hex(key) != key_hex:
            return None
        inner = _copy(self._inner)
        _update(inner, key)
        outer = _copy(self._outer)
        _update(outer, _digest(inner))
        mac: str = _hexdigest(outer)  # typed: a str slice, not a generic one
        if not _compare_digest(mac[:2 * _MAC_BYTES], salt[_KEY_END + 1:]):
            return None
        return key_hex
