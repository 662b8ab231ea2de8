"""Backend noise off in our commands (``trackers/quiet.py``): MLflow's store bookkeeping lines and
download bars, never an explicit choice of the user's."""
from __future__ import annotations

import logging
import os

from gradloc_track.trackers.quiet import NOISY_LOGGERS, quiet_backend_noise

BAR = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"


def test_store_lines_and_download_bars_are_turned_off(monkeypatch):
    for name in NOISY_LOGGERS:
        monkeypatch.setattr(logging.getLogger(name), "level", logging.INFO)
    monkeypatch.setenv(BAR, "unset")
    monkeypatch.delenv(BAR)  # (restored to its state after the test)
    quiet_backend_noise()
    assert os.environ[BAR] == "false"
    assert all(logging.getLogger(n).getEffectiveLevel() == logging.WARNING for n in NOISY_LOGGERS)
    assert not logging.getLogger("mlflow.store.db.utils").isEnabledFor(logging.INFO)


def test_an_explicit_progress_bar_setting_is_kept(monkeypatch):
    monkeypatch.setenv(BAR, "true")
    quiet_backend_noise()
    assert os.environ[BAR] == "true"
