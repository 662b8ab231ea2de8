"""``monitor/param_set.ParamSet``: which tensors are monitored (the trainable ones, in
``named_parameters`` order), their metric keys, a rescan when ``requires_grad`` flips (a failed one
changes nothing), and how the clipper's tensors map onto them (each index checked by hand)."""
from __future__ import annotations

import logging

import pytest
import torch

from gradloc_track.config.monitor import MonitorConfig
from gradloc_track.monitor.param_set import ParamSet


class Clipper:
    """A clipper as the monitor sees it: ``names`` of its tensors, and ``clip(sq_norms=None)``."""

    def __init__(self, names):
        self.names, self.calls = list(names), []

    def clip(self, sq_norms=None):
        self.calls.append(sq_norms)
        return "clipped"


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))


def make(m=None, clipper=None, **cfg):
    warned = []
    ps = ParamSet(m or model(), MonitorConfig(**cfg), clipper, lambda key, msg: warned.append((key, msg)))
    return ps, warned


def test_the_trainable_parameters_their_layers_and_keys():
    m = model()
    m[0].bias.requires_grad_(False)
    ps, warned = make(m)
    assert ps.names == ["0.weight", "2.weight", "2.bias"] and ps.params == [m[0].weight, m[2].weight, m[2].bias]
    assert ps.grouping.layers == ["0", "2"] and ps.grouping.index == [0, 1, 1]
    assert ps.layer_keys == ["grad_norm/0", "grad_norm/2"]
    assert ps.tensor_keys == ["grad_norm/tensor/0.weight", "grad_norm/tensor/2.weight", "grad_norm/tensor/2.bias"]
    assert ps.weight_keys == ["weight_norm/global", "weight_norm/0", "weight_norm/2"]
    assert ps.ratio_keys == ["grad_weight_ratio/0", "grad_weight_ratio/2"]
    assert ps.clip_index is None and ps.clip_grouping is ps.grouping and warned == []


def test_grouping_follows_the_config():
    ps, _ = make(group_by="tensor")
    assert ps.grouping.layers == ps.names
    ps, _ = make(groups={"first": r"^0\."})
    assert ps.grouping.layers == ["first", "2"]


def test_a_model_with_nothing_to_train_is_refused():
    m = model().requires_grad_(False)
    with pytest.raises(ValueError, match="no parameters with requires_grad=True"):
        make(m)


def test_a_layer_named_like_a_global_key_is_refused():
    m = torch.nn.Module()
    m.nonfinite = torch.nn.Linear(2, 2)  # grad_norm/nonfinite is the count of non-finite gradients
    with pytest.raises(ValueError, match=r"layer name\(s\) \['nonfinite'\] would clash.*monitor.groups"):
        make(m)
    ps, _ = make(m, groups={"head": "nonfinite"})  # renamed: fine
    assert ps.grouping.layers == ["head"]


def test_a_flipped_flag_is_seen_and_the_rescan_picks_it_up(caplog):
    m = model()
    m[2].requires_grad_(False)
    ps, _ = make(m)
    assert ps.names == ["0.weight", "0.bias"] and not ps.changed()
    m[2].weight.requires_grad_(True)
    assert ps.changed()
    with caplog.at_level(logging.INFO, logger="gradloc_track.monitor.param_set"):
        ps.rescan(7)
        assert ps.names == ["0.weight", "0.bias", "2.weight"] and not ps.changed()
        assert "step 7: now monitoring 1 newly trainable parameter(s) ['2.weight']" in caplog.text
        m[0].requires_grad_(False)
        ps.rescan(8)
    assert ps.names == ["2.weight"] and "no longer monitoring ['0.bias', '0.weight']" in caplog.text


def test_a_rescan_with_everything_frozen_keeps_the_last_set_and_looks_again_later():
    m = model()
    ps, _ = make(m)
    before = (list(ps.names), ps.grouping, list(ps.layer_keys))
    m.requires_grad_(False)
    ps.rescan(3)
    assert (ps.names, ps.grouping, ps.layer_keys) == before and not ps.changed()  # not rescanned every step
    m[0].weight.requires_grad_(True)
    assert ps.changed()
    ps.rescan(4)
    assert ps.names == ["0.weight"]


def test_a_clipper_over_the_same_tensors_gets_the_norms_as_they_are():
    clipper = Clipper(["0.weight", "0.bias", "2.weight", "2.bias"])
    ps, _ = make(clipper=clipper)
    sq = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert ps.clip_index is None and ps.clip(sq) == "clipped" and clipper.calls[-1] is sq


def test_a_clipper_over_a_subset_gets_its_own_tensors_norms_in_its_order_and_a_warning():
    clipper = Clipper(["2.weight", "0.weight"])  # built while the biases were frozen
    ps, warned = make(clipper=clipper)
    assert ps.clip_index == [2, 0]
    ps.clip(torch.tensor([10.0, 20.0, 30.0, 40.0]))
    assert clipper.calls[-1].tolist() == [30.0, 10.0]
    assert [k for k, _ in warned] == ["unclipped"] and "['0.bias', '2.bias'] are monitored but not clipped" in \
        warned[0][1] and "Build the clipper (or watch()) again" in warned[0][1]
    assert ps.clip_grouping.names == ["2.weight", "0.weight"]  # clip metrics grouped over ITS tensors
    index_t = ps._clip_index_t
    ps.clip(torch.zeros(4))
    assert ps._clip_index_t is index_t  # the device index is made once


def test_a_clipper_holding_tensors_the_monitor_does_not_computes_its_own_norms():
    clipper = Clipper(["0.weight", "elsewhere.weight"])
    ps, warned = make(clipper=clipper)
    assert ps.clip_index == "own"
    assert ps.clip(torch.zeros(4)) == "clipped" and clipper.calls[-1] is None
    assert warned and "'0.bias'" in warned[0][1]


def test_no_clipper_no_clip():
    ps, _ = make()
    assert ps.clip(torch.zeros(4)) is None


def test_a_parameter_added_mid_run_is_seen_and_monitored_and_another_models_is_not_a_change():
    """``model.scale = nn.Parameter(...)`` after the monitor was built: never monitored, the logged global norm
    left it out, and a clipper's localizations then failed their coefficient count (held-out tester round 10).
    A parameter registered on another model changes nothing here."""
    m = model()
    ps, _ = make(m)
    torch.nn.Linear(2, 2)  # another module's parameters: looked at, not a change
    assert not ps.changed()
    m.scale = torch.nn.Parameter(torch.ones(1))
    assert ps.changed()
    ps.rescan(20)
    assert ps.names == ["scale", "0.weight", "0.bias", "2.weight", "2.bias"] and not ps.changed()  # named_parameters'
    assert ps.names == [n for n, _ in m.named_parameters()]
