"""MonitorConfig: a bad value names the field, in the schema and as a GradMonitor keyword."""
from __future__ import annotations

import re

import pytest

from gradloc_track import GradMonitor
from gradloc_track.config import ConfigError, MonitorConfig


@pytest.mark.parametrize("kwargs,field", [
    ({"log_every": 0}, "monitor.log_every"),
    ({"log_every": 2.5}, "monitor.log_every"),
    ({"log_every": True}, "monitor.log_every"),
    ({"group_by": "rows"}, "monitor.group_by"),
    ({"per_tensor": "yes"}, "monitor.per_tensor"),
    ({"weight_norms": 1}, "monitor.weight_norms"),
    ({"groups": ["attn"]}, "monitor.groups"),
    ({"groups": {"attention": "(unclosed"}}, "monitor.groups.attention"),
    ({"groups": {"a/b": "attn"}}, "monitor.groups"),
    ({"groups": {"global": "attn"}}, "monitor.groups"),
])
def test_bad_config_values_name_the_field(tiny_gpt, kwargs, field):
    with pytest.raises(ConfigError, match=re.escape(field)):
        MonitorConfig(**kwargs)
    with pytest.raises(ConfigError, match=re.escape(field)):
        GradMonitor(tiny_gpt, **kwargs)
