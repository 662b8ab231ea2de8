"""Every config group composes with Hydra and instantiates; bad values fail naming the field."""
from __future__ import annotations

import re

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
    ("spikes.ratio_thresh=-1", "spikes.ratio_thresh"),
    ("spikes.score_window=0", "spikes.score_window"),
    ("spikes.z_thresh=0", "spikes.z_thresh"),
    ("spikes.mode=fixed", "spikes.per_token_threshold"),
    ("model.n_head=0", "model.n_head"),
    ("model.dropout=1.0", "model.dropout"),
    ("model.max_seq_len=0", "model.max_seq_len"),
    ("optim.betas=[0.9,1.5]", "optim.betas[1]"),
    ("optim.min_lr_ratio=2", "optim.min_lr_ratio"),
    ("tracker.queue_size=0", "tracker.queue_size"),
    ("tracker.retry_backoff_s=-1", "tracker.retry_backoff_s"),
    ("tracker.mlflow.experiment_name=''", "tracker.mlflow.experiment_name"),
    ("tracker.wandb.mode=sometimes", "tracker.wandb.mode"),
    ("train.batch_size=0", "train.batch_size"),
    ("train.num_threads=0", "train.num_threads"),
    ("train.device=gpu0", "train.device"),
    ("train.corpus=/nonexistent/corpus.txt", "train.corpus"),
    ("train.seq_len=4096", "train.seq_len"),
    ("train.inject.span=0", "train.inject.span"),
    ("train.inject.sample=99", "train.inject.sample"),
    ("out_dir=''", "out_dir"),
    ("train.inject.rank=-1", "train.inject.rank"),
])
def test_bad_values_name_the_field(composer, override, field):
    with pytest.raises(ConfigError, match=re.escape(field)):
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


@pytest.mark.parametrize("override,named", [
    ("+monitor.log_evry=5", "monitor.log_evry (did you mean monitor.log_every?)"),
    ("+unknown_key=1", "unknown_key"),
    ("+train.inject.stpe=3", "train.inject.stpe (did you mean train.inject.step?)"),
    ("+spikes.z_threshold=4", "spikes.z_threshold (did you mean spikes.z_thresh?)"),
])
def test_unknown_keys_are_rejected_naming_the_key(composer, override, named):
    """``+key=value`` opens the structured config; validation then refuses keys no field reads."""
    with pytest.raises(ConfigError, match="unknown config key") as info:
        to_config(composer([override]))
    assert named in str(info.value)


def test_free_form_mappings_still_take_new_keys(composer):
    cfg = to_config(composer(["+monitor.groups.attention=attn", "+tracker.mlflow.tags.team=infra"]))
    assert cfg.monitor.groups == {"attention": "attn"} and cfg.tracker.mlflow.tags == {"team": "infra"}


@pytest.mark.parametrize("group", ["tracker", "monitor", "clip", "spikes", "locate", "model", "optim"])
def test_schema_is_not_a_choice(composer, group):
    from hydra.errors import MissingConfigException

    with pytest.raises(MissingConfigException, match=f"{group}/schema"):
        composer([f"{group}=schema"])


def test_python_callers_get_type_errors_naming_the_field():
    from gradloc_track.config import ModelConfig, MonitorConfig, TrackerConfig, TrainConfig

    for build, field in [(lambda: TrackerConfig(queue_size="10"), "tracker.queue_size"),
                         (lambda: TrainConfig(steps=2.5), "train.steps"),
                         (lambda: ModelConfig(n_head=None), "model.n_head"),
                         (lambda: MonitorConfig(per_tensor="yes"), "monitor.per_tensor")]:
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            build()
