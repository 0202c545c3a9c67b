"""The configuration toolkit both YAML files are read with: the listener's (`kv_listener.config`)
and the router's (`kv_listener.router.config`).

Owns what the two files share: the strict YAML reader (a key given twice is an error), the
`Reader` that walks a tree and collects every error with its YAML path (`sources[1].model: ...`)
instead of stopping at the first, the scalar forms (durations, `host:port` addresses, URLs,
`[A-Za-z0-9_-]{1,64}` names), the `log` block, loopback checks, secrets read from a file or an
environment variable, and the "did you mean" hint. What a key means, and its default, belongs to
the file that has it, not here.

Imports only the standard library, PyYAML and `kv_listener.errors`, so the router can use it
without importing the listener's configuration (issue 15: the layers point one way).
"""

from __future__ import annotations

import difflib
import enum
import ipaddress
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import yaml

from kv_listener.errors import ConfigError

__all__ = [
    "BACKEND_NAME_RE",
    "LOG_FORMATS",
    "LOG_LEVELS",
    "ConfigError",
    "LogConfig",
    "Reader",
    "YamlContentError",
    "check_url",
    "did_you_mean",
    "is_loopback",
    "is_router_file",
    "parse_duration",
    "parse_listen",
    "parse_log",
    "read_secret",
    "read_yaml",
    "root_mapping",
    "type_name",
]


BACKEND_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)\s*$")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}

# Key names that would hold a secret inline. They are refused with a pointer to the file/env form
# (a credential in a config file ends up in backups, tickets and `ps` of config-management tools).
_INLINE_SECRET_KEYS = frozenset(
    {"credential", "token", "bearer_token", "secret", "password", "api_key", "key", "client_key"}
)


class YamlContentError(ConfigError):
    """The file was read but is not acceptable YAML (a syntax error, duplicate keys).
    `problems` are the messages without the file name, for `config validate`'s own format."""

    def __init__(self, path: str | Path, problems: list[str]) -> None:
        super().__init__([f"{path}: {p}" for p in problems])
        self.problems = problems


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader, except that a key given twice in one mapping is recorded instead of
    silently keeping the last value (a second `listen:` would expose the listener unnoticed).
    Keys brought in by a merge (`<<: *anchor`) may still be overridden: that is what merges are
    for."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.duplicates: list[tuple[int, int, str]] = []

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first: dict[Any, yaml.Mark] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            mark = key_node.start_mark
            try:
                seen = first.setdefault(key, mark)
            except TypeError:  # an unhashable key: SafeConstructor reports it below
                continue
            if seen is not mark:
                self.duplicates.append((mark.line, mark.column,
                                        f"line {mark.line + 1}, column {mark.column + 1}: duplicate"
                                        f" key {key!r} (first at line {seen.line + 1}); remove one"))
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str | Path) -> Any:
    """Read a YAML file. A file that cannot be read raises `ConfigError` (one line); a syntax
    error or duplicate keys raise `YamlContentError` (every duplicate at once). No traceback
    material either way."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError([f"{path}: no such file"]) from None
    except IsADirectoryError:
        raise ConfigError([f"{path}: is a directory"]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([f"{path}: cannot read: {exc}"]) from None
    loader = _StrictLoader(text)
    try:
        data = loader.get_single_data()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise YamlContentError(path, [f"{where}invalid YAML: {problem}"]) from None
    except RecursionError:
        raise YamlContentError(path, ["invalid YAML: nested too deeply"]) from None
    finally:
        loader.dispose()
    if loader.duplicates:
        raise YamlContentError(path, [text for *_, text in sorted(loader.duplicates)])
    return data


def parse_duration(text: str) -> float:
    """`"250ms"`, `"5s"`, `"1m"`, `"1h"` -> seconds. Raises ValueError."""
    m = _DURATION_RE.match(text)
    if not m:
        raise ValueError(f"invalid duration {text!r} (expected e.g. '500ms', '5s', '1m')")
    return float(m.group(1)) * _DURATION_UNITS[m.group(2)]


def parse_listen(text: str) -> tuple[str, int]:
    """`"127.0.0.1:7817"` or `"[::1]:7817"` -> (host, port). Raises ValueError."""
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
    else:
        host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"invalid address {text!r} (expected 'host:port')")
    return host, int(port)


T = TypeVar("T")
E = TypeVar("E", bound=enum.Enum)


class Reader:
    """Walks a YAML tree (listener or router file) and collects errors with their paths
    instead of stopping at the first."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.warnings: list[str] = []

    def error(self, path: str, message: str) -> None:
        self.errors.append(f"{path}: {message}")

    def warn(self, path: str, message: str) -> None:
        self.warnings.append(f"{path}: {message}")

    def mapping(self, value: Any, path: str, allowed: set[str]) -> dict[str, Any]:
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            self.error(path, f"expected a mapping, got {type_name(value)}")
            return {}
        out: dict[str, Any] = {}
        for key, item in value.items():
            sub = f"{path}.{key}" if path else str(key)
            if not isinstance(key, str):
                self.error(sub, "keys must be strings")
            elif key not in allowed:
                if key in _INLINE_SECRET_KEYS:
                    self.error(
                        sub,
                        "inline credentials are refused; put the secret in a file or an "
                        "environment variable (credential_file / credential_env, "
                        "secret_file / secret_env)",
                    )
                else:
                    hint = did_you_mean(key, allowed) or f" (allowed: {', '.join(sorted(allowed))})"
                    self.error(sub, f"unknown key{hint}")
            else:
                out[key] = item
        return out

    def entry(self, value: Any, path: str, allowed: set[str]) -> dict[str, Any] | None:
        """One item of a list that must be a mapping (a source, a broker): None, the error
        recorded, when it is not one (null included)."""
        if not isinstance(value, Mapping):
            self.error(path, f"expected a mapping, got {type_name(value)}")
            return None
        return self.mapping(value, path, allowed)

    def typed(self, data: dict[str, Any], key: str, path: str, kind: type[T] | tuple[type, ...],
              default: T, *, nullable: bool = False) -> T:
        """`data[key]` when it has type `kind` (None too when `nullable`), else `default`."""
        if key not in data:
            return default
        value = data[key]
        sub = f"{path}.{key}" if path else key
        if value is None and nullable:
            return value  # type: ignore[return-value]
        # bool is an int in Python; a YAML `true` where a number belongs is a mistake.
        if isinstance(value, bool) and kind is not bool:
            self.error(sub, f"expected {_kind_name(kind)}, got a boolean")
            return default
        if not isinstance(value, kind):
            self.error(sub, f"expected {_kind_name(kind)}, got {type_name(value)}")
            return default
        return value  # type: ignore[return-value]

    def int_range(self, data: dict[str, Any], key: str, path: str, default: int, lo: int, hi: int) -> int:
        value = self.typed(data, key, path, int, default)
        if not lo <= value <= hi:
            self.error(f"{path}.{key}" if path else key, f"must be between {lo} and {hi}, got {value}")
            return default
        return value

    def duration(self, data: dict[str, Any], key: str, path: str, default: float,
                 lo: float = 0.001, hi: float = 86400.0) -> float:
        """A duration string (`"500ms"`) in seconds, between `lo` and `hi`."""
        sub = f"{path}.{key}" if path else key
        if key not in data:
            return default
        raw = data[key]
        if not isinstance(raw, str):
            self.error(sub, f"expected a duration string like '500ms' or '5s', got {type_name(raw)}")
            return default
        try:
            value = parse_duration(raw)
        except ValueError as exc:
            self.error(sub, str(exc))
            return default
        if not lo <= value <= hi:
            self.error(sub, f"must be between {lo:g}s and {hi:g}s, got {raw!r}")
            return default
        return value

    def choice(
        self, data: dict[str, Any], key: str, path: str, default: str, choices: tuple[str, ...]
    ) -> str:
        value = self.typed(data, key, path, str, default)
        if value not in choices:
            self.error(f"{path}.{key}" if path else key,
                       f"must be one of {', '.join(choices)}, got {value!r}"
                       f"{did_you_mean(value, choices)}")
            return default
        return value

    def name(self, data: dict[str, Any], key: str, path: str, hint: str = "") -> str:
        """A required `[A-Za-z0-9_-]{1,64}` identifier (backend name, client or broker id)."""
        value = self.typed(data, key, path, str, "")
        if key not in data:
            self.error(f"{path}.{key}", f"is required{hint}")
        elif not BACKEND_NAME_RE.match(value):
            self.error(f"{path}.{key}", f"must match [A-Za-z0-9_-]{{1,64}}, got {value!r}")
        return value

    def enum(self, data: dict[str, Any], key: str, path: str, kind: type[E]) -> E | None:
        """A required member of the string Enum `kind`, by value."""
        names = [str(m.value) for m in kind]
        values = ", ".join(names)
        raw = self.typed(data, key, path, str, "")
        if key not in data:
            either = " or ".join([", ".join(names[:-1]), names[-1]]) if len(names) > 1 else values
            self.error(f"{path}.{key}", f"is required ({either})")
            return None
        try:
            return kind(raw)
        except ValueError:
            self.error(f"{path}.{key}",
                       f"must be one of {values}, got {raw!r}{did_you_mean(raw, names)}")
            return None

    def address(
        self, data: dict[str, Any], key: str, path: str, default: str
    ) -> tuple[str, int] | None:
        """A `host:port` to listen on (`default` when the key is absent); None when invalid
        (the error is recorded)."""
        text = self.typed(data, key, path, str, default)
        try:
            return parse_listen(text)
        except ValueError as exc:
            self.error(f"{path}.{key}" if path else key, str(exc))
            return None

    def not_both(self, path: str, first: tuple[str, object], second: tuple[str, object]) -> None:
        """Two ways to give one thing (a secret's file or its environment variable): at most
        one may be set. Each pair is (key, value)."""
        if first[1] is not None and second[1] is not None:
            self.error(path, f"set {first[0]} or {second[0]}, not both")

    def env_is_set(self, path: str, name: str | None) -> None:
        """A secret named by environment variable: warn (not fail) when it is not set here, as
        `config validate` may run in another environment than the service."""
        if name is not None and name not in os.environ:
            self.warn(path, f"environment variable {name!r} is not set here")

    def existing_file(self, path: str, value: str | None, *, directory: bool = False) -> None:
        if value is None:
            return
        p = Path(value)
        ok = p.is_dir() if directory else p.is_file()
        if not ok:
            self.error(path, f"{'directory' if directory else 'file'} {value!r} does not exist")


def did_you_mean(word: str, known: Iterable[str]) -> str:
    """` (did you mean 'x'?)` for the closest known word, when one is close enough (a typo,
    a case slip, a dash for an underscore); else ""."""
    by_folded = {k.lower().replace("-", "_"): k for k in known}
    folded = word.lower().replace("-", "_")
    if folded in by_folded and by_folded[folded] != word:
        return f" (did you mean {by_folded[folded]!r}?)"
    close = difflib.get_close_matches(folded, list(by_folded), n=1, cutoff=0.75)
    return f" (did you mean {by_folded[close[0]]!r}?)" if close else ""


#: How an error message names a YAML value's type (what was found, what was expected).
_TYPE_NAMES: dict[type, str] = {
    dict: "a mapping",
    list: "a list",
    str: "a string",
    int: "an integer",
    float: "a number",
    bool: "a boolean",
}


def type_name(value: Any) -> str:
    """`a mapping`, `a list`, ... `null`: the type of a value found in the file."""
    if value is None:
        return "null"
    return _TYPE_NAMES.get(type(value), type(value).__name__)


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(_TYPE_NAMES.get(k, k.__name__) for k in kinds)


def check_url(r: Reader, path: str, value: str | None, schemes: tuple[str, ...]) -> str | None:
    """`value` when it is a URL of one of `schemes` with a host and no inline credentials;
    else None (the error is recorded). None stays None (an optional URL not given)."""
    if value is None:
        return None
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError as exc:
        r.error(path, f"invalid URL {value!r}: {exc}")
        return None
    if parts.scheme not in schemes:
        r.error(path, f"URL scheme must be {' or '.join(schemes)}, got {value!r}")
        return None
    if not parts.hostname:
        r.error(path, f"URL {value!r} has no host")
        return None
    if parts.username is not None or parts.password is not None:
        r.error(path, "inline credentials in URLs are refused")
        return None
    del port  # read only so that urlsplit validates it (a port out of range raises above)
    return value


def is_loopback(host: str) -> bool:
    """`localhost`, 127.0.0.0/8 or ::1 (brackets of an IPv6 URL host allowed); a host name
    other than localhost is not (it may resolve anywhere)."""
    host = host.strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("json", "console")


@dataclass(frozen=True, slots=True)
class LogConfig:
    """The `log` block, the same in both files (SPEC §9)."""

    level: str = "info"
    format: str = "json"


def parse_log(r: Reader, raw: Any) -> LogConfig:
    """The top-level `log:` block (`level`, `format`) of either file."""
    data = r.mapping(raw, "log", {"level", "format"})
    return LogConfig(
        level=r.choice(data, "level", "log", "info", LOG_LEVELS),
        format=r.choice(data, "format", "log", "json", LOG_FORMATS),
    )


def is_router_file(raw: Any) -> bool:
    """Does this YAML tree look like a router file (`kv_cache_index`) rather than a listener
    file (`sources`)? `config validate` picks its parser by this, and the listener refuses such
    a file with a pointer to `router --config`."""
    return isinstance(raw, Mapping) and "kv_cache_index" in raw and "sources" not in raw


def root_mapping(r: Reader, raw: Any, allowed: Iterable[str]) -> dict[str, Any]:
    """The top level of a file: its known keys. A file whose root is not a mapping at all
    (a list, a scalar) is one error, raised at once: nothing below could be checked."""
    if raw is not None and not isinstance(raw, Mapping):
        raise ConfigError([f"<root>: expected a mapping, got {type_name(raw)}"])
    return r.mapping(raw, "", set(allowed))


def read_secret(file: str | None, env: str | None) -> bytes | None:
    """Secret bytes from a file or an environment variable, trailing whitespace stripped
    (SPEC §3, §7). None when neither is set. Raises ConfigError when unreadable or empty."""
    if file is not None:
        try:
            value = Path(file).read_bytes().rstrip()
        except OSError as exc:
            raise ConfigError([f"{file}: cannot read secret: {exc.strerror}"]) from None
        where = file
    elif env is not None:
        if env not in os.environ:
            raise ConfigError([f"environment variable {env!r} is not set"])
        value = os.environ[env].encode("utf-8").rstrip()
        where = f"${env}"
    else:
        return None
    if not value:
        raise ConfigError([f"{where}: secret is empty"])
    return value
