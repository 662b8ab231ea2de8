"""``integrations/verl/plugin.py``: switched on from verl's own Hydra config, inert without the node."""
from __future__ import annotations

import warnings

import pytest


def test_verl_loads_the_plugin_on_import():
    import verl  # noqa: F401  (loads the verl.plugins entry points)
    from verl.workers.engine.base import BaseEngine

    from gradloc_track.integrations.verl.plugin import PATCHED

    assert getattr(BaseEngine.train_batch, PATCHED, False)


def test_verls_config_carries_the_node_validated_by_our_schemas():
    from .engine_setup import hydra_actor_config

    cfg = hydra_actor_config(["+actor_rollout_ref.actor.gradloc.clip=adagc",
                              "+actor_rollout_ref.actor.gradloc.locate.enabled=false"])
    assert cfg.gradloc == {"clip": "adagc", "locate": {"enabled": False}}
    assert hydra_actor_config([]).gradloc is None  # no node: verl's config as it was
    with pytest.raises(Exception, match=r"clip.kind='adagcc' is invalid"):
        hydra_actor_config(["+actor_rollout_ref.actor.gradloc.clip=adagcc"])


def test_an_engine_without_the_node_trains_as_verl_does():
    from functools import partial

    from verl.workers.engine.base import BaseEngine

    from gradloc_track.integrations.verl.plugin import session_for

    class Other(BaseEngine):
        pass

    cfg = type("Cfg", (), {"gradloc": None})()
    assert session_for(Other(), partial(print, config=cfg)) is None
    cfg.gradloc = {"clip": "adagc"}
    with pytest.warns(UserWarning, match="not verl's FSDP engine"):
        assert session_for(Other(), partial(print, config=cfg)) is None
    engine = Other()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        session_for(engine, partial(print, config=cfg))
    assert session_for(engine, partial(print, config=cfg)) is None  # decided once per engine, silently


def test_the_node_routes_verls_train_batch_through_a_session(verl_unit):
    r = verl_unit["route"]
    assert r["session"] and r["clip"] == "adagc"
    assert {"grad_norm", "grad_norm/global", "clip/total_norm_pre", "actor/pg_loss"} <= set(r["keys"])
