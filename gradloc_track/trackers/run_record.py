"""``<run dir>/tracker/<backend>.json``: which backend run this run directory belongs to.

Written when the tracker is built (how to open the run: ``spec``), updated once the backend run
exists (``run``: e.g. the MLflow run id) and when its final status is known. ``replay`` reads it
to continue the ORIGINAL run instead of opening a new one.
"""
from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from .files import atomic_write_json
from .spool import encode

_lock = threading.Lock()


def record_path(run_dir: str | Path, backend: str) -> Path:
    return Path(run_dir) / "tracker" / f"{backend}.json"


def read_run_record(run_dir: str | Path, backend: str) -> dict[str, Any]:
    path = record_path(run_dir, backend)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def update_run_record(run_dir: str | Path, backend: str, **fields: Any) -> bool:
    """Merge ``fields`` into the record (atomic rewrite); ``False`` when the run dir is not writable."""
    with _lock:
        rec = read_run_record(run_dir, backend)
        rec.update(encode(fields))
        rec["backend"] = backend
        try:
            atomic_write_json(record_path(run_dir, backend), rec)
        except OSError:
            return False
        return True
