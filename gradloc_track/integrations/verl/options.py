"""The ``gradloc`` node of verl's actor config -> our validated options.

``+actor_rollout_ref.actor.gradloc.clip=adagc``, ``...gradloc.locate.enabled=false``,
``...gradloc.spikes.z_thresh=4``: the node holds the groups and fields ``watch()`` takes (``clip``,
``spikes``, ``locate``, ``monitor`` and its fields, ``tracker``, ``run_dir``), GradLoc's own knobs
(``grad_norm_threshold``, ``bisect_budget_steps``, ``bisect_dump_dir``, ``spike_detection``,
turned into ours by ``node.translate_knobs``), validated by the same schemas as the Hydra app;
every error is a ``node.NodeError`` naming the full key (``actor_rollout_ref.actor.gradloc.spikes.z_thres``)
and the fix (``node.py``). ``enabled`` (default true) switches the whole node off without deleting
it. The detector gets the RL defaults of TRL's callback (``integrations/rl_defaults.py``) in every
``spikes`` field the node does not set.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ..options import WatchOptions, resolve_options
from ..rl_defaults import given_spike_fields, rl_spikes
from .node import ENABLED, PREFIX, NodeError, check_keys, located, translate_knobs

NODE = "gradloc"


def as_mapping(node: Any) -> dict | None:
    """The node as a plain dict (a DictConfig, a mapping), None when absent."""
    if node is None:
        return None
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(node, DictConfig):
            return OmegaConf.to_container(node, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf is a core dependency
        pass
    if isinstance(node, Mapping):
        return dict(node)
    if node is True:
        return {}
    raise NodeError(f"{PREFIX} must be a mapping of gradloc-track options (e.g. +{PREFIX}.clip=adagc); "
                    f"got {type(node).__name__}")


def gradloc_options(node: Any) -> WatchOptions | None:
    """Validated options, or None when the node is absent or ``enabled=false``."""
    given = as_mapping(node)
    if given is None:
        return None
    enabled = given.pop(ENABLED, True)
    if not isinstance(enabled, bool):
        raise NodeError(f"{PREFIX}.{ENABLED}={enabled!r} is invalid: use true or false")
    check_keys(given)
    given = translate_knobs(given)
    spikes_given = given_spike_fields(None, given.get("spikes"))
    try:
        opts = resolve_options(**given)
    except (TypeError, ValueError, KeyError) as exc:  # our schemas' sentence, under the key the user typed
        raise located(exc) from exc
    # verl trains RL: the detector gets the RL defaults TRL's callback uses, in every field the node leaves
    opts = dataclasses.replace(opts, spikes=rl_spikes(opts.spikes, spikes_given))
    return opts if enabled else None


def node_of(loss_function: Any) -> Any:
    """The ``gradloc`` node of the actor config a verl loss function was bound to
    (``functools.partial(ppo_loss, config=actor_config)``, as verl's actor worker binds it)."""
    config = getattr(loss_function, "keywords", {}).get("config") if hasattr(loss_function, "keywords") else None
    if config is None:
        return None
    return getattr(config, NODE, None)
