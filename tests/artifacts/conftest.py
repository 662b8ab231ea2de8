"""The real localization the writer and table tests share (one per module)."""
from __future__ import annotations

import pytest

from .cases import real_spike


@pytest.fixture(scope="module")
def spike():
    return real_spike()
