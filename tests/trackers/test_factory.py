"""Building trackers (``trackers/factory.py``): no backend imported until built; a missing one
names its extra; bad config names the field."""
from __future__ import annotations

import subprocess
import sys

import pytest

from gradloc_track.trackers.backends import BACKENDS


def test_import_needs_neither_backend():
    code = "import sys, gradloc_track, gradloc_track.trackers, gradloc_track.monitor; " \
           f"print(*[m in sys.modules for m in {list(BACKENDS)!r}])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False"] * len(BACKENDS)


@pytest.mark.parametrize("kind", list(BACKENDS))
def test_missing_backend_names_the_extra(kind):
    code = (f"import sys; sys.modules[{kind!r}] = None\n"
            "from gradloc_track.config import TrackerConfig\n"
            "from gradloc_track.trackers import make_tracker\n"
            f"make_tracker(TrackerConfig(kind={kind!r}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode != 0
    assert f"pip install 'gradloc-track[{kind}]'" in proc.stderr


