"""``watch()``/callback options -> the config dataclasses the Hydra app builds.

Options use the Hydra config's names: a group (``tracker``, ``monitor``, ``clip``, ``spikes``,
``locate``) given as its choice name (``clip="adagc"``, ``tracker="mlflow"``), a mapping of its
fields (``clip={"kind": "adagc", "beta": 0.98}``), a config dataclass (``AdaGCConfig(beta=0.98)``),
or (``spikes``/``locate``) a bool; the monitor's fields directly (``log_every=10``); or ``cfg=`` a
Hydra node / ``RootConfig`` holding any of those groups. Everything goes through the same
structured-config schemas and ``to_config`` as the Hydra app (for ``clip``: the schema of the
option its ``kind`` names), so a wrong name or value gets the same error.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ..config import (CLIP_SCHEMAS, ClipConfig, LocateConfig, MonitorConfig, SpikeConfig, TrackerConfig,
                      check_renamed, to_config)
from ..trackers.interface import Tracker

GROUPS: dict[str, type] = {
    "tracker": TrackerConfig,
    "monitor": MonitorConfig,
    "clip": ClipConfig,
    "spikes": SpikeConfig,
    "locate": LocateConfig,
}
MONITOR_FIELDS = tuple(f.name for f in fields(MonitorConfig))
# not config groups: what only a live loop knows
RUNTIME = ("tokenizer", "run_dir", "run_name", "console", "scaler")
AUTO = "auto"  # tracker: the run that is already open (wandb.run / mlflow.active_run())


@dataclass
class WatchOptions:
    """Resolved options. ``tracker`` is a ``Tracker`` to use as is, or a config (``kind="auto"``
    is represented by ``tracker_auto=True``: attach to the open run, else build ``tracker``)."""

    tracker: TrackerConfig | Tracker = field(default_factory=TrackerConfig)
    tracker_auto: bool = True
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    clip: ClipConfig = field(default_factory=ClipConfig)
    spikes: SpikeConfig = field(default_factory=SpikeConfig)
    locate: LocateConfig = field(default_factory=LocateConfig)
    tokenizer: Any = None
    run_dir: str | Path | None = None
    run_name: str | None = None
    console: bool = True  # the spike block on rank 0's stderr at each detected spike (False: silent)
    scaler: Any = None  # the loop's torch.amp.GradScaler: a step it skips (non-fused optimizer) is still seen


def _group_node(group: str, value: Any) -> Any:
    """One group's option value as something ``OmegaConf.merge`` takes onto its schema."""
    from omegaconf import OmegaConf

    cls = GROUPS[group]
    if isinstance(value, cls):  # a clip schema keeps its type: AdaGCConfig's fields are not ClipConfig's
        return OmegaConf.structured(value) if group == "clip" else dataclasses.asdict(value)
    if isinstance(value, bool) and group in ("spikes", "locate"):
        return {"enabled": value}
    if isinstance(value, str):
        if group in ("tracker", "clip"):
            return {"kind": value}  # conf/<group>/<name>.yaml sets exactly kind: <name>
        if value == "default":
            return {}
        if value in ("off", "none") and group in ("spikes", "locate"):
            return {"enabled": False}
        raise ValueError(f"{group}={value!r} is not a known {group} config: use 'default'"
                         + (", 'off', true or false" if group in ("spikes", "locate") else "")
                         + f", a mapping of {cls.__name__} fields, or a {cls.__name__}")
    if isinstance(value, Mapping) or _is_dictconfig(value):
        return value
    raise TypeError(f"{group}= takes a name, a mapping of {cls.__name__} fields or a {cls.__name__}; "
                    f"got {type(value).__name__}")


def _is_dictconfig(value: Any) -> bool:
    try:
        from omegaconf import DictConfig
    except ImportError:  # pragma: no cover - omegaconf is a core dependency
        return False
    return isinstance(value, DictConfig)


def _from_cfg(cfg: Any) -> dict[str, Any]:
    """The groups (and monitor shortcuts) found in ``cfg=``: a Hydra node, a mapping or a RootConfig."""
    if cfg is None:
        return {}
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {g: getattr(cfg, g) for g in GROUPS if hasattr(cfg, g)}
    if not (isinstance(cfg, Mapping) or _is_dictconfig(cfg)):
        raise TypeError(f"cfg= takes a Hydra node (DictConfig), a mapping or a RootConfig; got {type(cfg).__name__}")
    return {k: cfg[k] for k in cfg if k in GROUPS or k in MONITOR_FIELDS or k in RUNTIME}


def _schema(given: dict[str, Any]) -> Any:
    """Every group's schema; ``clip``'s is the one of the option its ``kind`` names (an unknown
    kind keeps ``ClipConfig``, whose check then names ``clip.kind`` and the choices)."""
    from omegaconf import OmegaConf

    schemas = dict(GROUPS)
    if "clip" in given:
        clip = given["clip"]
        kind = clip.get("kind", "none") if isinstance(clip, Mapping) or _is_dictconfig(clip) else "none"
        schemas["clip"] = CLIP_SCHEMAS.get(kind, ClipConfig) if isinstance(kind, str) else ClipConfig
    return OmegaConf.create({g: OmegaConf.structured(cls) for g, cls in schemas.items()})


def _check_renamed(given: dict[str, Any]) -> None:
    """A key that changed name (``clip={"kind": "layerclip", "layer_alpha": 0.9}``) names the new one."""
    check_renamed(f"{g}.{k}" for g, node in given.items()
                  if isinstance(node, Mapping) or _is_dictconfig(node) for k in node)


def _check_keys(given: dict[str, Any]) -> None:
    """A key no schema holds (``spikes={"z_tresh": 5}``) fails as on the Hydra app's command line: naming
    the closest field (``config.override_keys``), not with OmegaConf's bare "Key 'z_tresh' not in
    'SpikeConfig'"."""
    from ..config.override_keys import unknown_override_key
    from ..config.root import RootConfig

    def keys(node: Any, path: str):
        if _is_dictconfig(node):  # its keys as written: an interpolation is not resolved here (Hydra's job)
            from omegaconf import OmegaConf

            node = OmegaConf.to_container(node, resolve=False)
        for k in node:
            value = node[k]
            if isinstance(value, Mapping):
                yield from keys(value, f"{path}{k}.")
            yield f"{path}{k}"

    bad = [found for g, node in given.items() if isinstance(node, Mapping) or _is_dictconfig(node)
           for key in keys(node, f"{g}.") for found in [unknown_override_key(key, RootConfig)] if found]
    if bad:
        from ..config.errors import ConfigError

        raise ConfigError(f"unknown option key(s): {'; '.join(dict.fromkeys(bad))}. Every key must be a field of the "
                          "group's config (see conf/); fix the key")


def _check_clip_kind(given: dict[str, Any]) -> None:
    """``clip={"beta": 0.9}`` names no clipper: its kind defaults to ``none``, which has no such field, and
    OmegaConf said only "Key 'beta' not in 'NoClipConfig'" (held-out tester, stop 54). Say which kinds have it."""
    node = given.get("clip")
    if node is None or not (isinstance(node, Mapping) or _is_dictconfig(node)) or node.get("kind", "none") != "none":
        return
    import dataclasses

    from ..config.clip import CLIP_SCHEMAS
    from ..config.errors import ConfigError

    fields = {kind: {f.name for f in dataclasses.fields(schema)} for kind, schema in CLIP_SCHEMAS.items()}
    extra = [k for k in node if k not in fields.get("none", set())]
    if extra:
        having = [kind for kind, names in fields.items() if extra[0] in names]
        named = "names no clipper: clip.kind defaults to" if "kind" not in node else "is clip.kind"
        raise ConfigError(f"clip={dict(node)!r} {named} 'none', which has no field "
                          f"{extra[0]!r}; name one, e.g. clip={{'kind': {having[0]!r}, {extra[0]!r}: ...}} "
                          f"(clip.{extra[0]} is a field of: {', '.join(having)})")


def _typed(schema: Any, given: dict) -> Any:
    """``given`` merged over the typed schema; a value of the wrong type is a ``ConfigError`` naming the field and
    the type it takes (OmegaConf's ``ValidationError`` said the field, not the fix, and was no ``ConfigError``)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import ValidationError

    from ..config import ConfigError

    try:
        return OmegaConf.merge(schema, given)
    except ValidationError as exc:
        key = exc.full_key or "?"
        wants = re.search(r"converted to (\w+)", str(exc.msg))
        kind = wants.group(1).lower() if wants else ""
        fix = f"give {key} {'an' if kind[:1] in 'aeiou' else 'a'} {kind}" if kind else f"give {key} a value of its type"
        err = ConfigError(f"{key}={exc.value!r} is invalid: {str(exc.msg).splitlines()[0]}; {fix}")
        err.full_key, err.msg = key, exc.msg  # as OmegaConf's: verl's node names it under its own path
        raise err from None


def resolve_options(cfg: Any = None, **options: Any) -> WatchOptions:
    """Validate the options exactly as the Hydra app validates its config; see the module doc."""
    from omegaconf import OmegaConf

    valid = sorted(GROUPS) + sorted(MONITOR_FIELDS) + sorted(RUNTIME) + ["cfg"]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        guesses = [f"{k} (did you mean {close[0]}?)" if close else k
                   for k in unknown for close in [difflib.get_close_matches(k, valid, n=1)]]
        raise TypeError(f"unknown option(s) {', '.join(guesses)}: valid options are {valid} "
                        "(the Hydra config's group names, the monitor's fields, and cfg=)")
    merged = {**_from_cfg(cfg), **options}  # keywords win over cfg=
    out = WatchOptions()
    tracker = merged.pop("tracker", AUTO)
    if isinstance(tracker, Tracker):
        out.tracker, out.tracker_auto = tracker, False
    elif tracker is None or tracker == AUTO:
        out.tracker_auto = True
    else:
        merged["tracker"] = tracker
        out.tracker_auto = False
    for name in RUNTIME:
        setattr(out, name, merged.pop(name, getattr(out, name)))
    if not isinstance(out.console, bool):
        raise TypeError(f"console={out.console!r}: use True (print the spike block on stderr) or False")
    if out.scaler is not None and not callable(getattr(out.scaler, "update", None)):
        raise TypeError(f"scaler={out.scaler!r}: give the loop's torch.amp.GradScaler (its update() is watched), "
                        "or None")
    if out.run_dir is not None and not isinstance(out.run_dir, (str, os.PathLike)):
        raise TypeError(f"run_dir={out.run_dir!r}: give a folder path (a str or pathlib.Path), or None for a new "
                        "runs/<date> folder")
    shortcuts = {k: merged.pop(k) for k in list(merged) if k in MONITOR_FIELDS}
    given = {g: _group_node(g, v) for g, v in merged.items()}
    if shortcuts:
        given["monitor"] = OmegaConf.merge(OmegaConf.create(given.get("monitor", {})), shortcuts)
    _check_renamed(given)
    _check_keys(given)
    _check_clip_kind(given)
    node = _typed(_schema(given), given)  # types and names: ConfigError naming the field and the type
    built = to_config(node)  # ranges: each __post_init__ (ConfigError naming the field), as under Hydra
    for g in GROUPS:
        if g == "tracker" and out.tracker_auto:
            out.tracker = built[g]
            continue
        if g == "tracker" and isinstance(out.tracker, Tracker):
            continue
        setattr(out, g, built[g])
    return out


def option_params(opts: WatchOptions) -> dict[str, Any]:
    """The options as a run's params, under the Hydra app's names (``clip.kind``, ``spikes.z_thresh``, ...):
    runs opened by ``watch()`` or a callback showed none, so MLflow's compare view could not tell a ZClip
    run from an AdaGC one (tester round 12). None means "not set" and is left out."""
    out: dict[str, Any] = {}
    for group in ("monitor", "clip", "spikes", "locate"):
        for key, value in dataclasses.asdict(getattr(opts, group)).items():
            if value is not None:
                out[f"{group}.{key}"] = value
    return out
