"""``_lazy.lazy_names``: a package's ``__getattr__`` that imports a name's module on first use only.

(The module is ``_lazy.py``; its test drops the leading underscore, as ``test_moved.py`` does.)
"""
from __future__ import annotations

import importlib
import sys

import pytest

from gradloc_track._lazy import lazy_names


@pytest.fixture
def pkg(tmp_path, monkeypatch):
    """A throwaway package whose module records each import of itself in ``IMPORTS``."""
    root = tmp_path / "lazy_case_pkg"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "heavy.py").write_text("import builtins\nbuiltins.LAZY_CASE_IMPORTS += 1\nVALUE = 42\n"
                                   "def helper():\n    return 'helped'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr("builtins.LAZY_CASE_IMPORTS", 0, raising=False)
    yield "lazy_case_pkg"
    for name in [m for m in sys.modules if m.startswith("lazy_case_pkg")]:
        del sys.modules[name]


def test_a_name_imports_its_module_on_first_use_only(pkg):
    import builtins

    get = lazy_names(pkg, {"VALUE": f"{pkg}.heavy", "helper": f"{pkg}.heavy"})
    assert builtins.LAZY_CASE_IMPORTS == 0 and f"{pkg}.heavy" not in sys.modules  # building it imports nothing
    assert get("VALUE") == 42
    assert get("helper")() == "helped" and get("helper") is sys.modules[f"{pkg}.heavy"].helper
    assert builtins.LAZY_CASE_IMPORTS == 1  # the module ran once, whatever was read from it


def test_an_unknown_name_is_an_attribute_error_naming_package_and_name(pkg):
    get = lazy_names(pkg, {"VALUE": f"{pkg}.heavy"})
    with pytest.raises(AttributeError, match=r"module 'lazy_case_pkg' has no attribute 'nope'"):
        get("nope")
    assert not hasattr(type("M", (), {"__getattr__": staticmethod(get)})(), "nope")  # hasattr() reads it as absent


@pytest.mark.parametrize("package", ["gradloc_track.data", "gradloc_track.ledger", "gradloc_track.artifacts"])
def test_every_name_a_package_exports_lazily_resolves_to_its_modules_own(package):
    """The tables of the packages that use it: no name that points at the wrong module."""
    mod = importlib.import_module(package)
    for name, where in mod._EXPORTS.items():
        assert getattr(mod, name) is getattr(importlib.import_module(where), name), name
    assert sorted(mod.__all__) == sorted(mod._EXPORTS)


def test_the_trackers_package_imports_its_writers_on_first_use_and_still_hands_out_its_submodules():
    """``gradloc_track.trackers`` imports its writer stack on first use (the CLI's readers start without it),
    and a plain ``import gradloc_track.trackers`` still reaches every submodule as an attribute, as when the
    package imported them all (review of bbcf81d: ``trackers.local_tracker`` raised AttributeError)."""
    import subprocess

    code = ("import sys, gradloc_track.trackers as t\n"
            "print('gradloc_track.trackers.local_tracker' in sys.modules)\n"
            "print(t.local_tracker.LocalTracker is t.LocalTracker, t.files.__name__, t.MemoryTracker.__name__)\n"
            "print(hasattr(t, 'no_such_module'), 'LocalTracker' in dir(t), getattr(t, 'files.x', None))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "True", "gradloc_track.trackers.files", "MemoryTracker", "False", "True", "None"]
