"""RL-aware defaults of the spike detector, for TRL's ``GRPOTrainer`` and verl (issue 26, item 5).

Policy-gradient training is not language modelling, and 0.3's defaults, made for the latter, fired
on a converged tiny policy 14 times in 25 steps, each a real rare token that harmed nothing, and on
groups of identical completions whose gradients cancel ("436.8x its running mean 1.74e-10" on a
norm of 7.6e-8). What changes, for every field the user did not set:

- ``loss_signal=False``: GRPO's loss is an advantage-weighted sum that is near zero and changes sign
  by design; it says nothing about the data (the detector takes only positive losses anyway);
- ``sample_signal=False``: likewise per completion;
- ``junk_signal=False``: the completions are the policy's own samples, not data from outside; a run of
  tokens it rates below chance is its own exploration, which the norms and the update judge;
- ``warmup_steps=20``: an RL run starts from a trained policy, without the wild first steps of
  pretraining that the language-model default (50) waits out;
- ``update_ratio_thresh=None``: the optimizer's update of a policy swings 2-4x on clean steps (spike zoo,
  TRL family: 3.83x on a converged policy), so the update fires on its z-score alone.

Kept: the gradient norms and the optimizer's update (the policy moves when they jump), and the noise
floor: a gradient below ``noise_floor`` x the parameter norm is float rounding (cancelling groups),
neither an event nor part of the statistics, so the steps after it are judged on real gradients.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from ..config import SpikeConfig

RL_SPIKES = {"loss_signal": False, "sample_signal": False, "junk_signal": False, "warmup_steps": 20,
             "update_ratio_thresh": None}


def given_spike_fields(cfg: Any, value: Any) -> frozenset[str] | None:
    """The ``spikes`` fields the user set: ``value`` is the callback's ``spikes=`` argument, ``cfg`` its
    ``cfg=``. None: all of them (a ``SpikeConfig`` object given whole is the user's choice, left as it is)."""
    if value is None and cfg is not None:
        value = cfg.get("spikes") if hasattr(cfg, "get") else getattr(cfg, "spikes", None)
    if value is None or isinstance(value, (bool, str)):
        return frozenset()
    if isinstance(value, SpikeConfig):
        return None
    if hasattr(value, "keys"):
        return frozenset(str(k) for k in value.keys())
    return None


def rl_spikes(spikes: SpikeConfig, given: frozenset[str] | None) -> SpikeConfig:
    """``spikes`` with the RL defaults in every field the user did not set."""
    if given is None or not spikes.enabled:
        return spikes
    return dataclasses.replace(spikes, **{k: v for k, v in RL_SPIKES.items() if k not in given})
