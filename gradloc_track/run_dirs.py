"""What a run directory is, where the run dirs under a folder are, and which run each one is.

A run dir is the folder one run of ours writes; the apps print it (``run dir: ...``, ``local files:
<run dir>/spikes``, a W&B run folder to ``wandb sync``). It holds at least one of

- ``spikes/``: the shared file layout (``tracker=none``, or a tracker's local copy);
- ``tracker/<backend>.json``: the record of the MLflow or W&B run it logged to (``trackers/run_record``):
  its ``view`` once the run exists, its ``run`` reference (the run id) from the moment a run was
  opened or joined;
- ``metrics.jsonl``: a ``tracker=none`` run's metrics;
- ``INCOMPLETE``: some of its writes failed (a full disk; ``trackers.incomplete``), perhaps all of them;

or it is a folder of a backend's own that its entry calls a run dir (``Backend.is_run_folder``: a W&B
run folder, ``offline-run-<time>-<id>`` holding ``files/``; a TensorBoard log dir).
``gradloc-track report`` and ``culprits`` accept any of them, and ``spikes/`` or ``rendered/`` of one;
``culprits`` also searches a folder for the run dirs under it.

A run's identity (``run_key``) is the run it logged to, never its folder's name: the first backend's
(``Backend.run_id``, registry order: the MLflow run id, ``wandb:<run id>``), else the run dir's
resolved path (two sweeps' ``0_clip=adagc`` are two runs).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .trackers.backends import BACKENDS
from .trackers.run_record import read_backend_record

MARKERS = ("spikes", "tracker", "metrics.jsonl", "INCOMPLETE")
PARTS = ("spikes", "rendered")  # folders of a run dir the apps print
WHAT = ("a run dir is the folder the app printed ('run dir: ...'; it holds spikes/, tracker/<backend>.json or "
        "metrics.jsonl), or a W&B run folder (wandb/offline-run-*)")
MAX_DEPTH = 12  # how deep culprits looks for run dirs under a folder
OUTER_DEPTH = 3  # how far up a backend's run folder looks for the run dir of ours it sits in


def is_run_dir(path: Path) -> bool:
    """Whether ``path`` is a run dir (see the module doc)."""
    return path.is_dir() and (any((path / m).exists() for m in MARKERS) or
                              any(b.is_run_folder(path) for b in BACKENDS.values()))


def run_dir_of(path: Path) -> Path | None:
    """The run dir ``path`` is, or whose ``spikes/``/``rendered/`` it is; None otherwise."""
    if is_run_dir(path):
        return path
    if path.name in PARTS and is_run_dir(path.parent):
        return path.parent
    return None


def find_run_dirs(folder: Path) -> list[Path]:
    """Every run dir under ``folder`` (not inside another run dir; hidden folders skipped), sorted."""
    found: list[Path] = []

    def walk(d: Path, depth: int) -> None:
        try:
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError:
            return
        for e in entries:
            if e.name.startswith(".") or not e.is_dir(follow_symlinks=False):
                continue
            sub = Path(e.path)
            if is_run_dir(sub):
                found.append(sub)
            elif depth < MAX_DEPTH:
                walk(sub, depth + 1)

    walk(folder, 0)
    return found


def run_locations(run_dir: Path) -> dict[str, dict[str, Any]]:
    """``{backend: where}`` for each backend run of ``run_dir``: its ``view``, else (a run that was
    joined, or never got as far as its view) its ``run`` reference: the run id and where it lives."""
    out: dict[str, dict[str, Any]] = {}
    folder = run_dir / "tracker"
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        rec = read_backend_record(run_dir, path.stem)
        view, ref = rec.get("view"), rec.get("run")
        if isinstance(view, dict) and view:
            out[path.stem] = view
        elif isinstance(ref, dict) and ref.get("run_id"):
            out[path.stem] = {k: v for k, v in ref.items() if v is not None}
    return out


def detection_was_off(run_dir: Path) -> bool:
    """Did the run in ``run_dir`` run without a spike detector? Its ``params.json`` (``spikes.enabled``: a run with
    ``tracker=none``), the params a backend's own run folder recorded (a W&B folder: ``Backend.run_params``) or the
    demo's ``config.yaml`` says so; False when none does (held-out tester, stop 63: such a run read as one that logged
    no spike events)."""
    try:
        params = json.loads((run_dir / "params.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        params = None
    for got in (params, *(b.run_params(run_dir) for b in BACKENDS.values())):
        if isinstance(got, dict) and got.get("spikes.enabled") in (False, "False", "false"):
            return True
    try:
        text = (run_dir / "config.yaml").read_text(encoding="utf-8")
    except OSError:
        return False
    import yaml  # (omegaconf's; only for a run dir that has no spike events)

    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError:
        return False
    spikes = config.get("spikes") if isinstance(config, dict) else None
    return isinstance(spikes, dict) and spikes.get("enabled") is False


def run_key(run_dir: Path, where: dict[str, dict[str, Any]] | None = None) -> str:
    """The identity of the run a run dir holds (see the module doc); ``where``: its ``run_locations``."""
    where = run_locations(run_dir) if where is None else where
    return next((k for name, b in BACKENDS.items() if (k := b.run_id(run_dir, where.get(name)))),
                None) or str(run_dir.resolve())


def run_keys(run_dir: Path, where: dict[str, dict[str, Any]] | None = None) -> list[str]:
    """Every identity of the run a run dir holds, ``run_key`` first: each backend run it logged to (``tracker=both``:
    an MLflow run and a W&B run, one training run), then its resolved path; for a W&B folder, the identity it shares
    with its MLflow sibling (``naming.SAME_RUN_KEY``: the pair counts once wherever W&B kept its folder); for a
    backend's own folder inside one of our run dirs (``<run dir>/wandb/offline-run-*``) that recorded its run, that run
    dir's too. The ledger counts a run once whichever of them it is given by (held-out tester, stop 63: the run dir and
    its W&B folder were two)."""
    where = run_locations(run_dir) if where is None else where
    keys = [k for name, b in BACKENDS.items() if (k := b.run_id(run_dir, where.get(name)))]
    path = run_dir.resolve()
    keys.append(str(path))
    keys += [k for b in BACKENDS.values() if (k := b.same_run(run_dir))]  # a W&B folder: its MLflow sibling's too
    if any((run_dir / m).exists() for m in MARKERS[:2]):  # one of ours (``spikes/``, ``tracker/``): no walk up
        return keys
    for outer in list(path.parents)[:OUTER_DEPTH]:
        if (outer / "tracker").is_dir():  # a run dir of ours that recorded this folder's run: the same run
            outer_keys = run_keys(outer)
            if keys[0] in outer_keys:
                return keys + outer_keys
    return keys
