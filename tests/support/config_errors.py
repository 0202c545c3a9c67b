"""What a configuration parser reports for a YAML tree, for the listener's and the router's
configuration tests alike: every error, or the one error a test expects."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kv_listener.configkit import ConfigError


def error_helpers(
    parse: Callable[[Any], object],
) -> tuple[Callable[[Any], list[str]], Callable[[Any], str]]:
    """`(errors_of, one_error)` for `parse`: the messages of the `ConfigError` it must raise,
    and that list's only message (failing, with the list, when there is not exactly one)."""

    def errors_of(raw: Any) -> list[str]:
        with pytest.raises(ConfigError) as info:
            parse(raw)
        return info.value.errors

    def one_error(raw: Any) -> str:
        errors = errors_of(raw)
        assert len(errors) == 1, errors
        return errors[0]

    return errors_of, one_error
