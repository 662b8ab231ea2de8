"""Typed configs of the library, registered with Hydra's ConfigStore and mirrored by YAML in ``conf/``.

``RootConfig`` types every group node (``tracker``, ``monitor``, ``clip``, ``spikes``,
``locate``); an app composes from it (stored as ``root_schema``) or from a subclass that adds its
own groups (the demo app's ``gradloc_track.demo.config.DemoConfig``). The YAML options in
``conf/<group>/`` merge into it, so wrong types and unknown keys fail at composition. Each clip
option names its own schema (``schema/clip/<option>``). Schemas are stored outside every group,
so none is an option a user can pick (``tracker=schema`` is "not found"). Range checks live in
each dataclass's ``__post_init__`` and run when the app calls ``to_config(cfg)``, which also
rejects keys added with ``+key=value`` that no config field reads.
"""
from __future__ import annotations

from typing import Any

from ._validate import ConfigError, node_schema, unknown_keys
from .adamc import AdamCConfig
from .clip import (CLIP_SCHEMAS, AdaGCConfig, ClipConfig, GlobalClipConfig, LayerClipConfig, NoClipConfig,
                   ZClipConfig, clip_schema)
from .locate import LocateConfig
from .monitor import MonitorConfig
from .override_keys import check_overrides
from .renamed import check_renamed
from .root import RootConfig
from .spikes import SpikeConfig
from .tracker import MlflowConfig, TrackerConfig, WandbConfig

__all__ = [
    "ConfigError", "RootConfig", "TrackerConfig", "WandbConfig", "MlflowConfig", "MonitorConfig",
    "ClipConfig", "NoClipConfig", "GlobalClipConfig", "AdaGCConfig", "ZClipConfig", "LayerClipConfig",
    "clip_schema", "AdamCConfig", "SpikeConfig", "LocateConfig", "register_configs", "to_config",
    "check_overrides", "check_renamed",
]

_registered = False


def register_configs() -> None:
    """Register the schemas with Hydra's ConfigStore (idempotent)."""
    global _registered
    if _registered:
        return
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    # outside every group: a schema stored in a group would be a pickable option (``tracker=schema``)
    store.store(name="root_schema", node=RootConfig)
    for option, schema in CLIP_SCHEMAS.items():  # conf/clip/<option>.yaml: /schema/clip/<option>@_here_
        store.store(group="schema/clip", name=option, node=schema)
    _registered = True


def to_config(cfg: Any) -> RootConfig:
    """Turn a composed DictConfig into validated dataclasses (runs every ``__post_init__``).

    The schema is the one ``cfg`` was composed from (``RootConfig`` or an app's subclass). Range
    errors surface as ``ConfigError`` naming the field, e.g. ``monitor.log_every=-1``; keys no
    field reads (``+monitor.log_evry=5``) as ``ConfigError`` naming the key.
    """
    from omegaconf import OmegaConf

    schema = node_schema(cfg, RootConfig)
    unknown = unknown_keys(cfg, schema)
    if unknown:
        raise ConfigError(f"unknown config key(s): {'; '.join(unknown)}. Every key must be a field of "
                          f"{schema.__module__}.{schema.__qualname__} (see conf/); fix or drop the +override")
    try:
        return OmegaConf.to_object(cfg)
    except Exception as exc:  # OmegaConf wraps __post_init__ errors; unwrap ours
        cause = exc
        while cause is not None and not isinstance(cause, ConfigError):
            cause = cause.__cause__ or cause.__context__
        if isinstance(cause, ConfigError):
            raise ConfigError(str(cause)) from None
        raise
