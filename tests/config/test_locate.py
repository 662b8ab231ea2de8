"""LocateConfig: a bad value names the field and the fix, directly and through Hydra composition."""
from __future__ import annotations

import pytest

from gradloc_track.config import ConfigError, LocateConfig


@pytest.mark.parametrize("field,value,fix", [
    ("max_events", -1, r"use 0 \(never localize\) or a positive whole number"),
    ("max_events", 2.5, "whole number"),
    ("budget", 0, "positive whole number of probes"),
    ("budget", True, "positive whole number of probes"),
    ("threshold", -0.1, "positive per-term gradient norm"),
    ("threshold", float("inf"), "positive per-term gradient norm"),
    ("top_layers", 0, "positive whole number of layers"),
    ("method", "magic", "'gradloc'"),
    ("enabled", "yes", "true or false"),
])
def test_locate_config_names_the_field_and_the_fix(field, value, fix):
    with pytest.raises(ConfigError, match=rf"locate\.{field}=.* is invalid: .*{fix}"):
        LocateConfig(**{field: value})


def test_locate_config_gradloc_needs_a_threshold_through_hydra():
    from hydra import compose, initialize_config_dir

    from gradloc_track.config import to_config
    from gradloc_track.demo.config import register_configs

    from ..conftest import CONF_DIR

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        with pytest.raises(ConfigError, match=r"locate\.threshold=None is invalid: locate\.method=gradloc needs"):
            to_config(compose("config", overrides=["locate.method=gradloc"]))
        with pytest.raises(ConfigError, match=r"locate\.max_events=-1"):
            to_config(compose("config", overrides=["locate.max_events=-1"]))
        cfg = to_config(compose("config", overrides=["locate.method=gradloc", "locate.threshold=0.5"]))
    assert (cfg.locate.method, cfg.locate.threshold) == ("gradloc", 0.5)
