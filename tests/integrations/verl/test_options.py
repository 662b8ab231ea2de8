"""``integrations/verl/options.py``: the ``gradloc`` node -> validated options, the app's errors."""
from __future__ import annotations

from .requires import verl  # noqa: F401  (first: the module is skipped where verl is missing)

from functools import partial
from types import SimpleNamespace

import pytest

from gradloc_track.config import ConfigError
from gradloc_track.integrations.verl.options import gradloc_options, node_of


def test_the_node_gives_the_apps_options():
    from omegaconf import OmegaConf

    opts = gradloc_options(OmegaConf.create({"clip": "adagc", "locate": {"enabled": False}, "log_every": 5}))
    assert opts.clip.kind == "adagc" and opts.locate.enabled is False and opts.monitor.log_every == 5


def test_enabled_false_and_absent_switch_it_off():
    assert gradloc_options(None) is None
    assert gradloc_options({"enabled": False, "clip": "zclip"}) is None


FULL = "actor_rollout_ref.actor.gradloc"


@pytest.mark.parametrize("node, text", [
    ({"clip": "adagcc"}, f"{FULL}.clip.kind='adagcc' is invalid: use one of 'none', 'global'"),
    ({"spikes": {"z_thresh": -1}}, f"{FULL}.spikes.z_thresh=-1.0 is invalid"),
    ({"spikes": {"z_thresh": "abc"}}, f"{FULL}.spikes.z_thresh is invalid: Value 'abc'"),
    ({"clp": "adagc"}, f"{FULL}.clp is not a gradloc-track option (did you mean {FULL}.clip?)"),
    ({"enabled": "yes"}, f"{FULL}.enabled='yes' is invalid"),
    ({"tracker": {"kind": "mlflw"}}, f"{FULL}.tracker.kind='mlflw' is invalid"),
])
def test_bad_values_fail_naming_the_full_key(node, text):
    with pytest.raises(ConfigError) as exc:
        gradloc_options(node)
    assert str(exc.value).startswith(text), str(exc.value)


@pytest.mark.parametrize("node, key, valid", [
    ({"spikes": {"z_thres": 4}}, "spikes.z_thres", ("z_thresh", "warmup_steps", "per_token_threshold")),
    ({"clip": {"kind": "adagc", "betta": 0.9}}, "clip.betta", ("beta", "lambda_rel")),  # the option's own fields
    ({"monitor": {"log_evry": 3}}, "monitor.log_evry", ("log_every", "group_by")),
    ({"grad_norm_thresh": 640}, "grad_norm_thresh", ("grad_norm_threshold", "spikes", "run_dir")),
])
def test_a_nested_typo_names_its_full_key_and_the_valid_names_there(node, key, valid):
    with pytest.raises(ConfigError) as exc:
        gradloc_options(node)
    text = str(exc.value)
    where = f"{FULL}.{key.rsplit('.', 1)[0]}" if "." in key else FULL
    assert text.startswith(f"{FULL}.{key} is not a gradloc-track option (did you mean {where}.{valid[0]}?)"), text
    listed = text.split(f"valid names under {where} are ")[1].split(", ")
    assert set(valid) <= set(listed), listed


@pytest.mark.parametrize("key", ["run_dir", "run_name", "bisect_dump_dir"])
def test_run_dir_7_is_refused(key):
    """Issue 40: Hydra reads ``gradloc.run_dir=7`` as the integer 7; the node wants a path."""
    with pytest.raises(ConfigError) as exc:
        gradloc_options({key: 7})
    assert str(exc.value).startswith(f"{FULL}.{key}=7 is invalid: use a") and f'{key}=\"7\"' in str(exc.value)
    assert gradloc_options({key: "7"}) is not None  # quoted: the string "7"


def test_gradlocs_knobs_are_taken_with_gradlocs_meaning():
    opts = gradloc_options({"grad_norm_threshold": 640, "bisect_budget_steps": 64, "bisect_dump_dir": "dump",
                            "spike_detection": True})
    assert (opts.spikes.mode, opts.spikes.per_token_threshold) == ("fixed", 640.0)  # GradLoc's trigger
    assert opts.locate.budget == 64 and opts.run_dir == "dump" and opts.spikes.enabled
    assert gradloc_options({"spike_detection": False}).spikes.enabled is False
    # the same value through both names is fine; two values name both
    assert gradloc_options({"bisect_budget_steps": 32, "locate": {"budget": 32}}).locate.budget == 32
    with pytest.raises(ConfigError, match=r"gradloc.grad_norm_threshold=640.0 \(GradLoc's knob\) and "
                                          r".*gradloc.spikes.per_token_threshold=100 disagree"):
        gradloc_options({"grad_norm_threshold": 640, "spikes": {"per_token_threshold": 100}})
    with pytest.raises(ConfigError, match=r"gradloc.bisect_budget_steps=12.5 is invalid: use a positive whole"):
        gradloc_options({"bisect_budget_steps": 12.5})


def test_the_node_is_read_from_the_config_verl_binds_to_its_loss():
    cfg = SimpleNamespace(gradloc={"clip": "adagc"})
    assert node_of(partial(lambda **k: None, config=cfg)) == {"clip": "adagc"}
    assert node_of(lambda **k: None) is None


def test_the_detector_gets_the_rl_defaults_where_the_node_leaves_them():
    from gradloc_track.integrations.rl_defaults import RL_SPIKES

    opts = gradloc_options({"clip": "none"})
    assert {k: getattr(opts.spikes, k) for k in RL_SPIKES} == RL_SPIKES
    opts = gradloc_options({"spikes": {"warmup_steps": 7, "loss_signal": True}})
    assert opts.spikes.warmup_steps == 7 and opts.spikes.loss_signal  # the user's own values stay
    assert opts.spikes.sample_signal is False and opts.spikes.update_ratio_thresh is None
