"""Cache salts (SPEC §3): the SPEC vector, exact verification, forgeries."""

from __future__ import annotations

import hashlib
import hmac
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kv_listener.core.prefix import prefix_key
from kv_listener.core.salt import (
    _NATIVE,
    SALT_LENGTH,
    SALT_PREFIX,
    SaltVerifier,
    issue_cache_salt,
    verify_cache_salt,
)
from tests.support.vectors import SALT_VECTOR

SECRET = SALT_VECTOR.secret
_kv = SALT_VECTOR.key_vector
_key = prefix_key(_kv.model, _kv.system, _kv.first_message)
assert _key is not None
KEY: bytes = _key
VECTOR = SALT_VECTOR.salt
BACKEND = SALT_VECTOR.backend  # "vllm-1"


def test_spec_vector() -> None:
    assert issue_cache_salt(SECRET, BACKEND, KEY) == VECTOR
    assert len(VECTOR) == SALT_LENGTH == 102
    assert VECTOR.startswith(SALT_PREFIX)


def test_valid_salt_returns_key() -> None:
    assert verify_cache_salt(SECRET, BACKEND, VECTOR) == KEY


def test_fits_vllm_limits() -> None:
    # vLLM >= 0.30: at most 128 characters, none of @ / \ NUL.
    assert len(VECTOR) <= 128
    assert not set(VECTOR) & {"@", "/", "\\", "\x00"}


def test_other_backend_is_rejected() -> None:
    assert verify_cache_salt(SECRET, "vllm-2", VECTOR) is None


def test_other_secret_is_rejected() -> None:
    assert verify_cache_salt(b"s3cret2", BACKEND, VECTOR) is None


def test_forged_mac_is_rejected() -> None:
    last = VECTOR[-1]
    forged = VECTOR[:-1] + ("0" if last != "0" else "1")
    assert verify_cache_salt(SECRET, BACKEND, forged) is None


def test_swapped_key_with_old_mac_is_rejected() -> None:
    other = prefix_key("m", "other", None)
    assert other is not None
    forged = SALT_PREFIX + other.hex() + VECTOR[len(SALT_PREFIX) + 64:]
    assert verify_cache_salt(SECRET, BACKEND, forged) is None


@pytest.mark.parametrize("salt", [
    VECTOR[:-1],  # truncated
    VECTOR + "0",  # too long
    VECTOR.upper(),  # uppercase hex (and prefix)
    VECTOR[:5] + VECTOR[5:].upper(),  # uppercase hex only
    VECTOR[:-2] + "AB" if VECTOR[-2:] != "AB" else VECTOR[:-2] + "CD",
    "crs2" + VECTOR[4:],  # wrong version
    VECTOR[:69] + ";" + VECTOR[70:],  # wrong separator
    VECTOR[:10] + "g" + VECTOR[11:],  # not hex
    VECTOR[:10] + "가" + VECTOR[11:],  # non-ASCII, same length in characters
    "",
    "crs1:",
])
def test_malformed_salts_are_invalid(salt: str) -> None:
    assert verify_cache_salt(SECRET, BACKEND, salt) is None


def test_non_string_is_invalid() -> None:
    assert verify_cache_salt(SECRET, BACKEND, None) is None  # type: ignore[arg-type]
    assert verify_cache_salt(SECRET, BACKEND, VECTOR.encode()) is None  # type: ignore[arg-type]


def test_issue_rejects_a_wrong_key_length() -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        issue_cache_salt(SECRET, BACKEND, b"short")


@given(st.binary(min_size=1, max_size=64), st.from_regex(r"[A-Za-z0-9_-]{1,64}", fullmatch=True),
       st.binary(min_size=32, max_size=32))
def test_round_trip_and_binding(secret: bytes, backend: str, key: bytes) -> None:
    salt = issue_cache_salt(secret, backend, key)
    assert len(salt) == SALT_LENGTH and salt.isascii() and salt == salt.lower()
    assert verify_cache_salt(secret, backend, salt) == key
    assert verify_cache_salt(secret, backend + "x", salt) is None
    assert verify_cache_salt(secret + b"x", backend, salt) is None


@given(st.binary(min_size=32, max_size=32), st.integers(0, SALT_LENGTH - 1),
       st.sampled_from("0123456789abcdefABCDEF:g\n가"))
def test_the_bound_verifier_agrees_with_verify_cache_salt(key: bytes, pos: int, ch: str) -> None:
    """The listener's verifier (precomputed HMAC head, remembered salts) answers exactly as the
    reference function, for valid salts and salts with one character changed, asked twice."""
    verifier = SaltVerifier(SECRET, BACKEND, cache_size=8)
    good = issue_cache_salt(SECRET, BACKEND, key)
    bad = good[:pos] + ch + good[pos + 1:]
    for salt in (good, bad, good, bad, good + "\n", VECTOR):
        assert verifier(salt) == verify_cache_salt(SECRET, BACKEND, salt)
    assert verifier(None) is None  # type: ignore[arg-type]
    assert SaltVerifier(SECRET, "vllm-2")(good) is None


@pytest.mark.parametrize("native", [
    pytest.param(True, marks=pytest.mark.skipif(_NATIVE is None, reason="_saltmac not built")),
    False,
])
@given(st.sampled_from([0, 1, 31, 63, 64, 65, 100, 200]), st.randoms(use_true_random=False),
       st.sampled_from(["b", "vllm-1", "x" * 80, "backend-가-1"]))
def test_the_verifier_computes_rfc_2104_hmac_for_every_secret_length(
    native: bool, n: int, rnd: random.Random, backend: str,
) -> None:
    """The verifier builds HMAC-SHA256 from two precomputed hash states (RFC 2104 by hand, for
    speed): the MAC it accepts is the `hmac` module's, for secrets shorter than, equal to and
    longer than SHA-256's 64-byte block (a longer key is hashed first) and for message heads
    that span a block; one bit off in the MAC and it refuses. Both checks: the C module's
    (`core._saltmac`) and SaltVerifier's own Python."""
    secret, key = rnd.randbytes(n), rnd.randbytes(32)
    msg = b"crs1\x00" + backend.encode() + b"\x00" + key
    mac = hmac.new(secret, msg, hashlib.sha256).hexdigest()[:32]
    salt = f"crs1:{key.hex()}:{mac}"
    verifier = SaltVerifier(secret, backend, cache_size=0, native=native)
    assert verifier(salt) == key
    flipped = f"{int(mac[-1], 16) ^ 1:x}"
    assert verifier(salt[:-1] + flipped) is None


class _Text(str):
    pass


def test_the_c_check_takes_str_subclasses_and_refuses_other_types() -> None:
    """What SaltVerifier's Python accepts (`isinstance(salt, str)`), the C check accepts; a
    wrong-length padded secret is refused when it is built, not at the first salt."""
    if _NATIVE is None:
        pytest.skip("_saltmac not built")
    for native in (True, False):
        verifier = SaltVerifier(SECRET, BACKEND, cache_size=0, native=native)
        assert verifier(_Text(VECTOR)) == KEY
        for other in (VECTOR.encode(), bytearray(VECTOR.encode()), 7, None, [VECTOR]):
            assert verifier(other) is None
    key_hex = SaltVerifier(SECRET, BACKEND).verify_hex(_Text(VECTOR))
    assert type(key_hex) is str and key_hex == KEY.hex()
    with pytest.raises(ValueError, match="64 bytes"):
        _NATIVE(b"short", b"crs1\x00b\x00")
    with pytest.raises(TypeError):
        _NATIVE("not bytes", b"")


def test_the_verifier_cache_is_bounded() -> None:
    verifier = SaltVerifier(SECRET, BACKEND, cache_size=16, native=False)
    salts = [issue_cache_salt(SECRET, BACKEND, bytes([i]) * 32) for i in range(100)]
    for i, salt in enumerate(salts):
        assert verifier(salt) == bytes([i]) * 32
        assert len(verifier._cache) <= 16
    assert verifier(salts[-1]) == bytes([99]) * 32


def test_the_c_verdict_table_answers_only_for_the_same_salt() -> None:
    """The C check keeps the last verdicts by key: a salt seen again gets its verdict back, but
    only for the same key and MAC text; a forgery of a remembered key (another MAC), a valid
    salt after its forgery was remembered, and keys that share the slot all get their own."""
    if _NATIVE is None:
        pytest.skip("_saltmac not built")
    verifier = SaltVerifier(SECRET, BACKEND, cache_size=4)
    forged = VECTOR[:-1] + ("0" if VECTOR[-1] != "0" else "1")
    for _ in range(3):
        assert verifier(VECTOR) == KEY
        assert verifier(forged) is None
    # keys equal in their first 8 bytes share a slot of any table
    keys = [KEY[:8] + bytes([i]) * 24 for i in range(6)]
    salts = [issue_cache_salt(SECRET, BACKEND, k) for k in keys]
    bad = [s[:-1] + ("0" if s[-1] != "0" else "1") for s in salts]
    for _ in range(2):
        for key, salt, forgery in zip(keys, salts, bad, strict=True):
            assert verifier(salt) == key
            assert verifier(forgery) is None
            assert verifier(salt) == key
    assert SaltVerifier(SECRET, "vllm-2", cache_size=4)(VECTOR) is None


@pytest.mark.parametrize(("cache_size", "slots"), [(0, 0), (1, 1), (16, 16), (100, 128),
                                                   (4096, 4096)])
def test_the_c_verdict_table_is_bounded_in_bytes(cache_size: int, slots: int) -> None:
    """The table is allocated once, `cache_size` rounded up to a power of two, 65 bytes a slot
    (key, MAC text, verdict), however many salts go through it."""
    if _NATIVE is None:
        pytest.skip("_saltmac not built")
    head = b"crs1\x00" + BACKEND.encode() + b"\x00"
    table = _NATIVE(SECRET.ljust(64, b"\x00"), head, cache_size)
    assert table.cache_bytes == slots * 65
    for i in range(300):
        salt = issue_cache_salt(SECRET, BACKEND, i.to_bytes(32, "big"))
        assert table.verify_hex(salt) == i.to_bytes(32, "big").hex()
    assert table.cache_bytes == slots * 65
    for wrong in (-1, 1 << 25):
        with pytest.raises(ValueError, match="cache_size"):
            _NATIVE(SECRET.ljust(64, b"\x00"), head, wrong)


def test_router_module_exports_the_salt_and_key_functions() -> None:
    from kv_listener import router  # noqa: PLC0415

    key = router.request_prefix_key({"model": _kv.model, "messages": [
        {"role": "system", "content": _kv.system}, {"role": "user", "content": "hi"}]})
    assert key is not None
    assert router.issue_cache_salt(SECRET, BACKEND, key) == VECTOR
