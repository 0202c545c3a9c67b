"""Errors that decide the process's exit code (SPEC §9): a `ConfigError` exits 2, because
restarting would not fix it; a `StartError` exits 1, because it may go away by itself (a port
still held by the previous process, a dependency not up yet), so a supervisor restarting the
process is right.

Owns the two error types and the rule that picks one for a socket that would not open. It
imports nothing of the package, so every layer (the configuration toolkit, the listener, the
router) can raise them.
"""

from __future__ import annotations

import errno


class ConfigError(Exception):
    """Invalid configuration. `errors` holds one message per problem, each prefixed by its path."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("\n".join(errors))
        self.errors = errors


class StartError(Exception):
    """The process cannot start for a runtime reason. `errors`: one line per problem, each
    naming the configuration key it concerns (`listen: cannot bind 127.0.0.1:7817: ...`)."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("\n".join(errors))
        self.errors = errors


#: A port held by another process, an address not (yet) on this host: may go away by itself.
_TRANSIENT_BIND_ERRNOS = frozenset({errno.EADDRINUSE, errno.EADDRNOTAVAIL})


def bind_error(message: str, exc: BaseException) -> Exception:
    """The error to raise for a listening socket that could not be opened: `StartError` when
    the cause may go away by itself, else `ConfigError` (a privileged port, a bad certificate,
    a missing file: restarting would not fix those)."""
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_BIND_ERRNOS:
        return StartError([message])
    return ConfigError([message])
