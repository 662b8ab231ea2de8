"""The demo's optimizer and schedule: the configured AdamC peak reaches the optimizer and the groups split."""
from __future__ import annotations

import pytest

from gradloc_track.adamc import AdamCWeightDecay


def test_the_example_app_passes_the_configured_peak_and_splits_the_groups():
    from hydra import compose, initialize_config_dir

    from gradloc_track.config import to_config
    from gradloc_track.demo.config import register_configs
    from gradloc_track.demo.model import build_model
    from gradloc_track.demo.optim import make_optimizer, make_schedule

    from ..conftest import CONF_DIR

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = to_config(compose("config", overrides=["optim=adamc", "optim.adamc_lr_max=2e-3", "model.n_layer=1",
                                                     "model.d_model=16", "model.n_head=2"]))
    model = build_model(cfg.model)
    opt = make_optimizer(model, cfg.optim)
    sched = make_schedule(opt, cfg.optim, steps=10)
    adamc = AdamCWeightDecay.from_config(opt, cfg.optim, scheduler=sched, model=model)
    assert {b[1] for b in adamc.base} == {2e-3}  # the configured peak reached the optimizer
    corrected = {id(p) for i in adamc.corrected_groups for p in opt.param_groups[i]["params"]}
    assert id(model.wte.weight) not in corrected and id(model.lm_head.weight) not in corrected
    assert id(model.h[0].attn.qkv.weight) in corrected
    lr = opt.param_groups[0]["lr"]
    assert opt.param_groups[adamc.corrected_groups[0]]["weight_decay"] == pytest.approx(0.1 * lr / 2e-3)
