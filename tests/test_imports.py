"""Every module of the library imports by its dotted path (the Layout in the README is real)."""
from __future__ import annotations

import importlib
import importlib.util
import pkgutil

import pytest

import gradloc_track

MODULES = sorted(m.name for m in pkgutil.walk_packages(gradloc_track.__path__, "gradloc_track."))


def test_the_library_has_the_rooms_the_readme_lists():
    for name in ("gradloc_track.localizer.search", "gradloc_track.monitor.grad_monitor",
                 "gradloc_track.trackers.async_writer.writer", "gradloc_track.clip.adagc"):
        assert name in MODULES


# extras outside [dev] (their own venv): their adapters import only where the extra is installed
OWN_VENV = {"gradloc_track.integrations.verl": "verl"}


@pytest.mark.parametrize("name", MODULES)
def test_every_module_imports_by_its_dotted_path(name):
    extra = next((e for prefix, e in OWN_VENV.items() if name.startswith(prefix)), None)
    if extra is not None and importlib.util.find_spec(extra) is None:
        with pytest.raises(ImportError, match=rf"pip install 'gradloc-track\[{extra}\]'"):
            importlib.import_module(name)
        return
    module = importlib.import_module(name)
    assert module.__name__ == name


def test_locate_is_the_function_and_localizer_the_package():
    import gradloc_track.localizer as localizer

    assert callable(gradloc_track.locate) and gradloc_track.locate is localizer.locate
    assert localizer.__path__ and localizer.LocateResult is gradloc_track.LocateResult
    assert gradloc_track.monitor.GradMonitor is gradloc_track.GradMonitor


def test_the_readme_loop_imports_every_name_it_needs_from_the_top_level():
    """Issue 42: the hand-written loop of README.md ("Use it in your loop") needs one import, from
    ``gradloc_track`` itself; every name it imports resolves there (lazily: torch loads on first use)."""
    import ast
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Use it in your loop", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    imports = [n for n in ast.walk(ast.parse(code)) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert [getattr(n, "module", None) for n in imports] == ["gradloc_track"], "one import, from the top level"
    names = [a.name for a in imports[0].names]
    assert {"GradMonitor", "make_tracker", "ZClip", "SpikeContext", "save_rng", "closing_lines"} <= set(names)
    for name in names:
        assert name in gradloc_track.__all__ and getattr(gradloc_track, name) is not None


def test_the_package_says_the_version_pyproject_gives():
    """One version: ``gradloc_track.__version__`` is pyproject's (it said 0.1.0 after 0.4 had landed)."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text(encoding="utf-8")
    (version,) = re.findall(r'(?m)^version = "([^"]+)"$', text)
    assert gradloc_track.__version__ == version
