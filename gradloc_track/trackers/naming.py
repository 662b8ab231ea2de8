"""Metric/param key names and value normalisation shared by trackers."""
from __future__ import annotations

import re

_MLFLOW_BAD = re.compile(r"[^\w\-. /]")

#: the tracker keys the spike artifacts are logged under (``artifacts/``): one name for the writer and every reader
#: (the report, the ledger, the run page's story, the backends' readers)
EVENTS_KEY = "spikes/events"  # one row per detected spike
TABLE_KEY = "spikes/tokens"  # one row per culprit: the attribution table
HTML_KEY = "spikes/highlight"  # the highlighted text
IMAGE_KEY = "spikes/heatmap"  # the per-layer heatmap

#: one run of ours logging to two backends (``tracker=both``) gives both backend runs one identity: an MLflow tag, and
#: ``same_run`` in the W&B run's ``RUN_FILE``; ``run:<it>`` is then an identity of each (``run_dirs.run_keys``), so the
#: ledger counts such a run once by its MLflow run and a W&B folder kept outside its run dir (``WANDB_DIR``)
SAME_RUN_TAG = "gradloc.same_run"
SAME_RUN_KEY = "run:"
#: our file in a W&B run's files (read offline, where W&B keeps the run's config and tags in its binary log only):
#: ``same_run`` (above) and ``params``, what the run logged with ``log_params`` (``spikes.enabled``: the report and
#: the ledger tell a run without a spike detector from a clean one by its W&B folder alone)
RUN_FILE = "gradloc-run.json"

#: metric logged once a tracker can write again: how many records it LOST for good until then
DROPPED_KEY = "tracker/dropped"
#: the ``spike_count`` tag of a run without a spike detector: it looked for none (0 would read as a clean run)
SPIKE_COUNT_OFF = "off"
#: what the report and the ledger say of a run without spike events whose detector was off
DETECTION_OFF = "its spike detector was off (spikes=False, spikes.enabled=false): no spike was looked for"


def mlflow_key(key: str) -> str:
    """MLflow accepts alphanumerics, ``_ - . /`` and spaces; anything else becomes ``_``. It also
    refuses a name that reads as another path (``eval//loss``, ``loss/``, ``a/./b``), and with it the
    whole batch the name is in: each empty, ``.`` or ``..`` segment becomes ``_``."""
    key = _MLFLOW_BAD.sub("_", key)
    return "/".join("_" if part in ("", ".", "..") else part for part in key.split("/"))


_CUT = "...[truncated]"


def truncate(value: object, limit: int) -> str:
    """Stringify and cut to at most ``limit`` characters, marking the cut so nobody mistakes it for data."""
    s = str(value)
    return s if len(s) <= limit else (s[: max(limit - len(_CUT), 0)] + _CUT)[:limit]


def step_path(key: str, step: int | None, ext: str) -> str:
    """``<key>/step_<step:06d>.<ext>`` (the artifact layout contract in ``base.Tracker``)."""
    return f"{key}/step_{(step or 0):06d}.{ext}"


def table_part_path(key: str, step: int | None) -> str:
    """``<key>/step_<step:06d>.json``: one never-rewritten part of table ``key`` per event."""
    return step_path(key, step, "json")
