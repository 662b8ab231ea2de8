"""``config/root.RootConfig``: its defaults are each group's, and its own checks (types, out_dir, and
the rule across groups that ``spikes.response=surgery`` needs the detector and the localizer)."""
from __future__ import annotations

import pytest

from gradloc_track.config import ConfigError, LocateConfig, MonitorConfig, SpikeConfig
from gradloc_track.config.root import RootConfig


def test_the_defaults_are_each_groups_own():
    cfg = RootConfig()
    assert cfg.monitor == MonitorConfig() and cfg.spikes == SpikeConfig() and cfg.locate == LocateConfig()
    assert cfg.run_name is None and cfg.out_dir == "runs"
    assert RootConfig().monitor is not cfg.monitor  # a fresh node per config, never a shared default


@pytest.mark.parametrize("out_dir", ["", "   ", "\t"])
def test_a_blank_out_dir_names_the_field(out_dir):
    with pytest.raises(ConfigError, match=r"out_dir=.* is invalid: use a directory for per-run files"):
        RootConfig(out_dir=out_dir)


@pytest.mark.parametrize("kwargs,field", [({"out_dir": 3}, "out_dir"), ({"run_name": 7}, "run_name"),
                                          ({"monitor": "fast"}, "monitor")])
def test_a_wrong_type_names_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=rf"^{field}="):
        RootConfig(**kwargs)


def test_surgery_needs_the_detector_and_the_localizer():
    RootConfig(spikes=SpikeConfig(response="surgery"), locate=LocateConfig(enabled=True))
    with pytest.raises(ConfigError, match=r"locate\.enabled=False is invalid: spikes.response=surgery removes"):
        RootConfig(spikes=SpikeConfig(response="surgery"), locate=LocateConfig(enabled=False))
    with pytest.raises(ConfigError, match=r"spikes\.enabled=False is invalid"):
        RootConfig(spikes=SpikeConfig(enabled=False, response="surgery"), locate=LocateConfig(enabled=True))
    RootConfig(spikes=SpikeConfig(enabled=False), locate=LocateConfig(enabled=False))  # no surgery: no rule
