"""The ``gradloc`` node's keys, checked as a verl user wrote them, and GradLoc's own knobs.

Every error names the FULL key a verl user typed (``actor_rollout_ref.actor.gradloc.spikes.z_thres``)
and the fix: an unknown key lists the valid names where it sits (the top level's, or the group's:
``spikes``' fields, the ``clip`` option's own), with the closest one; ``run_dir``/``run_name`` must
be strings (Hydra reads ``run_dir=7`` as the integer 7); a value our schemas refuse keeps their
sentence, prefixed with the full key. verl's Hydra wraps it in its ``InstantiationException``; the
message inside reads on its own.

GradLoc (Tencent-Hunyuan/GradLoc's patch of verl) set its search on the actor itself; the same
keys are accepted under the node, with GradLoc's meaning (``GRADLOC_KNOBS``):

- ``spike_detection``: whether spikes are detected and localized at all (``spikes.enabled``);
- ``grad_norm_threshold``: GradLoc's per-token trigger, a step fires when its global grad norm
  exceeds ``threshold / sqrt(loss tokens) * micro-batches`` (``spikes.mode=fixed`` with
  ``spikes.per_token_threshold``; the localizer keeps its own adaptive threshold);
- ``bisect_budget_steps``: the probes one localization may spend (``locate.budget``);
- ``bisect_dump_dir``: where the spike tables are written (``run_dir``).

A knob and the key it stands for, both set to different values, is an error naming both.
"""
from __future__ import annotations

import difflib
import numbers
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from ...config import CLIP_SCHEMAS, ClipConfig, ConfigError
from ..options import GROUPS, MONITOR_FIELDS

PREFIX = "actor_rollout_ref.actor.gradloc"
ENABLED = "enabled"
STRINGS = ("run_dir", "run_name")  # runtime keys a Hydra node can hold (a tokenizer it cannot)
GRADLOC_KNOBS = {"spike_detection": "spikes.enabled", "grad_norm_threshold": "spikes.per_token_threshold",
                 "bisect_budget_steps": "locate.budget", "bisect_dump_dir": "run_dir"}
TOP = tuple(sorted(GROUPS)) + tuple(sorted(MONITOR_FIELDS)) + STRINGS + (ENABLED,) + tuple(GRADLOC_KNOBS)


class NodeError(ConfigError):
    """A bad ``gradloc`` node: the message names the full key and what to write instead."""


def _unknown(path: str, key: str, valid: list[str]) -> NodeError:
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f" (did you mean {path}.{close[0]}?)" if close else ""
    return NodeError(f"{path}.{key} is not a gradloc-track option{hint}: valid names under {path} are "
                     f"{', '.join(valid)}")


def _group_fields(group: str, node: Mapping) -> list[str]:
    """The fields a group's mapping may hold (``clip``: those of the option its ``kind`` names)."""
    schema = GROUPS[group]
    kind = node.get("kind", "none")
    if group == "clip":
        schema = CLIP_SCHEMAS.get(kind, ClipConfig) if isinstance(kind, str) else ClipConfig
    return [f.name for f in fields(schema)]


def check_keys(given: Mapping) -> None:
    """Every key of the node a valid name where it sits, and the runtime keys strings."""
    for key, value in given.items():
        if key not in TOP:
            raise _unknown(PREFIX, str(key), list(TOP))
        if key in STRINGS + ("bisect_dump_dir",) and value is not None and not isinstance(value, str):
            what = "a run name" if key == "run_name" else "a directory path"
            raise NodeError(f"{PREFIX}.{key}={value!r} is invalid: use {what}, a string (Hydra reads {key}={value} "
                            f"as the {type(value).__name__} {value!r}: quote it, '+{PREFIX}.{key}=\"{value}\"')")
        if key in GROUPS and isinstance(value, Mapping):
            valid = _group_fields(key, value)
            for sub in value:
                if sub not in valid:
                    raise _unknown(f"{PREFIX}.{key}", str(sub), valid)


def _number(key: str, value: Any, whole: bool) -> None:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and 0 < value < float("inf")
    if whole:
        ok = ok and isinstance(value, int)
    if not ok:
        what = "a positive whole number of probes (GradLoc's run script: 128)" if whole else \
            "a positive per-token gradient norm (GradLoc's run script: 640.0)"
        raise NodeError(f"{PREFIX}.{key}={value!r} is invalid: use {what}")


def _set(out: dict, knob: str, path: str, value: Any) -> None:
    """``out[path] = value``, unless the node already sets ``path`` otherwise (an error naming both)."""
    group, _, name = path.partition(".")
    node = out.get(group) if name else out
    key = name or group
    if isinstance(node, Mapping) and key in node and node[key] != value:
        raise NodeError(f"{PREFIX}.{knob}={value!r} (GradLoc's knob) and {PREFIX}.{path}={node[key]!r} disagree: "
                        "set one of them")
    if not name:
        out[group] = value
        return
    if not isinstance(out.get(group, {}), Mapping):
        raise NodeError(f"{PREFIX}.{knob} sets {PREFIX}.{path}, but {PREFIX}.{group}={out[group]!r} is not a "
                        f"mapping: write {PREFIX}.{group}.{name} or drop {knob}")
    out[group] = {**out.get(group, {}), name: value}


def translate_knobs(given: dict) -> dict:
    """The node with GradLoc's knobs turned into ours (module doc); the others as they are."""
    out = {k: v for k, v in given.items() if k not in GRADLOC_KNOBS}
    if "spike_detection" in given:
        value = given["spike_detection"]
        if not isinstance(value, bool):
            raise NodeError(f"{PREFIX}.spike_detection={value!r} is invalid: use true or false")
        _set(out, "spike_detection", "spikes.enabled", value)
    if "grad_norm_threshold" in given:
        _number("grad_norm_threshold", given["grad_norm_threshold"], whole=False)
        _set(out, "grad_norm_threshold", "spikes.mode", "fixed")
        _set(out, "grad_norm_threshold", "spikes.per_token_threshold", float(given["grad_norm_threshold"]))
    if "bisect_budget_steps" in given:
        _number("bisect_budget_steps", given["bisect_budget_steps"], whole=True)
        _set(out, "bisect_budget_steps", "locate.budget", given["bisect_budget_steps"])
    if "bisect_dump_dir" in given:
        _set(out, "bisect_dump_dir", "run_dir", given["bisect_dump_dir"])
    return out


def located(exc: Exception) -> NodeError:
    """A schema's error (``ConfigError`` ``"spikes.z_thresh=-1 is invalid: ..."``, OmegaConf's type
    errors with their ``full_key``) as a ``NodeError`` naming the full key."""
    full_key, msg = getattr(exc, "full_key", None), getattr(exc, "msg", None)
    if full_key and msg:  # OmegaConf: "Value 'abc' of type 'str' could not be converted to Float"
        return NodeError(f"{PREFIX}.{full_key} is invalid: {msg.splitlines()[0]}")
    text = str(exc)
    head = text.split(".", 1)[0].split("=", 1)[0]
    return NodeError(f"{PREFIX}.{text}" if head in GROUPS or head in MONITOR_FIELDS else f"{PREFIX}: {text}")
