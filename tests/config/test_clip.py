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


@pytest.mark.parametrize("schema,field,value", [
    (AdaGCConfig, "eps", 1e18), (AdaGCConfig, "eps", 0.5), (ZClipConfig, "eps", 1e18), (LayerClipConfig, "eps", 1e18),
    (AdaGCConfig, "lambda_rel", 1.0), (AdaGCConfig, "lambda_rel", 0.9)])
def test_values_that_silently_zero_or_disable_clipping_are_refused(schema, field, value):
    """``clip.eps=1e18`` scaled every AdaGC gradient to ~0 and stopped ZClip/LayerClip from ever
    clipping; ``lambda_rel <= 1`` lets AdaGC's running norm only shrink. The error names the range."""
    with pytest.raises(ConfigError, match=rf"clip\.{field}=.*(eps <= 0.01|above 1)"):
        schema(**{field: value})


def test_the_clippers_refuse_them_too_and_accept_the_edges():
    import torch

    from gradloc_track.clip import AdaGC, LayerClip, ZClip

    model = torch.nn.Linear(2, 2)
    for make in (lambda: AdaGC(model, eps=1e18), lambda: ZClip(model, eps=1e18), lambda: LayerClip(model, eps=1.0),
                 lambda: AdaGC(model, lambda_rel=1.0)):
        with pytest.raises(ConfigError, match="eps <= 0.01|above 1"):
            make()
    assert AdaGCConfig(eps=1e-2, lambda_rel=1.001).eps == 1e-2 and ZClipConfig(eps=0.0).eps == 0.0
