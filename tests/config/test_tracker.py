"""TrackerConfig: a bad value names the field."""
from __future__ import annotations

import pytest

from gradloc_track.config import TrackerConfig


def test_config_errors_name_the_field():
    from gradloc_track.config import ConfigError

    with pytest.raises(ConfigError, match="tracker.kind"):
        TrackerConfig(kind="neptune")
    with pytest.raises(ConfigError, match="tracker.queue_size"):
        TrackerConfig(queue_size=0)
