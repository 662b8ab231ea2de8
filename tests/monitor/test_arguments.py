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
