"""Weights & Biases adapter, following W&B's own conventions.

``WANDB_MODE``/``WANDB_DIR`` are respected when the config leaves ``mode``/``dir`` unset;
``define_metric`` makes every chart use *our* step (``train/step``), so W&B's internal step
never has to be monotonic.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from .._optional import require
from .base import Tracker

STEP_KEY = "train/step"
OWN_PREFIXES = ("grad_norm", "weight_norm", "grad_weight_ratio", "clip", "spike", "spikes", "locate", "adamc")


class WandbTracker(Tracker):
    name = "wandb"

    def __init__(self, project: str = "gradloc-track", entity: str | None = None, tags: Sequence[str] = (),
                 mode: str | None = None, dir: str | None = None, group: str | None = None,
                 run_name: str | None = None, run_dir: str | Path | None = None, run: Any = None,
                 step_key: str = STEP_KEY) -> None:
        """``run`` attaches to a run someone else opened (``wandb.run``, Trainer's, Lightning's):
        log into it at ``step_key`` (their step metric) and leave it open at ``finish()``."""
        self.wandb = require("wandb", "wandb")
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.step_key = step_key
        self._all_rows: dict[str, list[list[Any]]] = {}
        self.attached = run is not None
        if self.attached:
            self.run = run
            # only our own key prefixes: the owner's define_metric("*") setup stays as it is
            self.run.define_metric(step_key)
            for prefix in OWN_PREFIXES:
                self.run.define_metric(f"{prefix}/*", step_metric=step_key)
            return
        wdir = dir or os.environ.get("WANDB_DIR") or (str(self.run_dir) if self.run_dir else None)
        if wdir:
            Path(wdir).mkdir(parents=True, exist_ok=True)
        self.run = self.wandb.init(project=project, entity=entity, tags=list(tags) or None, mode=mode,
                                   dir=wdir, group=group, name=run_name, reinit="create_new")
        self.run.define_metric(STEP_KEY)
        self.run.define_metric("*", step_metric=STEP_KEY)
        self._all_rows: dict[str, list[list[Any]]] = {}

    def _log(self, data: dict[str, Any], step: int | None) -> None:
        if step is not None:
            data = {self.step_key: int(step), **data}
        self.run.log(data)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self._log(dict(metrics), step)

    def log_params(self, params: Mapping[str, Any]) -> None:
        self.run.config.update(dict(params), allow_val_change=True)

    def log_table(self, key, columns, rows, step=None) -> None:
        rows = [list(r) for r in rows]
        cumulative = self._all_rows.setdefault(key, [])
        cumulative.extend(rows)
        # W&B tables are immutable: a per-event table, and the cumulative one re-logged whole
        self._log({key: self.wandb.Table(columns=list(columns), data=rows),
                   f"{key}_all": self.wandb.Table(columns=list(columns), data=list(cumulative))}, step)

    def log_html(self, key, html, step=None) -> None:
        self._log({key: self.wandb.Html(html, inject=False)}, step)

    def log_image(self, key, path, step=None) -> None:
        self._log({key: self.wandb.Image(str(path))}, step)

    def log_artifact(self, path, artifact_path=None) -> None:
        path = Path(path)
        self.run.save(str(path), base_path=str(path.parent), policy="now")

    def set_tags(self, tags: Mapping[str, str]) -> None:
        for k, v in tags.items():
            self.run.summary[k] = v
        self.run.tags = tuple(sorted(set(self.run.tags or ()) | {f"{k}:{v}" for k, v in tags.items()
                                                                  if k != "spike_count"} |
                                     ({"spikes"} if "spike_count" in tags and str(tags["spike_count"]) != "0"
                                      else set())))

    def finish(self, status: str = "success") -> None:
        if self.attached:  # never finish a run we did not open
            return
        self.run.finish(exit_code=0 if status == "success" else 1)
