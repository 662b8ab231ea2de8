"""A key typo on the command line without ``+`` (``config/override_keys.py``): the same "did you
mean" as with ``+``, before Hydra's own error; every key Hydra composes passes; what only the
selected option decides is left to Hydra."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from gradloc_track.config import ConfigError, check_overrides, to_config
from gradloc_track.config.override_keys import check_override_keys
from gradloc_track.demo.config import DemoConfig

from ..conftest import CONF_DIR


@pytest.mark.parametrize("key,named", [
    ("monitor.log_evry", "monitor.log_evry (did you mean monitor.log_every?)"),
    ("train.inject.stpe", "train.inject.stpe (did you mean train.inject.step?)"),
    ("spikes.z_threshold", "spikes.z_threshold (did you mean spikes.z_thresh?)"),
    ("tracker.mlflow.trackng_uri", "tracker.mlflow.trackng_uri (did you mean tracker.mlflow.tracking_uri?)"),
    ("run_nam", "run_nam (did you mean run_name?)"),
])
def test_a_typo_without_plus_gets_the_same_hint_as_with_it(composer, key, named):
    with pytest.raises(ConfigError, match="unknown config key") as plain:
        check_overrides([f"{key}=5"], DemoConfig, CONF_DIR)
    with pytest.raises(ConfigError, match="unknown config key") as plus:
        to_config(composer([f"+{key}=5"]))
    assert named in str(plain.value) and named in str(plus.value)


def test_a_clip_key_no_option_has_names_the_closest_of_all_options():
    with pytest.raises(ConfigError, match=r"clip\.bta \(did you mean clip\.beta\?\)"):
        check_overrides(["clip=adagc", "clip.bta=0.9"], DemoConfig, CONF_DIR)


@pytest.mark.parametrize("choices", [["clip=adagc"], ["clip=zclip"], ["clip=layerclip", "model=small"],
                                     ["experiment=spike_demo", "tracker=both"]])
def test_every_key_hydra_composes_passes(composer, choices):
    """The oracle is Hydra: every leaf key of a composed config, overridden without ``+``."""
    cfg = OmegaConf.to_container(composer(choices), resolve=False)

    def leaves(node, path=""):
        for k, v in node.items():
            if isinstance(v, dict) and v:
                yield from leaves(v, f"{path}{k}.")
            else:
                yield f"{path}{k}"

    keys = list(leaves(cfg))
    assert len(keys) > 40 and "clip.kind" in keys and "tracker.mlflow.tracking_uri" in keys
    check_override_keys(choices + [f"{k}=1" for k in keys], DemoConfig, CONF_DIR)


def test_what_hydra_or_to_config_decide_is_left_to_them():
    check_override_keys([
        "clip.beta=0.9",  # AdaGC's field, no option picked here: the experiment's may have it (Hydra knows)
        "monitor.groups.attn=h.*.attn",  # a mapping takes any key
        "+monitor.log_evry=5", "++x=1", "~spikes",  # to_config checks what + adds
        "hydra.run.dir=/tmp/x", "hydra/launcher=basic", "-m", "--cfg", "experiment=spike_demo",
        "clip.beta=0.9,0.99",  # a sweep
    ], DemoConfig, CONF_DIR)
    check_overrides(["monitor.log_evry=5"])  # no schema given: renamed keys only (the old behaviour)


def test_a_field_of_another_option_than_the_one_picked_names_the_options_that_have_it():
    """clip=zclip clip.lambda_rel=1.1: Hydra said "Key 'lambda_rel' not in 'ZClipConfig'" and suggested
    +clip.lambda_rel, which fails again (held-out tester)."""
    for order in (["clip=zclip", "clip.lambda_rel=1.1"], ["clip.lambda_rel=1.1", "clip=zclip"]):
        with pytest.raises(ConfigError, match=r"clip\.lambda_rel \(clip=zclip has no field 'lambda_rel'; it is a "
                                              r"field of clip=adagc: pick that option or drop the key\)"):
            check_overrides(order, DemoConfig, CONF_DIR)
    check_override_keys(["clip=adagc", "clip.lambda_rel=1.1"], DemoConfig, CONF_DIR)  # its own field
    check_override_keys(["clip=zclip,adagc", "clip.lambda_rel=1.1"], DemoConfig, CONF_DIR)  # a sweep: Hydra's


def test_a_field_of_another_option_than_the_default_or_the_experiments_names_the_options_that_have_it(composer):
    """New-user tester round 12: with clip= not on the command line (the default clip=none, or the AdaGC
    experiment=spike_demo picks), a field of another option got Hydra's "Could not override 'clip.max_norm'
    ... use +clip.max_norm=1.0", whose advice fails again. The oracle for the option in force is Hydra."""
    assert composer([]).clip.kind == "none" and composer(["experiment=spike_demo"]).clip.kind == "adagc"
    with pytest.raises(ConfigError, match=r"clip\.max_norm \(clip=none, the default, has no field 'max_norm'; it "
                                          r"is a field of clip=global: pick that option"):
        check_overrides(["clip.max_norm=1.0"], DemoConfig, CONF_DIR)
    with pytest.raises(ConfigError, match=r"clip\.z_thresh \(clip=adagc, experiment=spike_demo picks it, has no "
                                          r"field 'z_thresh'; it is a field of clip=layerclip, clip=zclip"):
        check_overrides(["experiment=spike_demo", "clip.z_thresh=3"], DemoConfig, CONF_DIR)
    check_override_keys(["experiment=spike_demo", "clip.beta=0.9"], DemoConfig, CONF_DIR)  # AdaGC's own field
    check_override_keys(["clip=zclip", "clip.z_thresh=3"], DemoConfig, CONF_DIR)  # the line's pick wins


@pytest.mark.parametrize("override, says", [
    ("locate=false", "locate=false: locate is a config group (options: default), not a switch; to turn it off "
                     "use locate.enabled=false"),
    ("spikes=off", "spikes=off: spikes is a config group (options: default), not a switch; to turn it off "
                   "use spikes.enabled=false"),
    ("clip=zclp", "clip=zclp: no such option of config group clip (did you mean clip=zclip?)"),
    ("clip=none,zclp", "clip=zclp: no such option"),
])
def test_a_group_given_a_value_that_is_none_of_its_options_names_the_fix(override, says):
    """``locate=false`` (the natural guess from ``watch(locate=False)``) was a 25-line Hydra traceback."""
    with pytest.raises(ConfigError) as err:
        check_overrides([override], DemoConfig, CONF_DIR)
    assert says in str(err.value)


def test_every_groups_own_options_and_null_pass():
    check_overrides(["clip=none", "tracker=none", "locate=default", "experiment=spike_demo", "experiment=null",
                     "clip=none,global,zclip", "model=glob(*)"], DemoConfig, CONF_DIR)


def test_an_experiment_in_the_users_config_dir_is_an_option(tmp_path):
    """Held-out tester, stop 55: ``--config-dir my_conf experiment=fast`` (Hydra's way to add your own experiment
    file) was refused as "no such option of config group experiment"; a typo there still names both folders'."""
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "fast.yaml").write_text("# @package _global_\ntrain:\n  steps: 5\n")
    for flags in (["--config-dir", str(tmp_path)], [f"--config-dir={tmp_path}"], ["-cd", str(tmp_path)]):
        check_overrides(["-m", *flags, "experiment=fast", "clip=adagc,zclip"], DemoConfig, CONF_DIR)
    with pytest.raises(ConfigError, match=r"did you mean experiment=fast\?\); its options: clip_compare, fast, "
                                          r"spike_demo"):
        check_overrides(["--config-dir", str(tmp_path), "experiment=fats"], DemoConfig, CONF_DIR)
    with pytest.raises(ConfigError, match="no such option of config group experiment"):
        check_overrides(["experiment=fast"], DemoConfig, CONF_DIR)  # without the folder it is none
    check_overrides(["--config-path", str(tmp_path), "experiment=fast"], DemoConfig, CONF_DIR)  # not our groups
    check_overrides(["--config-di", str(tmp_path), "experiment=fast"], DemoConfig, CONF_DIR)  # Hydra's abbreviation


def test_an_experiment_in_both_folders_is_read_where_hydra_reads_it(tmp_path):
    """Review, stop 55: Hydra's search path puts --config-dir AFTER the app's conf/, so for a name in both the
    app's file is the one composed (spike_demo: clip=adagc), and clip.beta, AdaGC's, is a key it holds."""
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "spike_demo.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /clip: zclip\n")
    check_overrides(["--config-dir", str(tmp_path), "experiment=spike_demo", "clip.beta=0.9"], DemoConfig, CONF_DIR)


def test_the_pre_check_prints_nothing_of_hydras_own(capsys):
    """Review, stop 55: parsing the line with Hydra's parser printed `--version` and a bad flag's usage once
    more, before Hydra printed them itself."""
    check_overrides(["--version"], DemoConfig, CONF_DIR)
    check_overrides(["--config-dir"], DemoConfig, CONF_DIR)  # no value: Hydra's error, once, later
    assert capsys.readouterr() == ("", "")
