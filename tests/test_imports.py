"""Every module of the library imports by its dotted path (the Layout in the README is real)."""
from __future__ import annotations

import importlib
import pkgutil

import pytest

import gradloc_track

MODULES = sorted(m.name for m in pkgutil.walk_packages(gradloc_track.__path__, "gradloc_track."))


def test_the_library_has_the_rooms_the_readme_lists():
    for name in ("gradloc_track.localizer.search", "gradloc_track.monitor.grad_monitor",
                 "gradloc_track.trackers.async_writer.writer", "gradloc_track.clip.adagc"):
        assert name in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_every_module_imports_by_its_dotted_path(name):
    module = importlib.import_module(name)
    assert module.__name__ == name


def test_locate_is_the_function_and_localizer_the_package():
    import gradloc_track.localizer as localizer

    assert callable(gradloc_track.locate) and gradloc_track.locate is localizer.locate
    assert localizer.__path__ and localizer.LocateResult is gradloc_track.LocateResult
    assert gradloc_track.monitor.GradMonitor is gradloc_track.GradMonitor
