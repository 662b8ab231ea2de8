"""The tracker config (``config/tracker.py``): every wait is one the platform can make."""
from __future__ import annotations

import re
import threading

import pytest

from gradloc_track.config import ConfigError, TrackerConfig

WAITS = ("flush_interval_s", "call_timeout_s", "open_timeout_s", "probe_interval_s", "finish_timeout_s",
         "retry_backoff_s")


@pytest.mark.parametrize("field", WAITS)
def test_a_wait_past_the_platform_maximum_is_rejected_naming_the_field(field):
    limit = re.escape(f"at most {threading.TIMEOUT_MAX:g}")
    with pytest.raises(ConfigError, match=rf"tracker\.{field}=1e\+30 is invalid: .*{limit}"):
        TrackerConfig(**{field: 1e30})
    TrackerConfig(**{field: threading.TIMEOUT_MAX})  # the longest wait there is: accepted


def test_watch_options_get_the_same_error(tiny_gpt):
    import gradloc_track

    with pytest.raises(ConfigError, match=r"tracker\.finish_timeout_s=1e\+30 is invalid"):
        gradloc_track.watch(tiny_gpt, tracker={"kind": "none", "finish_timeout_s": 1e30})
    with pytest.raises(ConfigError, match=r"tracker\.flush_interval_s=1e\+30 is invalid"):
        gradloc_track.watch(tiny_gpt, tracker={"kind": "mlflow", "flush_interval_s": 1e30})
