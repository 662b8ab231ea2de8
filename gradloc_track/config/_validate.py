"""Small validators that raise errors naming the config field and the fix."""
from __future__ import annotations

from typing import Any, Iterable


class ConfigError(ValueError):
    """A config value is out of range; the message names the field and what to set instead."""


def check(cond: bool, field: str, value: Any, fix: str) -> None:
    if not cond:
        raise ConfigError(f"{field}={value!r} is invalid: {fix}")


def one_of(field: str, value: Any, choices: Iterable[Any]) -> None:
    choices = tuple(choices)
    check(value in choices, field, value, f"use one of {', '.join(map(repr, choices))}")
