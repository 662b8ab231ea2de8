"""gradloc-track: make gradient spikes in LLM training visible, explainable and survivable.

``import gradloc_track`` imports neither wandb nor mlflow (backends load when a tracker is built),
nor torch: every public name resolves on first use, so the readers behind the ``gradloc-track``
command (reports, ledgers, blocklists) start without it.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.5.0.dev0"

# public name -> module that defines it (resolved lazily to keep import light). The first block is what
# the README's hand-written loop needs (``from gradloc_track import ...``): one import, one module
_EXPORTS = {
    "GradMonitor": "gradloc_track.monitor",
    "make_tracker": "gradloc_track.trackers",
    "TrackerConfig": "gradloc_track.config",
    "LocateConfig": "gradloc_track.config",
    "SpikeDetector": "gradloc_track.spikes",
    "SpikeContext": "gradloc_track.spikes",
    "save_rng": "gradloc_track.localizer",
    "SpikeArtifactWriter": "gradloc_track.artifacts",
    "TrainConsole": "gradloc_track.console",
    "closing_lines": "gradloc_track.console",
    "ZClip": "gradloc_track.clip",
    "AdaGC": "gradloc_track.clip",
    "LayerClip": "gradloc_track.clip",
    "GlobalClip": "gradloc_track.clip",
    # what a step returns and what a spike is
    "GradStats": "gradloc_track.monitor",
    "LocateResult": "gradloc_track.localizer.result",
    "CulpritToken": "gradloc_track.localizer.result",
    "SpikeEvent": "gradloc_track.spikes.event",
    # trackers: the seam (``Tracker``: a destination whose methods do nothing by default) and its plain ones
    "Tracker": "gradloc_track.trackers",
    "NullTracker": "gradloc_track.trackers",
    "MemoryTracker": "gradloc_track.trackers",
    "FanoutTracker": "gradloc_track.trackers",
    # the front doors
    "watch": "gradloc_track.integrations.watch",
    "WatchHandle": "gradloc_track.integrations.watch",
    # the public function ``gradloc_track.locate(model, ...)``; its package is ``gradloc_track.localizer``
    "locate": "gradloc_track.localizer",
}
_SUBMODULES = ("clip", "spikes", "trackers", "config", "artifacts", "norms", "grouping", "localizer", "monitor",
               "integrations", "data", "ledger")

__all__ = sorted(_EXPORTS) + list(_SUBMODULES)

from ._moved import install as _install_moved  # noqa: E402

_install_moved()  # 0.3's module paths, with a DeprecationWarning (see _moved.py)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"gradloc_track.{name}")
    raise AttributeError(f"module 'gradloc_track' has no attribute {name!r}")
