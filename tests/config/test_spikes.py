"""SpikeConfig: a bad value names the field, in the schema and as a SpikeDetector keyword."""
from __future__ import annotations

import pytest

from gradloc_track.config import ConfigError
from gradloc_track.spikes import SpikeDetector


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="spikes.alpha"):
        SpikeDetector(alpha=1.0)
    with pytest.raises(ConfigError, match="spikes.per_token_threshold"):
        SpikeDetector(mode="fixed")


@pytest.mark.parametrize("kwargs,field", [
    ({"ratio_thresh": -1.0}, "spikes.ratio_thresh"),
    ({"ratio_thresh": 1.0}, "spikes.ratio_thresh"),
    ({"score_window": 0}, "spikes.score_window"),
    ({"z_thresh": 0}, "spikes.z_thresh"),
    ({"z_thresh": float("nan")}, "spikes.z_thresh"),
    ({"z_thresh": "6"}, "spikes.z_thresh"),
    ({"update_z_thresh": 0}, "spikes.update_z_thresh"),
    ({"update_z_thresh": float("inf")}, "spikes.update_z_thresh"),
    ({"min_ratio": 0.5}, "spikes.min_ratio"),
    ({"warmup_steps": -1}, "spikes.warmup_steps"),
    ({"warmup_steps": 2.5}, "spikes.warmup_steps"),
    ({"per_layer": "yes"}, "spikes.per_layer"),
    ({"mode": "zscore"}, "spikes.mode"),
    ({"per_token_threshold": -5.0}, "spikes.per_token_threshold"),
    ({"tail_correction": 1}, "spikes.tail_correction"),
    ({"baseline_alpha": 1.0}, "spikes.baseline_alpha"),
])
def test_bad_spike_config_values_name_the_field(kwargs, field):
    from gradloc_track.config import SpikeConfig

    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        SpikeConfig(**kwargs)
