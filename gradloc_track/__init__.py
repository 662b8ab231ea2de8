"""gradloc-track: make gradient spikes in LLM training visible, explainable and survivable.

``import gradloc_track`` imports neither wandb nor mlflow (backends load when a tracker is built),
nor torch: every public name resolves on first use, so the readers behind the ``gradloc-track``
command (reports, ledgers, blocklists) start without it.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it (resolved lazily to keep import light)
_EXPORTS = {
    "GradMonitor": "gradloc_track.monitor",
    "GradStats": "gradloc_track.monitor",
    "LocateResult": "gradloc_track.localizer.result",
    "CulpritToken": "gradloc_track.localizer.result",
    "SpikeDetector": "gradloc_track.spikes",
    "SpikeEvent": "gradloc_track.spikes.event",
    "Tracker": "gradloc_track.trackers",
    "NullTracker": "gradloc_track.trackers",
    "MemoryTracker": "gradloc_track.trackers",
    "FanoutTracker": "gradloc_track.trackers",
    "make_tracker": "gradloc_track.trackers",
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
