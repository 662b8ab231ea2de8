"""``integrations/verl/plugin.py``: switched on from verl's own Hydra config, inert without the node."""
from __future__ import annotations

from .requires import verl  # noqa: F401  (first: the module is skipped where verl is missing)

import warnings

import pytest


def test_verl_loads_the_plugin_on_import():
    assert verl.__version__  # imported (``requires``): verl loaded its verl.plugins entry points then
    from verl.workers.engine.base import BaseEngine

    from gradloc_track.integrations.verl.plugin import PATCHED

    assert getattr(BaseEngine.train_batch, PATCHED, False)


def test_verls_config_carries_the_node_validated_by_our_schemas():
    from .engine_setup import hydra_actor_config

    cfg = hydra_actor_config(["+actor_rollout_ref.actor.gradloc.clip=adagc",
                              "+actor_rollout_ref.actor.gradloc.locate.enabled=false"])
    assert cfg.gradloc == {"clip": "adagc", "locate": {"enabled": False}}
    assert hydra_actor_config([]).gradloc is None  # no node: verl's config as it was
    with pytest.raises(Exception, match=r"actor_rollout_ref.actor.gradloc.clip.kind='adagcc' is invalid"):
        hydra_actor_config(["+actor_rollout_ref.actor.gradloc.clip=adagcc"])


@pytest.mark.parametrize("override, text", [
    ("spikes.z_thres=4", "actor_rollout_ref.actor.gradloc.spikes.z_thres is not a gradloc-track option (did you "
                         "mean actor_rollout_ref.actor.gradloc.spikes.z_thresh?): valid names under"),
    ("run_dir=7", "actor_rollout_ref.actor.gradloc.run_dir=7 is invalid: use a directory path"),
])
def test_verls_hydra_error_carries_the_full_key(override, text):
    """Through verl's own config conversion (in its driver at start-up): Hydra's wrapper holds our
    sentence, with the full key the user typed."""
    from .engine_setup import hydra_actor_config

    with pytest.raises(Exception) as exc:
        hydra_actor_config([f"+actor_rollout_ref.actor.gradloc.{override}"])
    assert text in str(exc.value), str(exc.value)


def test_gradlocs_own_knobs_pass_verls_config():
    from .engine_setup import hydra_actor_config

    cfg = hydra_actor_config(["+actor_rollout_ref.actor.gradloc.grad_norm_threshold=640.0",
                              "+actor_rollout_ref.actor.gradloc.bisect_budget_steps=128",
                              "+actor_rollout_ref.actor.gradloc.bisect_dump_dir=dump"])
    assert cfg.gradloc == {"grad_norm_threshold": 640.0, "bisect_budget_steps": 128, "bisect_dump_dir": "dump"}


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
    assert r["session"] and r["clip"] == "adagc" and r["recordings"] == 1
    assert {"grad_norm", "grad_norm/global", "clip/total_norm_pre", "actor/pg_loss"} <= set(r["keys"])


def test_with_the_detector_off_the_session_records_no_micro_batch(verl_unit):
    """``spikes.enabled=false``: nothing reads verl's micro-batches, so none is recorded (nor its RNG state); the
    norms and the clipping are still logged."""
    r = verl_unit["route_spikes_off"]
    assert r["session"] and r["recordings"] == 0
    assert {"grad_norm", "grad_norm/global", "clip/total_norm_pre", "actor/pg_loss"} <= set(r["keys"])
