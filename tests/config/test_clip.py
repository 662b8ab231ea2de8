"""Clip schemas: a bad value names the field, directly and through Hydra composition."""
from __future__ import annotations

import pytest

from gradloc_track.config import AdaGCConfig, ConfigError, GlobalClipConfig, LayerClipConfig, ZClipConfig


@pytest.mark.parametrize("schema,field,value", [
    (LayerClipConfig, "alpha", 2), (AdaGCConfig, "eps", -1.0), (AdaGCConfig, "eps", 0.0), (ZClipConfig, "alpha", 0.0),
    (AdaGCConfig, "beta", "0.9"), (AdaGCConfig, "warmup_steps", -1), (ZClipConfig, "warmup_steps", 0),
    (ZClipConfig, "clip_factor", 0.0), (ZClipConfig, "max_grad_norm", -1.0),
    (LayerClipConfig, "z_thresh", float("inf")), (AdaGCConfig, "mode", "AdaGC-Shard"),
    (ZClipConfig, "skip_update_on_spike", "yes"), (GlobalClipConfig, "max_norm", float("nan")),
    (LayerClipConfig, "on_nonfinite", "ignore"), (GlobalClipConfig, "skip_step", "maybe")])
def test_bad_clip_config_names_the_field(schema, field, value):
    with pytest.raises(ConfigError, match=rf"clip\.{field}="):
        schema(**{field: value})


def test_bad_clip_override_fails_at_composition_naming_the_field():
    from hydra import compose, initialize_config_dir

    from gradloc_track.config import to_config
    from gradloc_track.demo.config import register_configs

    from ..conftest import CONF_DIR

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        with pytest.raises(ConfigError, match=r"clip\.alpha=2"):
            to_config(compose("config", overrides=["clip=layerclip", "clip.alpha=2"]))
        cfg = to_config(compose("config", overrides=["clip=zclip", "clip.max_grad_norm=1.0",
                                                     "clip.skip_update_on_spike=true", "clip.clip_factor=0.8"]))
    assert (cfg.clip.max_grad_norm, cfg.clip.skip_update_on_spike, cfg.clip.clip_factor) == (1.0, True, 0.8)
