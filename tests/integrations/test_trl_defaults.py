"""RL-aware detector defaults for TRL's GRPOTrainer: applied to the fields the user left alone."""
from __future__ import annotations

import pytest

from gradloc_track.config import SpikeConfig

pytest.importorskip("trl")

from gradloc_track.integrations.rl_defaults import RL_SPIKES, given_spike_fields, rl_spikes  # noqa: E402


def test_rl_defaults_fill_what_the_user_did_not_set():
    rl = rl_spikes(SpikeConfig(), given_spike_fields(None, None))
    assert (rl.loss_signal, rl.sample_signal, rl.warmup_steps) == (False, False, 20)
    assert (rl.update_signal, rl.noise_floor, rl.per_layer) == (True, 1e-7, True)  # what moves a policy stays
    user = {"warmup_steps": 5, "loss_signal": True}
    mine = rl_spikes(SpikeConfig(**user), given_spike_fields(None, user))
    assert (mine.warmup_steps, mine.loss_signal, mine.sample_signal) == (5, True, False)


def test_a_config_object_or_a_switch_is_read_as_given():
    whole = SpikeConfig(warmup_steps=7)
    assert rl_spikes(whole, given_spike_fields(None, whole)) is whole  # the user's object, left as it is
    assert given_spike_fields(None, True) == frozenset() and given_spike_fields(None, "off") == frozenset()
    assert given_spike_fields({"spikes": {"z_thresh": 5.0}}, None) == {"z_thresh"}  # from cfg=
    off = SpikeConfig(enabled=False)
    assert rl_spikes(off, frozenset()) is off
    assert set(RL_SPIKES) <= {f for f in SpikeConfig.__dataclass_fields__}
