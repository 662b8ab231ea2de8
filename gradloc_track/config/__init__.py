"""Typed configs, registered with Hydra's ConfigStore and mirrored by YAML in ``conf/``.

``conf/config.yaml`` starts from ``root_schema`` (``RootConfig``, registered here), which types
every group node (``tracker``, ``monitor``, ...): the YAML options in ``conf/<group>/`` merge into
it, so wrong types and unknown keys fail at composition. The schema is stored outside every
group, so it is never an option a user can pick (``tracker=schema`` is "not found"). Range checks
live in each dataclass's ``__post_init__`` and run when the app calls ``to_config(cfg)``, which
also rejects keys added with ``+key=value`` that no config field reads.
"""
from __future__ import annotations

from typing import Any

from ._validate import ConfigError, unknown_keys
from .clip import AdamCConfig, ClipConfig
from .monitor import MonitorConfig
from .root import RootConfig
from .locate import LocateConfig
from .spikes import SpikeConfig
from .tracker import MlflowConfig, TrackerConfig, WandbConfig
from .train import ModelConfig, OptimConfig, SpikeInjectionConfig, TrainConfig

__all__ = [
    "ConfigError", "RootConfig", "TrackerConfig", "WandbConfig", "MlflowConfig", "MonitorConfig",
    "ClipConfig", "AdamCConfig", "SpikeConfig", "LocateConfig", "ModelConfig", "OptimConfig",
    "TrainConfig", "SpikeInjectionConfig", "register_configs", "to_config",
]

_registered = False


def register_configs() -> None:
    """Register the schemas with Hydra's ConfigStore (idempotent)."""
    global _registered
    if _registered:
        return
    from hydra.core.config_store import ConfigStore

    # only the root: a schema stored in a group would be a pickable option (``tracker=schema``)
    ConfigStore.instance().store(name="root_schema", node=RootConfig)
    _registered = True


def to_config(cfg: Any) -> RootConfig:
    """Turn a composed DictConfig into validated dataclasses (runs every ``__post_init__``).

    Range errors surface as ``ConfigError`` naming the field, e.g. ``monitor.log_every=-1``;
    keys no field reads (``+monitor.log_evry=5``) as ``ConfigError`` naming the key.
    """
    from omegaconf import OmegaConf

    unknown = unknown_keys(cfg, RootConfig)
    if unknown:
        raise ConfigError(f"unknown config key(s): {'; '.join(unknown)}. Every key must be a field of "
                          "gradloc_track.config.RootConfig (see conf/); fix or drop the +override")
    try:
        return OmegaConf.to_object(cfg)
    except Exception as exc:  # OmegaConf wraps __post_init__ errors; unwrap ours
        cause = exc
        while cause is not None and not isinstance(cause, ConfigError):
            cause = cause.__cause__ or cause.__context__
        if isinstance(cause, ConfigError):
            raise ConfigError(str(cause)) from None
        raise
