"""Small validators that raise errors naming the config field and the fix."""
from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Mapping
from typing import Any, Iterable


class ConfigError(ValueError):
    """A config value is out of range; the message names the field and what to set instead."""


def check(cond: bool, field: str, value: Any, fix: str) -> None:
    if not cond:
        raise ConfigError(f"{field}={value!r} is invalid: {fix}")


def one_of(field: str, value: Any, choices: Iterable[Any]) -> None:
    choices = tuple(choices)
    check(value in choices, field, value, f"use one of {', '.join(map(repr, choices))}")


def _describe(tp: Any) -> str:
    """How a type annotation reads in an error message."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union:
        inner = [a for a in args if a is not type(None)]
        return " or ".join(_describe(a) for a in inner) + (" or null" if len(inner) < len(args) else "")
    if origin in (list, tuple):
        return f"a list of {_describe(args[0])}s" if args else "a list"
    if origin is dict or tp is dict:
        return "a mapping"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(tp, getattr(
        tp, "__name__", str(tp)))


def _matches(value: Any, tp: Any) -> bool:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return True
    if origin is typing.Union:
        return any(_matches(value, a) for a in args)
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if origin in (list, tuple):  # OmegaConf hands sequences over as lists
        if not isinstance(value, (list, tuple)):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis:
            return len(value) == len(args) and all(_matches(v, a) for v, a in zip(value, args))
        return all(_matches(v, args[0]) for v in value) if args else True
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            return False
        return not args or all(_matches(k, args[0]) and _matches(v, args[1]) for k, v in value.items())
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


def unknown_keys(cfg: Any, schema: type, path: str = "") -> list[str]:
    """Keys of a composed DictConfig that ``schema`` (a config dataclass) has no field for.

    Hydra lets ``+group.key=value`` add a key to a structured config (``+`` opens it), and
    ``OmegaConf.to_object`` then drops it silently: a typo such as ``+monitor.log_evry=5``
    would configure nothing. Each entry names the key and the closest valid one.
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
            close = difflib.get_close_matches(key, names, n=1)
            hint = f"did you mean {path}{close[0]}?" if close else f"valid keys: {', '.join(names)}"
            out.append(f"{path}{key} ({hint})")
            continue
        tp = hints.get(key)
        node = cfg._get_node(key)
        if dataclasses.is_dataclass(tp) and isinstance(node, DictConfig) and not node._is_none():
            out += unknown_keys(node, tp, f"{path}{key}.")
    return out
