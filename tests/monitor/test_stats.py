"""``monitor/stats.GradStats``: per-tensor, per-layer and global norms from the squared norms, checked
against a plain loop (``math.sqrt`` of sums); values already on the host are used as they are; the
device ones are moved in ONE transfer, only when a float view is first read."""
from __future__ import annotations

import math

import pytest
import torch

from gradloc_track.grouping import LayerGrouping
from gradloc_track.monitor.stats import GradStats

from .test_packing import spy  # noqa: F401  (fixture: counts tolist/cpu/numpy calls)

NAMES = ["h.0.attn.weight", "h.0.mlp.weight", "h.1.attn.weight", "lm_head.weight"]
SQ = [4.0, 5.0, 9.0, 0.25]


def stats(**kw) -> GradStats:
    return GradStats(3, LayerGrouping.build(NAMES), torch.tensor(SQ), logged=False, **kw)


def test_norms_match_a_plain_loop():
    s = stats()
    assert s.grad_norms == pytest.approx({n: math.sqrt(v) for n, v in zip(NAMES, SQ)}, rel=1e-6)
    layers: dict[str, float] = {}
    for n, v in zip(NAMES, SQ):
        layer = n.split(".")[0] if not n.startswith("h.") else ".".join(n.split(".")[:2])
        layers[layer] = layers.get(layer, 0.0) + v
    assert s.layer_norms == pytest.approx({k: math.sqrt(v) for k, v in layers.items()}, rel=1e-6)
    assert list(s.layer_norms) == ["h.0", "h.1", "lm_head"]  # first-seen order
    assert s.global_norm == pytest.approx(math.sqrt(sum(SQ)), rel=1e-6)


def test_nothing_moves_until_a_float_view_is_read_then_once(spy):  # noqa: F811
    s = stats()
    assert "not synced" in repr(s) and s.sq_norms is s._grad_sq and spy.calls == []  # the device tensor: no sync
    s.grad_norms
    s.layer_norms
    s.global_norm
    assert spy.calls == ["tolist"] and "values on host" in repr(s)


def test_host_values_of_a_syncing_step_are_used_as_they_are(spy):  # noqa: F811
    host = {"global": 1.0, "tensor": [0.1, 0.2, 0.3, 0.4], "layer": [5.0, 6.0, 7.0]}
    s = stats(host=host, metrics={"grad_norm/global": 1.0})
    assert s.global_norm == 1.0 and s.grad_norms == dict(zip(NAMES, host["tensor"]))
    assert s.layer_norms == {"h.0": 5.0, "h.1": 6.0, "lm_head": 7.0} and spy.calls == []
    assert s.metrics == {"grad_norm/global": 1.0}


def test_a_fresh_stats_holds_nothing_else_yet():
    s = stats()
    assert (s.step, s.logged, s.metrics, s.clip, s.events, s.locate, s.locate_view, s.not_localized, s.surgery) == \
        (3, False, {}, None, [], None, None, None, None)
    assert stats().metrics is not s.metrics  # never a shared default


def test_non_finite_norms_stay_non_finite():
    s = GradStats(0, LayerGrouping.build(["a.w", "b.w"]), torch.tensor([float("inf"), 1.0]), logged=False)
    assert math.isinf(s.global_norm) and math.isinf(s.layer_norms["a"]) and s.layer_norms["b"] == 1.0


@pytest.mark.parametrize("cause,found,blamed", [
    (dict(name="data", detail="1 culprit(s) (sample 3) carry 90%"), None, [2, 3]),
    (dict(name="numeric", detail="sample 3's loss is Inf"), "samples", [3]),  # the batch made the NaN: its rows only
    (dict(name="numeric", detail="the loss is non-finite but no loss term is"), "none named", None),
    (dict(name="numeric", detail="the step's grad_norm/global = nan"), "replay", None),  # a finite replay's rows
    (dict(name="numeric", detail="the step's grad_norm/global = nan"), None, None),
    # a garbage batch inside a recovery: its own evidence named it data
    (dict(name="schedule", detail="aftermath of step 250 (schedule): ...", aftermath_of=250, own="data"), None,
     [2, 3]),
    # a step of a recovery whose own culprits carry too little (review of 4186cbd: quarantined at 18%)
    (dict(name="data", detail="aftermath of step 100 (data): ...", aftermath_of=100, own="unexplained"), None, None),
    (dict(name="irreproducible", detail="the step does not reproduce"), "replay", None),  # stop 56's NaN multiplier
    (dict(name="schedule", detail="the learning rate rose 30x"), None, None),
    (dict(name="loss_scale", detail="the loss was multiplied by 100"), None, None),
    (dict(name="unexplained", detail="only 20%"), None, None),
])
def test_a_quarantine_blames_the_rows_of_a_step_the_data_made(cause, found, blamed):
    """``blamed_rows``: the culprit rows when the step's rows are the data's fault (held-out tester, stop 56: a NaN
    multiplier's step, ``irreproducible``, quarantined the replay's four clean rows); of a ``numeric`` step only
    the rows the non-finite search named (review of 5b633b9: the finite largest rows beside them went too)."""
    import dataclasses
    from types import SimpleNamespace

    from gradloc_track.monitor.outcome import SpikeOutcome, data_fault
    from gradloc_track.spikes.cause import Cause

    @dataclasses.dataclass
    class Located:
        culprits: list
        nonfinite: object = None

    finding = None if found is None else SimpleNamespace(where="samples" if found == "none named" else found,
                                                         samples=() if found == "none named" else (3,))
    located = Located([SimpleNamespace(batch=2, nonfinite=False), SimpleNamespace(batch=3, nonfinite=True)], finding)
    s = stats(outcome=SpikeOutcome(3, (), Cause(**cause), locate=located, culprit_rows=(located, "context")))
    got = s.blamed_rows
    assert (None if got is None else [c.batch for c in got[0].culprits]) == blamed and (got is None or
                                                                                      got[1] == "context")
    if cause["name"] == "unexplained" or cause.get("own") == "unexplained":
        assert data_fault(Cause(**cause), located) is None  # weak evidence: the ledger adds it up, no quarantine
    assert stats(outcome=SpikeOutcome(3, (), Cause("data", "x"))).blamed_rows is None  # not localized: nothing
