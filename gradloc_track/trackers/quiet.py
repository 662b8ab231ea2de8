"""Backend noise off in OUR commands (``gradloc-track``, the example apps), and only there.

MLflow prints "Creating initial MLflow database tables..." / "Updating database tables" (INFO, its
``mlflow.store.db.utils`` logger) when a run opens a new SQLite store, and a progress bar per
artifact download (``gradloc-track report``). A command of ours owns its process, so it turns
those two off; a library call (``watch()``) leaves the user's logging and environment alone.
An explicit ``MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR`` in the environment is kept.
"""
from __future__ import annotations

import logging
import os

#: MLflow's loggers whose INFO lines are store bookkeeping, not the user's business
NOISY_LOGGERS = ("mlflow.store.db.utils",)


def quiet_backend_noise() -> None:
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
