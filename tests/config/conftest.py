"""``composer``: the demo app's config composed by Hydra from conf/, one override list at a time."""
from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

from gradloc_track.demo.config import register_configs

from ..conftest import CONF_DIR


@pytest.fixture(scope="module")
def composer():
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        yield lambda overrides=(): compose("config", overrides=list(overrides))
