"""A key typo on the command line fails naming the closest field, with or without ``+``.

``+monitor.log_evry=5`` reaches composition and ``to_config`` names the key (``unknown_keys``);
without the ``+``, Hydra stops first with "Could not override 'monitor.log_evry' ... Key
'log_evry' not in 'MonitorConfig'" and no suggestion. So the app checks its command line against
the schema before Hydra runs: a key no schema could hold fails with our "did you mean".

Only what is certain is reported. A group node (``clip``) accepts the fields of its declared
schema and of every option schema under it (``clip.beta`` is AdaGC's): a key that one of them
has is left to Hydra, which knows the option actually selected, unless the same command line picks
the option (``clip=zclip clip.lambda_rel=1.1``): then a field only other options have names them. A
field that is not a dataclass (a dict, a list) takes any sub-key.
"""
from __future__ import annotations

import dataclasses
import difflib
import typing
from pathlib import Path
from typing import Any, Iterable

from ._validate import _unknown_key_hint
from .errors import ConfigError
from .renamed import check_renamed


def _schemas(tp: Any) -> list[type]:
    """The dataclasses a node of type ``tp`` can be: it, and its subclasses (a group's options)."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is typing.Union and len(args) == 1:  # Optional[X]
        tp = args[0]
    if not (isinstance(tp, type) and dataclasses.is_dataclass(tp)):
        return []
    out, todo = [], [tp]
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo += cls.__subclasses__()
    return out


def _fields(schemas: list[type]) -> dict[str, list[type]]:
    """field name -> the dataclasses its value can be, over every schema a node can be."""
    out: dict[str, list[type]] = {}
    for schema in schemas:
        hints = typing.get_type_hints(schema)
        for f in dataclasses.fields(schema):
            kinds = _schemas(hints.get(f.name, Any))
            out.setdefault(f.name, [])
            out[f.name] += [k for k in kinds if k not in out[f.name]]
            if not kinds:
                out[f.name].append(object)  # a plain value, dict or list: any sub-key is its own business
    return out


def unknown_override_key(key: str, schema: type) -> str | None:
    """``"monitor.log_evry (did you mean monitor.log_every?)"`` when no schema reachable along the
    dotted ``key`` has its next segment, else None."""
    nodes, path = [schema], ""
    for part in key.split("."):
        fields = _fields(nodes)
        if part not in fields:
            return f"{path}{part} ({_unknown_key_hint(path, part, sorted(fields))})"
        nodes = [k for k in fields[part] if k is not object]
        if object in fields[part] or not nodes:
            return None
        path += part + "."
    return None


SWITCH_WORDS = {"true": True, "on": True, "yes": True, "1": True, "enabled": True,
                "false": False, "off": False, "no": False, "0": False, "disabled": False}


def _options(conf_dirs: list[Path], group: str) -> list[str]:
    """A config group's options over every config folder (the app's, ``--config-dir``'s)."""
    found: set[str] = set()
    for d in (d / group for d in conf_dirs):
        if d.is_dir():
            found |= {p.stem for p in d.glob("*.yaml")} | {p.name for p in d.iterdir() if p.is_dir()}
    return sorted(found)


def _not_an_option(group: str, value: str, options: list[str], schema: type) -> str:
    """What to say about ``group=value`` when ``value`` is none of ``options``."""
    said = f"{group}={value}: "
    on = SWITCH_WORDS.get(value.lower())
    if on is not None:  # a switch word: the group's ``enabled`` field, if it has one
        switch = any("enabled" in _fields([k]) for k in _fields([schema]).get(group, []) if k is not object)
        fix = (f"to turn it {'on' if on else 'off'} use {group}.enabled={str(on).lower()}" if switch
               else f"pick one of its options ({group}={options[0]})")
        return f"{said}{group} is a config group (options: {', '.join(options)}), not a switch; {fix}"
    close = difflib.get_close_matches(value, options, n=1)
    hint = f" (did you mean {group}={close[0]}?)" if close else ""
    return f"{said}no such option of config group {group}{hint}; its options: {', '.join(options)}"


def _group_choice(group: str, value: str, conf_dirs: list[Path], schema: type) -> None:
    """``ConfigError`` for ``group=value`` naming none of the group's options (``locate=false``, the guess
    from ``watch(locate=False)``, was Hydra's 25-line "Config group override must be a string"); a
    sweep (``a,b``) is checked value by value, sweep functions (``glob(*)``) and ``null`` left to Hydra."""
    if "(" in value:
        return
    options = _options(conf_dirs, group)
    for v in (x.strip() for x in value.split(",")):
        if v not in options and v.lower() not in ("null", "~", ""):
            raise ConfigError(_not_an_option(group, v, options, schema))


def _other_options_field(key: str, chosen: dict[str, str], schema: type) -> str | None:
    """``clip.lambda_rel`` with ``clip=zclip`` on the same command line: a field of another option of the
    group (AdaGC's), not of the one picked. Hydra would say "Key 'lambda_rel' not in 'ZClipConfig'" and
    suggest ``+clip.lambda_rel``, which fails again; this names the options that have the field."""
    group, _, rest = key.partition(".")
    if group not in chosen or not rest or "," in chosen[group]:
        return None
    field = rest.split(".")[0]
    option, _, why = chosen[group].partition(" ")  # "adagc (experiment=spike_demo picks it)": not on the line
    options = [k for k in _fields([schema]).get(group, []) if k is not object]
    picked = [k for k in options if getattr(k, "KIND", None) == option]
    picked = [k for k in picked if not any(o is not k and issubclass(o, k) for o in picked)]  # the option's own
    if len(picked) != 1 or field in _fields(picked):
        return None
    having = sorted({getattr(k, "KIND") for k in options if getattr(k, "KIND", None) and field in _fields([k])})
    if not having:
        return None
    why = f", {why[1:-1]}," if why else ""
    return (f"{key} ({group}={option}{why} has no field {field!r}; it is a field of "
            f"{', '.join(f'{group}={h}' for h in having)}: pick that option or drop the key)")


def _defaults_list(path: Path) -> list:
    import yaml

    try:
        return list((yaml.safe_load(path.read_text()) or {}).get("defaults") or [])
    except (OSError, yaml.YAMLError, AttributeError):
        return []


def default_choices(conf_dir: Path, chosen: dict[str, str], groups: set[str],
                    extra_dirs: Iterable[Path] = ()) -> dict[str, str]:
    """The option each group gets when the command line does not pick one: the primary config's defaults
    (``clip: none``), overridden by the experiment the command line picks (``override /clip: adagc``).
    Without it, ``clip.max_norm=1.0`` under the default ``clip=none`` (or ``experiment=spike_demo
    clip.z_thresh=3``) got Hydra's "Could not override ... use +clip.max_norm", whose advice fails
    again (new-user tester round 12)."""
    out: dict[str, str] = {}
    for entry in _defaults_list(conf_dir / "config.yaml"):
        if isinstance(entry, dict):
            for group, option in entry.items():
                if group in groups and isinstance(option, str):
                    out[group] = option
    experiment = chosen.get("experiment", out.get("experiment"))
    if experiment and "," not in experiment:
        # the experiment file where Hydra finds it: the app's own conf/ first, then a --config-dir (Hydra's search
        # path puts the command line's folder after the primary config's)
        where = next((f for f in (d / "experiment" / f"{experiment}.yaml" for d in [conf_dir, *extra_dirs])
                      if f.is_file()), conf_dir / "experiment" / f"{experiment}.yaml")
        for entry in _defaults_list(where):
            if isinstance(entry, dict):
                for key, option in entry.items():
                    group = key.removeprefix("override").strip().lstrip("/")
                    if group in groups and isinstance(option, str):
                        out[group] = f"{option} (experiment={experiment} picks it)"
    return {g: o if o.endswith(")") else f"{o} (the default)" for g, o in out.items() if g not in chosen}


def check_override_keys(overrides: Iterable[str], schema: type, conf_dir: str | Path | None = None,
                        extra_dirs: Iterable[str | Path] = ()) -> None:
    """Raise ``ConfigError`` for every ``key=value`` override whose key ``schema`` cannot hold, and for a
    config group in ``conf_dir`` (or in ``extra_dirs``: Hydra's ``--config-dir``) given a value that is none
    of its options (``locate=false``).

    Skipped: ``+``/``++``/``~`` overrides (``to_config`` checks what ``+`` adds), ``hydra.*`` and
    ``hydra/...``.
    """
    extra = [Path(d) for d in extra_dirs if Path(d).is_dir()]
    dirs = ([Path(conf_dir)] if conf_dir is not None else []) + extra
    groups = {p.name for d in dirs for p in d.iterdir() if p.is_dir()} if conf_dir is not None else set()
    bad = []
    chosen = {}  # group -> the option this command line picks (clip=zclip)
    for o in overrides:
        if "=" in o and not o.startswith(("-", "+", "~")) and o.split("=", 1)[0] in groups:
            chosen[o.split("=", 1)[0]] = o.split("=", 1)[1]
    implied = default_choices(Path(conf_dir), chosen, groups, extra) if conf_dir is not None else {}
    for o in overrides:
        if "=" not in o or o.startswith(("-", "+", "~")):
            continue
        key, value = o.split("=", 1)
        if "." not in key and key in groups:
            _group_choice(key, value, dirs, schema)
            continue
        if key.split(".")[0] == "hydra" or "/" in key:
            continue
        found = unknown_override_key(key, schema) or _other_options_field(key, {**implied, **chosen}, schema)
        if found:
            bad.append(found)
    if bad:
        name = f"{schema.__module__}.{schema.__qualname__}"
        raise ConfigError(f"unknown config key(s): {'; '.join(bad)}. Every key must be a field of {name} "
                          "(see conf/); fix the key")


def override_keys(overrides: Iterable[str]) -> list[str]:
    """The dotted keys of Hydra command-line overrides (``+clip.alpha=0.9`` -> ``clip.alpha``)."""
    return [o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o and not o.startswith("-")]


def check_overrides(overrides: Iterable[str], schema: type | None = None,
                    conf_dir: str | Path | None = None) -> None:
    """``check_renamed`` on a Hydra command line, before Hydra's own "Key ... is not in struct";
    with the app's root ``schema`` (and its ``conf_dir``, for the group names), also every key typo
    without ``+`` (``check_override_keys``: "did you mean ...")."""
    overrides = list(overrides)
    check_renamed(override_keys(overrides))
    if schema is not None:
        extra, replaced = _config_flags(overrides)
        if not replaced:  # a --config-path/-cp replaces the app's primary config: its keys are not ours to know
            check_override_keys(overrides, schema, conf_dir, extra)


def _config_flags(argv: list[str]) -> tuple[list[str], bool]:
    """(the folder Hydra's ``--config-dir``/``-cd`` adds, whether ``--config-path``/``-cp`` replaces the primary
    config's) on a command line, read by Hydra's own argument parser (its abbreviations, its last-one-wins): an
    experiment in the user's own folder is an option too (held-out tester, stop 55: ``--config-dir my_conf
    experiment=fast`` was refused as "no such option")."""
    import contextlib
    import io

    try:
        from hydra._internal.utils import get_args_parser

        # silent: --version, --help or a bad flag is Hydra's to print once, when it parses the line itself (review)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            known, _ = get_args_parser().parse_known_args(argv)
    except (ImportError, SystemExit, AttributeError):  # another Hydra, or a line Hydra will refuse: as written
        dirs, replaced = [], False
        for i, a in enumerate(argv):
            flag, eq, val = a.partition("=")
            if flag in ("--config-dir", "-cd", "--config-path", "-cp"):
                val = val if eq else (argv[i + 1] if i + 1 < len(argv) else "")
                if flag in ("--config-dir", "-cd"):
                    dirs = [val] if val else []
                else:
                    replaced = True
        return dirs, replaced
    return ([known.config_dir] if known.config_dir else []), bool(known.config_path)
