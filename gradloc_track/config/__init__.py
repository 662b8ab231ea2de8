"""Typed configs, registered with Hydra's ConfigStore and mirrored by YAML in ``conf/``.

Each YAML file in ``conf/<group>/`` starts from the schema registered here as
``<group>/<name>_schema`` (Hydra's structured-config "schema" pattern), so typos and wrong
types fail at composition. Range checks live in each dataclass's ``__post_init__`` and run
when the app calls ``to_config(cfg)``.
"""
from __future__ import annotations

from typing import Any

from ._validate import ConfigError
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

_GROUPS = {
    "tracker": TrackerConfig,
    "monitor": MonitorConfig,
    "clip": ClipConfig,
    "spikes": SpikeConfig,
    "locate": LocateConfig,
    "model": ModelConfig,
    "optim": OptimConfig,
}

_registered = False


def register_configs() -> None:
    """Register the schemas with Hydra's ConfigStore (idempotent)."""
    global _registered
    if _registered:
        return
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="root_schema", node=RootConfig)
    for group, node in _GROUPS.items():
        cs.store(group=group, name="schema", node=node)
    _registered = True


def to_config(cfg: Any) -> RootConfig:
    """Turn a composed DictConfig into validated dataclasses (runs every ``__post_init__``).

    Range errors surface as ``ConfigError`` naming the field, e.g. ``monitor.log_every=-1``.
    """
    from omegaconf import OmegaConf

    try:
        return OmegaConf.to_object(cfg)
    except Exception as exc:  # OmegaConf wraps __post_init__ errors; unwrap ours
        cause = exc
        while cause is not None and not isinstance(cause, ConfigError):
            cause = cause.__cause__ or cause.__context__
        if isinstance(cause, ConfigError):
            raise ConfigError(str(cause)) from None
        raise
