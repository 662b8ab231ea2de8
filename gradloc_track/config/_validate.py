"""Small validators that raise errors naming the config field and the fix.

Shared by the config dataclasses (``clip.beta=1.5 is invalid: ...``) and the clippers'
constructors (``beta=1.5 is invalid: ...``): the same rule, whatever door the value came in by.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from collections.abc import Mapping
from typing import Any, Iterable

from .errors import ConfigError
from .renamed import RENAMED_KEYS


def check(cond: bool, field: str, value: Any, fix: str) -> None:
    if not cond:
        raise ConfigError(f"{field}={value!r} is invalid: {fix}")


def one_of(field: str, value: Any, choices: Iterable[Any]) -> None:
    choices = tuple(choices)
    check(value in choices, field, value, f"use one of {', '.join(map(repr, choices))}")


# -- numbers: every rule checks the type first (``AdaGC(lambda_rel="1.04")`` fails naming the field)

def number(field: str, value: Any, example: str) -> None:
    """A real number (bool and strings rejected)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    check(ok, field, value, f"use a number (e.g. {example}), not {type(value).__name__}")


def positive(field: str, value: Any, example: str) -> None:
    number(field, value, example)
    check(math.isfinite(value) and value > 0, field, value, f"use a positive finite value (e.g. {example})")


def non_negative(field: str, value: Any, example: str) -> None:
    number(field, value, example)
    check(math.isfinite(value) and value >= 0, field, value, f"use a finite value >= 0 (e.g. {example})")


def in_unit_interval(field: str, value: Any, example: str = "0.99") -> None:
    number(field, value, example)
    check(0.0 < value < 1.0, field, value, f"use a value strictly between 0 and 1 (e.g. {example})")


def integer(field: str, value: Any, minimum: int, example: str) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= minimum
    check(ok, field, value, f"use a whole number >= {minimum} (e.g. {example})")


def finite(field: str, value: float) -> None:
    check(math.isfinite(value), field, value, "use a finite value")


# -- annotations ---------------------------------------------------------------------------------

def _describe(tp: Any) -> str:
    """How a type annotation reads in an error message."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union:
        inner = [a for a in args if a is not type(None)]
        return " or ".join(_describe(a) for a in inner) + (" or null" if len(inner) < len(args) else "")
    if origin in (list, tuple):
        return _describe_sequence(origin, args)
    if origin is dict or tp is dict:
        return "a mapping"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(tp, getattr(
        tp, "__name__", str(tp)))


_PLURAL = {bool: "true/false values", int: "integers", float: "numbers", str: "strings"}


def _describe_sequence(origin: Any, args: tuple) -> str:
    """``list[str]`` -> "a list of strings"; ``tuple[float, float]`` -> "a list of 2 numbers"."""
    if not args:
        return "a list"
    if origin is tuple and args[-1] is not Ellipsis:
        if len(set(args)) == 1:
            return f"a list of {len(args)} {_PLURAL.get(args[0], f'items ({_describe(args[0])})')}"
        return f"a list of {len(args)} items ({', '.join(_describe(a) for a in args)})"
    return f"a list of {_PLURAL.get(args[0], f'items ({_describe(args[0])})')}"


_SCALARS = {
    type(None): lambda v: v is None,
    bool: lambda v: isinstance(v, bool),
    int: lambda v: isinstance(v, int) and not isinstance(v, bool),
    float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    str: lambda v: isinstance(v, str),
}


def _matches_sequence(value: Any, origin: Any, args: tuple) -> bool:
    if not isinstance(value, (list, tuple)):  # OmegaConf hands sequences over as lists
        return False
    if origin is tuple and args and args[-1] is not Ellipsis:
        return len(value) == len(args) and all(_matches(v, a) for v, a in zip(value, args))
    return all(_matches(v, args[0]) for v in value) if args else True


def _matches_mapping(value: Any, args: tuple) -> bool:
    if not isinstance(value, Mapping):
        return False
    return not args or all(_matches(k, args[0]) and _matches(v, args[1]) for k, v in value.items())


def _matches(value: Any, tp: Any) -> bool:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return True
    if origin is typing.Union:
        return any(_matches(value, a) for a in args)
    if tp in _SCALARS:
        return _SCALARS[tp](value)
    if origin in (list, tuple):
        return _matches_sequence(value, origin, args)
    if origin is dict or tp is dict:
        return _matches_mapping(value, args)
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True  # an annotation we do not model: leave it to the range checks


def check_types(obj: Any, prefix: str, skip: Iterable[str] = ()) -> None:
    """Check every field of a config dataclass against its annotation.

    Hydra/OmegaConf check types at composition; Python callers (``SpikeConfig(z_thresh="6")``)
    skip that, so every ``__post_init__`` starts here and the error names ``<prefix>.<field>``.
    ``skip``: fields the caller checks itself with a more specific message.
    """
    hints = typing.get_type_hints(type(obj))
    skip = set(skip)
    for f in dataclasses.fields(obj):
        if f.name in skip:
            continue
        value = getattr(obj, f.name)
        tp = hints.get(f.name, Any)
        if dataclasses.is_dataclass(tp) and dataclasses.is_dataclass(value):
            continue  # a nested config checked itself when it was built
        check(_matches(value, tp), f"{prefix}.{f.name}" if prefix else f.name, value, f"use {_describe(tp)}")


# -- keys no field reads ---------------------------------------------------------------------------

def node_schema(node: Any, declared: type) -> type:
    """The dataclass a composed node was built from: an option's own schema (``AdaGCConfig`` under
    a ``clip: ClipConfig`` field) when it subclasses the declared one, else the declared one."""
    from omegaconf import OmegaConf

    actual = OmegaConf.get_type(node)
    if isinstance(actual, type) and dataclasses.is_dataclass(actual) and issubclass(actual, declared):
        return actual
    return declared


def _unknown_key_hint(path: str, key: str, names: list[str]) -> str:
    if f"{path}{key}" in RENAMED_KEYS:
        return RENAMED_KEYS[f"{path}{key}"].hint()
    close = difflib.get_close_matches(key, names, n=1)
    return f"did you mean {path}{close[0]}?" if close else f"valid keys: {', '.join(names)}"


def unknown_keys(cfg: Any, schema: type, path: str = "") -> list[str]:
    """Keys of a composed DictConfig that ``schema`` (a config dataclass) has no field for.

    Hydra lets ``+group.key=value`` add a key to a structured config (``+`` opens it), and
    ``OmegaConf.to_object`` then drops it silently: a typo such as ``+monitor.log_evry=5``
    would configure nothing. Each entry names the key and the closest valid one (or, for a key
    that was renamed, the new name).
    """
    from omegaconf import DictConfig

    names = [f.name for f in dataclasses.fields(schema)]
    hints = typing.get_type_hints(schema)
    out: list[str] = []
    for key in cfg.keys():
        key = str(key)
        if path == "" and key == "hydra":  # present when composed with return_hydra_config=True
            continue
        if key not in names:
            out.append(f"{path}{key} ({_unknown_key_hint(path, key, names)})")
            continue
        tp = hints.get(key)
        node = cfg._get_node(key)
        if dataclasses.is_dataclass(tp) and isinstance(node, DictConfig) and not node._is_none():
            out += unknown_keys(node, node_schema(node, tp), f"{path}{key}.")
    return out
