"""The engine, actor config and rollout batches the verl tests train on: ``examples/verl_grpo.py``'s
own (one copy: the example runs what the tests check)."""
from __future__ import annotations

from tests.examples.load import load_example

_example = load_example("verl_grpo")
B, P, R, GROUP = _example.B, _example.P, _example.R, _example.GROUP
Inject, write_model, build_engine, make_batch = _example.Inject, _example.write_model, _example.build_engine, \
    _example.make_batch
actor_config, ppo_loss_fn, hydra_actor_config, step_metrics = _example.actor_config, _example.ppo_loss_fn, \
    _example.hydra_actor_config, _example.step_metrics
