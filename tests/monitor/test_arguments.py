"""GradMonitor's constructor arguments: a wrong kind of object fails at construction naming the
argument and the fix; configs given as dicts or schemas are converted."""
from __future__ import annotations

import re

import pytest
import torch

from gradloc_track import GradMonitor, MemoryTracker
from gradloc_track.clip import AdaGC
from gradloc_track.config import ConfigError, LocateConfig, MonitorConfig, SpikeConfig
from gradloc_track.spikes import SpikeDetector


def test_bad_arguments_raise_clear_type_errors(tiny_gpt):
    with pytest.raises(TypeError, match="log_evry"):
        GradMonitor(tiny_gpt, log_evry=2)
    with pytest.raises(TypeError, match="not both"):
        GradMonitor(tiny_gpt, config=MonitorConfig(), log_every=2)
    with pytest.raises(TypeError, match="MonitorConfig"):
        GradMonitor(tiny_gpt, config={"log_every": 2})
    with pytest.raises(ValueError, match="requires_grad"):
        GradMonitor(torch.nn.Linear(2, 2).requires_grad_(False))
    clashing = torch.nn.ModuleDict({"global": torch.nn.Linear(2, 2)})  # module layer "global"
    with pytest.raises(ValueError, match="monitor.groups"):
        GradMonitor(clashing, group_by="module")


@pytest.mark.parametrize("kwargs,message", [
    ({"tracker": "mlflow"}, r"tracker='mlflow'.*make_tracker\(TrackerConfig\(kind='mlflow'\)\)"),
    ({"tracker": MemoryTracker}, r"tracker=MemoryTracker.*class.*instance"),
    ({"tracker": 3}, r"tracker=.*int.*log_metrics"),
    ({"clipper": AdaGC}, r"clipper=AdaGC.*class.*AdaGC\(model\)"),
    ({"clipper": "adagc"}, r"clipper=.*str.*clip\(\)"),
    ({"detector": SpikeDetector}, r"detector=SpikeDetector.*class.*instance"),
    ({"detector": "adaptive"}, r"detector=.*str.*update\(\)"),
    ({"optimizer": torch.optim.AdamW}, r"optimizer=.*class AdamW.*Optimizer"),
    ({"locate_config": "bisect"}, r"locate_config=.*str.*LocateConfig"),
    ({"locate_config": {"budjet": 8}}, r"locate_config=.*budjet"),
    ({"artifact_writer": object()}, r"artifact_writer=.*write\(\)"),
])
def test_wrong_arguments_fail_at_construction_naming_the_argument(tiny_gpt, kwargs, message):
    with pytest.raises(TypeError, match=message):
        GradMonitor(tiny_gpt, **kwargs)


def test_model_must_be_a_module():
    with pytest.raises(TypeError, match=r"model=.*torch\.nn\.Module"):
        GradMonitor([torch.nn.Parameter(torch.ones(2))])


def test_a_locate_config_dict_is_converted_and_checked_at_construction(tiny_gpt):
    mon = GradMonitor(tiny_gpt, locate_config={"method": "bisect", "budget": 32})
    assert isinstance(mon.locate_config, LocateConfig) and mon.locate_config.budget == 32
    with pytest.raises(ConfigError, match=re.escape("locate.budget")):
        GradMonitor(tiny_gpt, locate_config={"budget": 0})


def test_a_spike_config_becomes_its_detector(tiny_gpt):
    mon = GradMonitor(tiny_gpt, detector=SpikeConfig(warmup_steps=3))
    assert isinstance(mon.detector, SpikeDetector) and mon.detector.config.warmup_steps == 3
    assert GradMonitor(tiny_gpt, detector=SpikeConfig(enabled=False)).detector is None


def test_wrong_call_arguments_fail_at_the_first_step_naming_them(tiny_gpt):
    """A step that is not an int, a ``loss_fn`` passed as ``spike_context`` (it failed only at the first spike,
    inside training, with 'missing 1 required positional argument'), ``watch(optimizer, model)`` (an
    AttributeError about forward hooks): each says the argument and the fix (held-out tester round 8)."""
    import numpy as np

    import gradloc_track
    from gradloc_track.spikes import SpikeContext

    mon = GradMonitor(tiny_gpt, detector=SpikeConfig(warmup_steps=3))
    tiny_gpt(torch.randint(0, 64, (2, 8))).sum().backward()
    with pytest.raises(TypeError, match=r"after_backward\(step=\.\.\.\): step must be an int.*'3'"):
        mon.after_backward("3")
    with pytest.raises(TypeError, match=r"spike_context=.*takes arguments.*SpikeContext\(loss_fn="):
        mon.after_backward(1, spike_context=lambda keep: keep.sum())
    with pytest.raises(TypeError, match=r"spike_context=.*got a dict.*SpikeContext"):
        mon.after_backward(2, spike_context={"loss_fn": None})
    assert mon.after_backward(np.int64(3)).step == 3  # a numpy integer is a step
    mask = torch.ones(2, 8)
    assert mon.after_backward(4, spike_context=lambda: SpikeContext(lambda keep: keep.sum(), mask)).step == 4
    opt = torch.optim.AdamW(tiny_gpt.parameters())
    with pytest.raises(TypeError, match=r"model is a AdamW.*the model comes first: watch\(model, optimizer\)"):
        gradloc_track.watch(opt, tiny_gpt, tracker="none")


@pytest.mark.parametrize("columns,message", [
    ({"sample_columns": {"share": [1, 2]}}, r"sample column 'share' would shadow.*'user_share'"),
    ({"sample_columns": {"sample": torch.zeros(2)}}, r"sample column 'sample' would shadow.*'user_sample'"),
    ({"sample_columns": {"reward": torch.zeros(3)}}, r"sample_columns\['reward'\]: one value per sample, 2.*got 3"),
    ({"extra_columns": {"advantage": torch.zeros(2)}},
     r"extra_columns\['advantage'\]: one value per position, shape \(2, 8\).*got \(2,\).*sample_columns"),
])
def test_a_spike_contexts_columns_are_checked_where_they_are_given(columns, message):
    """A column that shadows the table's own, or whose shape is not the batch's, was dropped or left null in the
    table without a word (held-out tester round 8): refused at once, naming the column and the fix."""
    from gradloc_track.spikes import SpikeContext

    with pytest.raises((TypeError, ValueError), match=message):
        SpikeContext(lambda keep: keep.sum(), torch.ones(2, 8), **columns)
    ok = SpikeContext(lambda keep: keep.sum(), torch.ones(2, 8), sample_columns={"reward": [1.0, 2.0]},
                      extra_columns={"advantage": torch.zeros(2, 8)})
    assert set(ok.sample_columns) == {"reward"} and set(ok.extra_columns) == {"advantage"}
    micro = SpikeContext([lambda keep: keep.sum()] * 2, [torch.ones(2, 8), torch.ones(3, 8)],
                         sample_columns={"reward": [[1.0, 2.0], None]})
    assert micro.micro_batches == 2
    with pytest.raises(ValueError, match=r"sample_columns\['reward'\] of micro-batch 1: one value per sample, 3"):
        SpikeContext([lambda keep: keep.sum()] * 2, [torch.ones(2, 8), torch.ones(3, 8)],
                     sample_columns={"reward": [[1.0, 2.0], [1.0]]})
