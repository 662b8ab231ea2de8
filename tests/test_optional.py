"""``_optional.require``: an optional backend imported on demand, or an ImportError naming the extra.

(The module is ``_optional.py``; its test drops the leading underscore, as ``test_moved.py`` does.)
"""
from __future__ import annotations

import sys

import pytest

from gradloc_track._optional import require


def test_an_installed_module_is_returned_as_imported():
    import json

    assert require("json", "whatever") is json
    assert require("json.decoder", "whatever") is sys.modules["json.decoder"]


def test_a_missing_module_names_the_pip_line_of_its_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "gradloc_case_backend", None)  # as if not installed
    with pytest.raises(ImportError, match=r"'gradloc_case_backend' is not installed.*"
                                          r"pip install 'gradloc-track\[cases\]'") as info:
        require("gradloc_case_backend", "cases")
    assert isinstance(info.value.__cause__, ImportError)  # the original error stays attached


def test_a_missing_parent_package_is_the_backend_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "gradloc_case_backend", None)
    with pytest.raises(ImportError, match=r"'gradloc_case_backend.sub' is not installed"):
        require("gradloc_case_backend.sub", "cases")


def test_an_installed_backend_missing_a_dependency_says_which(tmp_path, monkeypatch):
    """A backend that is there but cannot import (its own dependency is gone) is not called "not
    installed": the message names the module that is missing, with the same install line."""
    (tmp_path / "gradloc_case_installed.py").write_text("import gradloc_case_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(sys.modules, "gradloc_case_dependency", None)
    monkeypatch.delitem(sys.modules, "gradloc_case_installed", raising=False)
    with pytest.raises(ImportError) as info:
        require("gradloc_case_installed", "cases")
    msg = str(info.value)
    assert "is not installed" not in msg and "'gradloc_case_installed' could not be imported" in msg
    assert "gradloc_case_dependency" in msg and "pip install 'gradloc-track[cases]'" in msg
