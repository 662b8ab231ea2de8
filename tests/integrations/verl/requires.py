"""Every verl test module imports this first: where verl is missing (every venv but the ``[verl]``
one, docs/verl.md) the module is skipped with the line that installs it."""
from __future__ import annotations

import pytest

INSTALL = "verl is not installed: pip install 'gradloc-track[verl]' (its own venv, see docs/verl.md)"
verl = pytest.importorskip("verl", reason=INSTALL)
