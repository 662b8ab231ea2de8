"""Weights & Biases as a backend entry (the adapter is ``trackers.wandb_tracker``, a user's own run
joined in shared rows ``trackers.wandb_shared``).

A run is ``wandb:<run id>``; its files are a run folder (``offline-run-<time>-<id>`` / ``run-<time>-<id>``,
holding ``files/``), itself a run dir; the report reads its media (tables, HTML, images) there. W&B
marks a run whose process died as crashed by itself.
"""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from ..naming import RUN_FILE, SAME_RUN_KEY
from .base import Backend, RunFiles, SpikeReader

# (a run resumed within the second its first folder was made gets ``-1`` after the id: review, stop 64)
WANDB_RUN = re.compile(r"^(?:offline-)?run-\d{8}_\d{6}-([A-Za-z0-9]+)(?:-\d+)?$")
WANDB_MEDIA = re.compile(r"_(\d+)_[0-9a-f]+\.(?:html|png)$")
WANDB_TABLE = re.compile(r"_(\d+)_[0-9a-f]+\.table\.json$")
TITLE = re.compile(rb"<title>spike at step (\d+)</title>")
LOGIN_WORDS = ("api key", "api_key", "wandb login", "usageerror", "authenticationerror", "not logged in")


def needs_login(error: str) -> bool:
    """Whether a W&B failure is "no login": W&B's UsageError/AuthenticationError about the API key."""
    text = error.lower()
    return any(w in text for w in LOGIN_WORDS)


def is_wandb_run(path: Path) -> bool:
    return WANDB_RUN.match(path.name) is not None and (path / "files").is_dir()


def wandb_run_id(folder: Path, where: dict[str, Any] | None = None) -> str | None:
    """A W&B run's id: from its run folder's name, else from the record (``path`` ends with it)."""
    m = WANDB_RUN.match(folder.name)
    if m:
        return m.group(1)
    where = where or {}
    if where.get("run_id"):
        return str(where["run_id"])
    return str(where["path"]).rsplit("/", 1)[-1] if where.get("path") else None


def _run_notes(folder: Path) -> dict[str, Any]:
    """Our ``naming.RUN_FILE`` in a W&B run folder's files ({} for another folder, or a missing or damaged file)."""
    if not is_wandb_run(folder):
        return {}
    try:
        notes = json.loads((folder / "files" / RUN_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return notes if isinstance(notes, dict) else {}


def wandb_files(folder: Path, run_id: str | None = None) -> Path | None:
    """The ``files/`` of a W&B run folder (``offline-run-*``/``run-*``), or of the one under ``folder``
    (``folder/wandb/*run-*``, ``folder/*run-*``) with this ``run_id`` (without one: the latest)."""
    if (folder / "files" / "media").is_dir():
        return folder / "files"
    runs = sorted(folder.glob("wandb/*run-*/files")) + sorted(folder.glob("*run-*/files"))
    runs = [r for r in runs if (r / "media").is_dir() and (run_id is None or r.parent.name.endswith(f"-{run_id}"))]
    return runs[-1] if runs else None


def _media_step(p: Path) -> int:
    m = WANDB_MEDIA.search(p.name)
    return int(m.group(1)) if m else -1


def _table_step(p: Path) -> tuple[int, str]:
    m = WANDB_TABLE.search(p.name)
    return (int(m.group(1)) if m else -1, p.name)


def wandb_tables(media: Path, kind: str) -> list[Path]:
    """A W&B run's files of table ``spikes/<kind>`` (``kind``: tokens | events): its cumulative
    ``<key>_all`` table (logged once, at ``finish``), else (a run that never finished) each event's,
    in step order. Never "the largest file": one event's table can outnumber a cumulative one whose
    damaged rows were left out."""
    tables = [t for t in (media / "table").rglob("*.table.json") if kind in t.name]
    if kind == "tokens":
        tables = [t for t in tables if "events" not in t.name]
    whole = [t for t in tables if f"{kind}_all_" in t.name]
    return sorted(whole, key=_table_step)[-1:] if whole else sorted(tables, key=_table_step)


class WandbMedia(SpikeReader):
    """A W&B run folder's ``files/media``: tables, HTML pages (their step from the page's title, else
    the file name) and images (logged in the same order as the pages)."""

    def __init__(self, files: Path) -> None:
        self.media = files / "media"
        self._order: list[int] = []

    def tables(self, kind):
        return [(t.name, t.read_bytes()) for t in wandb_tables(self.media, kind)]

    def pages(self):
        pages: dict[int, bytes] = {}
        self._order = []
        for p in sorted((self.media / "html").rglob("*.html"), key=_media_step):
            doc = p.read_bytes()
            m = TITLE.search(doc)
            step = int(m.group(1)) if m else _media_step(p)
            pages[step] = doc
            self._order.append(step)
        return pages

    def images(self):
        if not self._order:
            self.pages()
        pngs = sorted((self.media / "images").rglob("*.png"), key=_media_step)
        return {step: p.read_bytes() for step, p in zip(self._order, pngs)}  # logged in the same order


def _files_dir(place: Any) -> str | None:
    """Where W&B's own files go when ``tracker.wandb.dir`` is unset: ``WANDB_DIR``, else the run dir when it is
    the user's; a scratch run dir is removed when the run ends, and with it an offline run W&B tells the user to
    ``wandb sync``: then W&B's default, ``./wandb``, as a plain ``wandb.init`` puts it."""
    if place.kept is not None:
        return None  # the adapter's own fallback: WANDB_DIR, else the run dir
    return os.environ.get("WANDB_DIR") or os.getcwd()


class WandbBackend(Backend):
    name = "wandb"
    title = "W&B"
    rank = 1

    def open(self, cfg, place, run_name, on_open):
        from ..async_writer import AsyncTracker
        from ..async_writer.opener import OpenGate
        from ..wandb_tracker import WandbTracker

        w = cfg.wandb
        spec = {"project": w.project, "entity": w.entity, "tags": list(w.tags), "mode": w.mode,
                "dir": w.dir or _files_dir(place), "group": w.group, "run_name": run_name}
        if place.same_run:
            spec["same_run"] = place.same_run
        gate, run_dir = OpenGate(), place.path
        return AsyncTracker.from_config(cfg, self.name, lambda: WandbTracker(**spec, run_dir=run_dir, cancel=gate),
                                        run_dir, spec, gate, place.owner, on_open)

    def open_in_process(self) -> Any:
        wandb = sys.modules.get("wandb")
        return getattr(wandb, "run", None) if wandb is not None else None

    def from_lightning(self, logger: Any) -> Any:
        return logger.experiment if type(logger).__name__ == "WandbLogger" else None

    def join(self, found, step_key, cfg, run_dir, owner, on_open):
        """Log into the W&B run object ``found`` at ``step_key`` (a framework's step metric); ``step_key=None``:
        the user's own run, joined in shared-row mode (W&B's step stays theirs; metrics logged on the
        training thread, the rest through the background writer)."""
        from ..async_writer import AsyncTracker
        from ..wandb_shared import SharedRunTracker
        from ..wandb_tracker import WandbTracker

        adapter = WandbTracker(run=found, step_key=step_key or "", shared_rows=step_key is None,
                               run_dir=run_dir)  # define_metric now, in order; records the run
        writer = AsyncTracker.from_config(cfg, self.name, lambda: adapter, run_dir,
                                          {"project": getattr(found, "project", None),
                                           "entity": getattr(found, "entity", None), "joined": True},
                                          owner=owner, on_open=on_open)
        return writer if step_key is not None else SharedRunTracker(adapter, writer)

    def resume(self, run_dir, run, spec, tracking_uri):
        from ..wandb_tracker import WandbTracker

        if run.get("run_id"):
            return WandbTracker.resume(run["run_id"], **{k: v for k, v in run.items() if k != "run_id"},
                                       run_dir=run_dir, same_run=(spec or {}).get("same_run"))
        return WandbTracker(**spec, run_dir=run_dir)

    def is_run_folder(self, path):
        return is_wandb_run(path)

    def run_id(self, run_dir, where):
        wid = wandb_run_id(run_dir, where)
        return f"wandb:{wid}" if wid else None

    def same_run(self, folder):
        same = _run_notes(folder).get("same_run")
        return SAME_RUN_KEY + same if isinstance(same, str) and same else None

    def run_params(self, folder):
        params = _run_notes(folder).get("params")
        return params if isinstance(params, dict) else {}

    def report_files(self, run_dir, where, tracking_uri):
        where = where or {}
        wid = wandb_run_id(run_dir, where)
        folders = ([Path(where["dir"])] if where.get("dir") else []) + [run_dir]  # W&B's, else under the run dir
        files = next((f for f in (wandb_files(d, wid) for d in folders) if f is not None), None)
        if files is None:
            return None
        wid = wandb_run_id(files.parent, where)
        return RunFiles(files, where.get("run_name") or files.parent.name, self.link(where),
                        run_id=f"wandb:{wid}" if wid else str(files.parent.resolve()), reader=WandbMedia(files))

    def link(self, where):
        return where.get("url") if not where.get("offline") else None

    def where(self, view, page):
        place = f" (offline: {view.get('dir')})" if view.get("offline") else f": {view.get('url')}"
        return [f"W&B run {view.get('path')}{place}"]

    def commands(self, view):
        if view.get("offline"):
            return [f"  wandb sync {view.get('dir')}    # upload the offline W&B run"]
        return []

    def closing_hint(self, run_dir, error):
        if not (error and needs_login(error)):
            return None
        return ["    wandb login                        # or set WANDB_API_KEY",
                f"    gradloc-track replay {run_dir}",
                "  or try W&B without an account: run with WANDB_MODE=offline (tracker.wandb.mode=offline),",
                "  then upload the wandb/offline-run-* folder it prints with `wandb sync <folder>`"]
