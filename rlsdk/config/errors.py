"""The one error type for bad configuration values, and the warning for deprecated ones."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A configuration value is invalid. Names the field, the bad value and what is allowed."""

    def __init__(self, field: str, value: Any, allowed: str) -> None:
        self.field = field
        self.value = value
        self.allowed = allowed
        super().__init__(f"{field}={value!r} is invalid: allowed {allowed}")


class ConfigDeprecationWarning(FutureWarning):
    """A deprecated config key was used; the message names its replacement and the removal version.

    A FutureWarning, so Python shows it by default: the people who see it are the users who wrote the key.
    """
