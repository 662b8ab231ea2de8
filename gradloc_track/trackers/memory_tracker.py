"""A tracker that keeps everything in lists: for tests and notebooks."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from .interface import Tracker


class MemoryTracker(Tracker):
    """Records every call. ``metrics`` is a list of ``(step, dict)`` pairs in call order. ``images`` holds
    paths: without a run dir (this tracker's or the writer's) they are scratch files, removed when the
    run closes."""

    name = "memory"

    def __init__(self, run_dir: str | Path | None = None) -> None:
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.metrics: list[tuple[int, dict[str, float]]] = []
        self.params: dict[str, Any] = {}
        self.tables: dict[str, dict[str, Any]] = {}  # key -> {"columns": [...], "rows": [...]}
        self.table_calls: list[tuple[str, int | None, list[list[Any]]]] = []
        self.html: list[tuple[str, int | None, str]] = []
        self.images: list[tuple[str, int | None, Path]] = []
        self.artifacts: list[tuple[Path, str | None]] = []
        self.tags: dict[str, str] = {}
        self.finished: str | None = None

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.metrics.append((int(step), dict(metrics)))

    def log_params(self, params: Mapping[str, Any]) -> None:
        self.params.update(params)

    def log_table(self, key, columns, rows, step=None) -> None:
        rows = [list(r) for r in rows]
        table = self.tables.setdefault(key, {"columns": list(columns), "rows": []})
        if list(columns) != table["columns"]:
            raise ValueError(f"table {key!r}: columns {list(columns)} differ from {table['columns']}")
        table["rows"].extend(rows)
        self.table_calls.append((key, step, rows))

    def log_html(self, key, html, step=None) -> None:
        self.html.append((key, step, html))

    def log_image(self, key, path, step=None) -> None:
        self.images.append((key, step, Path(path)))

    def log_artifact(self, path, artifact_path=None) -> None:
        self.artifacts.append((Path(path), artifact_path))

    def set_tags(self, tags: Mapping[str, str]) -> None:
        self.tags.update({k: str(v) for k, v in tags.items()})

    def finish(self, status: str = "success", timeout_s: float | None = None) -> None:
        self.finished = status

    # convenience for tests
    def series(self, key: str) -> list[tuple[int, float]]:
        """All logged values of one metric key as ``(step, value)`` pairs."""
        return [(s, m[key]) for s, m in self.metrics if key in m]

    def keys(self) -> set[str]:
        return {k for _, m in self.metrics for k in m}
