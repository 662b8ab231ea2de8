"""``<run dir>/tracker/<backend>.json``: which backend run a run directory belongs to.

One record per backend run, rewritten atomically, read by ``replay``, the report and the console:

- ``spec``: how to open the run, written when the tracker is built;
- ``run``: how to find it again (e.g. the MLflow run id), once it exists (``replay`` continues the
  ORIGINAL run instead of opening a new one);
- ``status``: its final status, once delivered;
- ``view``: where a person finds it, written by the adapter as soon as the run exists, so
  ``gradloc-track report <run dir>`` and the console follow the directory to the run::

    {"mlflow": {"tracking_uri": ..., "experiment_id": ..., "run_id": ..., "run_name": ...},
     "wandb": {"dir": <the offline-run-* / run-* folder>, "path": "entity/project/run_id", ...}}

Never raises into training: a run without a record still trains. A record that cannot be written
(a full disk) is kept in memory, merged into the next write of it, and the run dir marked
incomplete until one goes through (``incomplete``).
"""
from __future__ import annotations

import json
import os
import threading
import warnings
from pathlib import Path
from typing import Any

from .files import atomic_write_json
from .incomplete import writes_of
from .spool import encode

_lock = threading.Lock()
_kept: dict[tuple[str, str], dict[str, Any]] = {}  # (run dir, backend) -> a record not yet written whole


def record_path(run_dir: str | Path, backend: str) -> Path:
    return Path(run_dir) / "tracker" / f"{backend}.json"


def read_backend_record(run_dir: str | Path, backend: str) -> dict[str, Any]:
    """The whole record of ``backend``'s run (``spec``, ``run``, ``status``, ``view``); ``{}`` when none."""
    path = record_path(run_dir, backend)
    try:
        rec = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return rec if isinstance(rec, dict) else {}  # valid JSON but no record (``[1, 2]``, ``null``): none


def unreadable_records(run_dir: str | Path) -> dict[str, str]:
    """``{backend: why}`` for each ``tracker/<backend>.json`` of ``run_dir`` that exists but cannot be read (not
    JSON: a write cut short; not an object), e.g. ``tracker/mlflow.json is not valid JSON (...)``. The readers
    above take such a record for none; the CLI must not (held-out tester, stop 54: a truncated record made
    ``report`` say the run 'logged no spike events' while its MLflow run held one)."""
    folder = Path(run_dir) / "tracker"
    out: dict[str, str] = {}
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        name = f"tracker/{path.name}"
        try:
            rec = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as exc:
            out[path.stem] = f"{name} is not valid JSON ({exc})"
            continue
        except OSError as exc:
            out[path.stem] = f"{name} cannot be read ({exc.strerror or exc})"
            continue
        if not isinstance(rec, dict):
            out[path.stem] = f"{name} is not a run record (a {type(rec).__name__}, not an object)"
    return out


def update_run_record(run_dir: str | Path, backend: str, **fields: Any) -> bool:
    """Merge ``fields`` into the record (atomic rewrite); ``False`` when the run dir is not writable."""
    key = (os.path.abspath(run_dir), backend)
    with _lock:
        rec = _kept.pop(key, None) or read_backend_record(run_dir, backend)
        rec.update(encode(fields))
        rec["backend"] = backend
        what = str(Path("tracker") / f"{backend}.json")
        try:
            atomic_write_json(record_path(run_dir, backend), rec)
        except OSError as exc:
            _kept[key] = rec
            writes_of(run_dir).failed(what, exc, kept=True)
            return False
        writes_of(run_dir).written(what)
        return True


def record_run(run_dir: str | Path | None, backend: str, info: dict[str, Any]) -> None:
    """Record where ``backend``'s run is, as its ``view`` (no-op without a run dir)."""
    if run_dir is None:
        return
    if not update_run_record(run_dir, backend, view={k: v for k, v in info.items() if v is not None}):
        warnings.warn(f"gradloc-track: could not record the {backend} run in {record_path(run_dir, backend)}")


def read_run_views(run_dir: str | Path) -> dict[str, Any]:
    """``{backend: view}`` (where each backend run of ``run_dir`` is); ``{}`` when there is none."""
    folder = Path(run_dir) / "tracker"
    out: dict[str, Any] = {}
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            rec = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict) and isinstance(rec.get("view"), dict):
            out[path.stem] = rec["view"]
    return out
