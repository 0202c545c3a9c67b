"""The hot-path salt check (`SaltVerifier`, issue 13) gives the verdicts of the salt's reference
form: `_SALT_RE` and a fresh HMAC, on valid salts and on every kind of one-character damage.
Each test runs both checks: the C module's (`core._saltmac`, where built) and the Python one."""

from __future__ import annotations

import hmac
from hashlib import sha256

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kv_listener.core.salt import _NATIVE, _SALT_RE, SaltVerifier, issue_cache_salt

SECRET = b"perf-secret"
BACKEND = "vllm-1"


def reference(salt: str) -> bytes | None:
    """The verdict as the regular expression and a fresh HMAC give it."""
    m = _SALT_RE.fullmatch(salt)
    if m is None:
        return None
    key = bytes.fromhex(m.group(1))
    mac = hmac.new(SECRET, b"crs1\x00" + BACKEND.encode() + b"\x00" + key, sha256).digest()
    return key if hmac.compare_digest(mac[:16].hex(), m.group(2)) else None


# True: the C check (skipped where it was not built); False: SaltVerifier's own Python
both_checks = pytest.mark.parametrize("native", [
    pytest.param(True, marks=pytest.mark.skipif(_NATIVE is None, reason="_saltmac not built")),
    False,
])

_CHARS = st.sampled_from("0123456789abcdefABCDEFgz: \t\n\x0b\x00é가crs1")


@both_checks
@given(key=st.binary(min_size=32, max_size=32), pos=st.integers(0, 101), char=_CHARS)
def test_one_damaged_character(native: bool, key: bytes, pos: int, char: str) -> None:
    salt = issue_cache_salt(SECRET, BACKEND, key)
    damaged = salt[:pos] + char + salt[pos + 1:]
    verify = SaltVerifier(SECRET, BACKEND, cache_size=0, native=native)
    assert verify(salt) == reference(salt) == key
    assert verify(damaged) == reference(damaged)
    if damaged != salt:
        assert verify(damaged) is None


@both_checks
@given(key=st.binary(min_size=32, max_size=32), cut=st.integers(0, 102), extra=st.text(max_size=3))
def test_cut_or_extended(native: bool, key: bytes, cut: int, extra: str) -> None:
    salt = issue_cache_salt(SECRET, BACKEND, key)
    other = salt[:cut] + extra
    assert SaltVerifier(SECRET, BACKEND, native=native)(other) == reference(other)


@both_checks
def test_whitespace_inside_the_key_hex_is_refused(native: bool) -> None:
    # bytes.fromhex skips ASCII whitespace: "ab cd" would pass a check by fromhex alone.
    salt = issue_cache_salt(SECRET, BACKEND, bytes(range(32)))
    spaced = salt[:5] + " " + salt[6:]
    assert reference(spaced) is None
    assert SaltVerifier(SECRET, BACKEND, native=native)(spaced) is None
    upper = salt[:5] + salt[5:69].upper() + salt[69:]
    assert SaltVerifier(SECRET, BACKEND, native=native)(upper) is None
    upper_mac = salt[:70] + salt[70:].upper()
    assert upper_mac != salt
    assert SaltVerifier(SECRET, BACKEND, native=native)(upper_mac) is None
