"""The writer's sizes and waits (``trackers/async_writer/settings.py``): read from a ``TrackerConfig``,
every wait clamped to one a lock can make."""
from __future__ import annotations

import threading
from dataclasses import fields

from gradloc_track.config import TrackerConfig
from gradloc_track.trackers.async_writer import WriterSettings


def test_settings_read_the_tracker_config_and_keep_their_own_defaults():
    cfg = TrackerConfig(flush_interval_s=2.5, queue_size=7, retries=0, finish_timeout_s=9.0)
    s = WriterSettings.from_config(cfg)
    assert (s.flush_interval_s, s.queue_size, s.retries, s.finish_timeout_s) == (2.5, 7, 0, 9.0)
    assert s.put_timeout_s == WriterSettings().put_timeout_s  # not a TrackerConfig field


def test_a_writer_made_directly_has_the_config_defaults():
    """``WriterSettings()`` (a direct caller's) and ``TrackerConfig()`` (Hydra's) write the same defaults down
    twice: they must agree, field by field (conf/tracker YAML is checked against the dataclass elsewhere)."""
    shared = [f.name for f in fields(WriterSettings) if hasattr(TrackerConfig, f.name)]
    assert len(shared) == len(fields(WriterSettings)) - 1  # all but put_timeout_s
    assert {n: getattr(WriterSettings(), n) for n in shared} == {n: getattr(TrackerConfig(), n) for n in shared}


def test_every_wait_is_one_a_lock_can_make():
    s = WriterSettings(flush_interval_s=1e30, call_timeout_s=float("nan"), put_timeout_s=-1.0)
    assert s.flush_interval_s == s.call_timeout_s == threading.TIMEOUT_MAX and s.put_timeout_s == 0.0
