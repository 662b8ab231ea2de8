"""Old import paths of modules that moved in 0.4, kept through 0.5 with a DeprecationWarning.

``import gradloc_track.demo.console`` still works (the README of 0.3 showed it) and gives the
module at its new path, ``gradloc_track.console``, after a warning naming the new path. An
import hook instead of stub files: a stub would keep the old file name in the package, and the
layout promises one file name per meaning.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

#: old dotted path -> new dotted path (0.3 -> 0.4)
MOVED: dict[str, str] = {
    "gradloc_track.demo.console": "gradloc_track.console",
    "gradloc_track.localizer.memory": "gradloc_track.tensor_memory",
    "gradloc_track.localizer.replay": "gradloc_track.localizer.step_check",
    "gradloc_track.monitor.spike_response": "gradloc_track.monitor.responder",
    "gradloc_track.trackers.base": "gradloc_track.trackers.interface",
    "gradloc_track.trackers.memory": "gradloc_track.trackers.memory_tracker",
    "gradloc_track.trackers.keys": "gradloc_track.trackers.naming",
    "gradloc_track.trackers.async_writer.tracker": "gradloc_track.trackers.async_writer.async_tracker",
    "gradloc_track.artifacts.writer": "gradloc_track.artifacts.artifact_writer",
    "gradloc_track.clip.base": "gradloc_track.clip.clipper",
    "gradloc_track.data.keys": "gradloc_track.data.fingerprint",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path and hands out the module at its new one."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; the old path goes away in the next release",
                      DeprecationWarning, stacklevel=3)
        return importlib.import_module(new)

    def exec_module(self, module) -> None:
        pass  # the new module is already executed


def install() -> None:
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.append(_Alias())
