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


@pytest.mark.parametrize("node, error, text", [
    ({"clip": "adagcc"}, ConfigError, "clip.kind"),
    ({"spikes": {"z_thresh": -1}}, ConfigError, "spikes.z_thresh"),
    ({"clp": "adagc"}, TypeError, "unknown option(s) ['clp']"),
    ({"enabled": "yes"}, ValueError, "gradloc.enabled"),
])
def test_bad_values_fail_naming_the_field(node, error, text):
    with pytest.raises(error, match=None) as exc:
        gradloc_options(node)
    assert text in str(exc.value)


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
