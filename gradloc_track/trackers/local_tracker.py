"""Writes the shared file layout into the run directory (``tracker=none`` with a run dir).

Also the spool's replay target and what ``gradloc-track report`` reads for runs logged nowhere.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Mapping

from .base import Tracker
from .keys import step_path


class LocalTracker(Tracker):
    name = "local"

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._metrics = open(self.run_dir / "metrics.jsonl", "a", encoding="utf-8")
        self._params: dict[str, Any] = {}
        self._tags: dict[str, str] = {}

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self._metrics.write(json.dumps({"step": int(step), "metrics": dict(metrics)}) + "\n")
        self._metrics.flush()

    def log_params(self, params: Mapping[str, Any]) -> None:
        self._params.update({k: v if isinstance(v, (int, float, bool, type(None))) else str(v)
                             for k, v in params.items()})
        (self.run_dir / "params.json").write_text(json.dumps(self._params, indent=1))

    def log_table(self, key, columns, rows, step=None) -> None:
        path = self.run_dir / f"{key}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        table = {"columns": list(columns), "data": []}
        if path.exists():
            table = json.loads(path.read_text())
            if table["columns"] != list(columns):
                raise ValueError(f"table {key!r}: columns {list(columns)} differ from {table['columns']}")
        table["data"].extend([list(r) for r in rows])
        path.write_text(json.dumps(table))

    def _write(self, rel: str) -> Path:
        path = self.run_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def log_html(self, key, html, step=None) -> None:
        self._write(step_path(key, step, "html")).write_text(html, encoding="utf-8")

    def log_image(self, key, path, step=None) -> None:
        dst = self._write(step_path(key, step, "png"))
        if Path(path).resolve() != dst.resolve():
            shutil.copyfile(path, dst)

    def log_artifact(self, path, artifact_path=None) -> None:
        dst_dir = self.run_dir / "artifacts" / (artifact_path or "")
        dst_dir.mkdir(parents=True, exist_ok=True)
        if Path(path).resolve() != (dst_dir / Path(path).name).resolve():
            shutil.copy(path, dst_dir / Path(path).name)

    def set_tags(self, tags: Mapping[str, str]) -> None:
        self._tags.update({k: str(v) for k, v in tags.items()})
        (self.run_dir / "tags.json").write_text(json.dumps(self._tags, indent=1))

    def finish(self, status: str = "success") -> None:
        self.set_tags({"status": status})
        if not self._metrics.closed:
            self._metrics.close()
