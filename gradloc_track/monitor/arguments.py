"""Checks of ``GradMonitor``'s constructor arguments: wrong kinds fail at construction, by name.

A monitor built with ``tracker="mlflow"``, ``clipper=AdaGC`` (the class) or a dict where a config
belongs would otherwise fail at the first logging step, or worse, at the first spike, deep
inside training.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

import torch

from ..config import LocateConfig, SpikeConfig


def _kind(value: Any) -> str:
    return f"the class {value.__name__}" if isinstance(value, type) else f"a {type(value).__name__}"


def _needs(name: str, value: Any, method: str, example: str) -> None:
    """``value`` must be None or an instance with a callable ``method``."""
    if value is None:
        return
    if isinstance(value, type):
        raise TypeError(f"GradMonitor({name}={value.__name__}): that is the class; pass an instance, e.g. "
                        f"{name}={example}")
    if not callable(getattr(value, method, None)):
        raise TypeError(f"GradMonitor({name}=...): got {_kind(value)}, which has no {method}(); pass e.g. "
                        f"{name}={example}, or None")


def check_arguments(model: Any, tracker: Any, clipper: Any, optimizer: Any, detector: Any,
                    artifact_writer: Any) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"GradMonitor(model=...): got {_kind(model)}; pass the torch.nn.Module being trained")
    if isinstance(tracker, str):
        raise TypeError(f"GradMonitor(tracker={tracker!r}): a tracker is an object, not a name; build one with "
                        f"gradloc_track.make_tracker(TrackerConfig(kind={tracker!r})) and pass it, "
                        "or pass None to log nothing")
    _needs("tracker", tracker, "log_metrics", "make_tracker(TrackerConfig(kind='mlflow'))")
    _needs("clipper", clipper, "clip", "AdaGC(model) (see gradloc_track.clip)")
    if optimizer is not None and (isinstance(optimizer, type) or not hasattr(optimizer, "param_groups")):
        raise TypeError(f"GradMonitor(optimizer=...): got {_kind(optimizer)}; pass the torch.optim.Optimizer "
                        "instance (it is read for lr and weight_decay), or None")
    if not isinstance(detector, SpikeConfig):
        _needs("detector", detector, "update", "SpikeDetector(warmup_steps=20)")
        if detector is not None and not callable(getattr(detector, "metrics", None)):
            raise TypeError(f"GradMonitor(detector=...): got {_kind(detector)}, which has no metrics(); pass a "
                            "gradloc_track.SpikeDetector or a SpikeConfig")
    _needs("artifact_writer", artifact_writer, "write", "SpikeArtifactWriter(tracker)")
    _needs("artifact_writer", artifact_writer, "write_detection", "SpikeArtifactWriter(tracker)")


def as_detector(detector: Any) -> Any:
    """A ``SpikeConfig`` becomes its ``SpikeDetector`` (or None when ``enabled=False``)."""
    if isinstance(detector, SpikeConfig):
        from ..spikes import SpikeDetector

        return SpikeDetector(detector) if detector.enabled else None
    return detector


def needs_token_count(detector: Any) -> bool:
    """Does the detector read the step's loss-token count (``DetectorLike.needs_token_count``)? Read
    once, at construction; a detector without the attribute reads none."""
    return detector is not None and bool(getattr(detector, "needs_token_count", False))


def response_mode(detector: Any, locate_config: LocateConfig) -> str:
    """The ``spikes.response`` of ``detector`` (a ``SpikeDetector`` or the ``SpikeConfig`` given for
    one; ``none`` without one), checked against the localizer's config: surgery removes what the
    localizer names."""
    spikes = detector if isinstance(detector, SpikeConfig) else getattr(detector, "config", None)
    if not isinstance(spikes, SpikeConfig):
        return "none"
    from ..config.spikes import check_response

    check_response(spikes, locate_config.enabled)
    return spikes.response


def as_locate_config(value: Any) -> LocateConfig:
    """``None`` -> defaults; a mapping (dict, OmegaConf DictConfig) -> ``LocateConfig(**value)``.

    Converted here, at construction, so a wrong key or value fails now rather than at the first
    spike (where the localizer's guard would only warn).
    """
    if value is None:
        return LocateConfig()
    if isinstance(value, LocateConfig):
        return value
    if isinstance(value, Mapping):
        known = {f.name for f in fields(LocateConfig)}
        unknown = sorted(set(map(str, value)) - known)
        if unknown:
            raise TypeError(f"GradMonitor(locate_config=...): unknown key(s) {unknown}; valid keys are the "
                            f"LocateConfig fields {sorted(known)}")
        return LocateConfig(**{str(k): v for k, v in value.items()})
    raise TypeError(f"GradMonitor(locate_config=...): got {_kind(value)}; pass a "
                    "gradloc_track.config.LocateConfig (or a dict of its fields), or None for the defaults")


def as_monitor_config(config: Any, overrides: dict[str, Any]) -> Any:
    """``config=MonitorConfig(...)`` or option keywords (``log_every=10``), never both."""
    from ..config import MonitorConfig

    if config is None:
        known = {f.name for f in fields(MonitorConfig)}
        unknown = set(overrides) - known
        if unknown:
            raise TypeError(f"GradMonitor got unknown option(s) {sorted(unknown)}; "
                            f"valid options are the MonitorConfig fields {sorted(known)}")
        config = MonitorConfig(**overrides)
    elif overrides:
        raise TypeError("GradMonitor: pass either config=MonitorConfig(...) or option keywords "
                        f"({sorted(overrides)}), not both")
    if not isinstance(config, MonitorConfig):
        raise TypeError(f"GradMonitor: config must be a gradloc_track.config.MonitorConfig, "
                        f"got {type(config).__name__}")
    return config
