"""0.3's module paths still import, with a DeprecationWarning naming the new path (``_moved``)."""
from __future__ import annotations

import importlib
import sys

import pytest

from gradloc_track._moved import MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_gives_the_new_module_and_says_where_it_went(old):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=MOVED[old].replace(".", r"\.")):
        module = importlib.import_module(old)
    assert module is importlib.import_module(MOVED[old])


def test_the_readme_loop_of_0_3_still_runs_its_console_import():
    sys.modules.pop("gradloc_track.demo.console", None)
    with pytest.warns(DeprecationWarning):
        from gradloc_track.demo.console import TrainConsole
    from gradloc_track.console import TrainConsole as New

    assert TrainConsole is New


def test_no_moved_path_is_still_a_file():
    """The alias is the only way in: no stub file keeps the old name in the package."""
    import importlib.machinery

    for old in MOVED:
        parent, leaf = old.rsplit(".", 1)
        assert importlib.machinery.PathFinder.find_spec(leaf, importlib.import_module(parent).__path__) is None, old
