"""Every config group composes with Hydra and instantiates; bad values fail naming the field."""
from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

from gradloc_track.config import ConfigError, RootConfig, register_configs, to_config

from ..conftest import CONF_DIR

GROUPS = sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir())


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


@pytest.fixture(scope="module")
def composer():
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        yield lambda overrides=(): compose("config", overrides=list(overrides))


def test_every_group_is_a_field_of_the_root_config():
    assert set(GROUPS) - {"experiment"} <= set(RootConfig.__dataclass_fields__)


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in _options(g)])
def test_every_option_composes_and_validates(composer, group, option):
    cfg = to_config(composer([f"{group}={option}"]))
    assert isinstance(cfg, RootConfig)
    if group == "tracker":
        assert cfg.tracker.kind == option
    if group == "clip":
        assert cfg.clip.kind == option


def test_every_group_instantiates(composer, tmp_path):
    from gradloc_track.clip import build_clipper
    from gradloc_track.demo.model import build_model
    from gradloc_track.spikes import SpikeDetector
    from gradloc_track.trackers import make_tracker

    for model in _options("model"):
        cfg = to_config(composer([f"model={model}", "model.n_layer=1", "model.d_model=16", "model.n_head=2"]))
        m = build_model(cfg.model)
        assert sum(p.numel() for p in m.parameters()) > 0
        for clip in _options("clip"):
            ccfg = to_config(composer([f"clip={clip}"]))
            clipper = build_clipper(ccfg.clip, m)
            assert (clipper is None) == (clip == "none")
            if clipper is not None:
                assert clipper.kind == clip
    det = SpikeDetector(to_config(composer()).spikes)
    assert det.update(0, 1.0, {"h.0": 1.0}) == []
    tracker = make_tracker(to_config(composer(["tracker=none"])).tracker, run_dir=tmp_path)
    tracker.finish("success")


def test_command_line_style_overrides(composer):
    cfg = to_config(composer(["clip=adagc", "clip.beta=0.98", "locate.enabled=false", "locate.method=bisect",
                              "locate.budget=64", "tracker=wandb", "train.steps=7"]))
    assert (cfg.clip.kind, cfg.clip.beta, cfg.locate.enabled, cfg.locate.method, cfg.locate.budget) == \
        ("adagc", 0.98, False, "bisect", 64)
    assert cfg.tracker.kind == "wandb" and cfg.train.steps == 7


@pytest.mark.parametrize("override,field", [
    ("monitor.log_every=-1", "monitor.log_every"),
    ("monitor.log_every=0", "monitor.log_every"),
    ("clip.beta=1.5", "clip.beta"),
    ("clip.lambda_rel=0", "clip.lambda_rel"),
    ("locate.method=magic", "locate.method"),
    ("locate.budget=0", "locate.budget"),
    ("model.d_model=30", "model.d_model"),
    ("train.loss_norm=median", "train.loss_norm"),
    ("spikes.alpha=1.0", "spikes.alpha"),
    ("train.inject.rank=-1", "train.inject.rank"),
])
def test_bad_values_name_the_field(composer, override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        to_config(composer([override]))


def test_unknown_tracker_lists_the_choices(composer):
    from hydra.errors import MissingConfigException

    with pytest.raises(MissingConfigException, match="tracker/foo") as info:
        composer(["tracker=foo"])
    assert "mlflow" in str(info.value) and "wandb" in str(info.value)


def test_wrong_type_fails_at_composition(composer):
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="often") as info:
        composer(["monitor.log_every=often"])
    assert "Integer" in str(info.value.__cause__)
