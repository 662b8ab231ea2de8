"""The spool: records a backend could not take, kept as JSON lines so nothing is lost.

Each line is one call: ``{"backend": ..., "call": "log_metrics", "args": [...], "error": ...}``.
``replay_spool`` sends them to any tracker later (e.g. once the server is back).
"""
from __future__ import annotations

import json
import math
import threading
from pathlib import Path
from typing import Any, Iterable

from .base import Tracker


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return repr(x)  # "nan", "inf": valid JSON, restored by _restore
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


def _restore(x: Any) -> Any:
    if x in ("nan", "inf", "-inf"):
        return float(x)
    if isinstance(x, dict):
        return {k: _restore(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_restore(v) for v in x]
    return x


class Spool:
    """Append-only JSONL file, safe to write from several threads."""

    def __init__(self, path: str | Path, backend: str) -> None:
        self.path = Path(path)
        self.backend = backend
        self._lock = threading.Lock()
        self.count = 0

    def write(self, call: str, args: Iterable[Any], error: str) -> None:
        line = json.dumps({"backend": self.backend, "call": call, "args": _jsonable(list(args)), "error": error})
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line + "\n")
            self.count += 1


def read_spool(path: str | Path) -> list[dict[str, Any]]:
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            rec = json.loads(line)
            rec["args"] = _restore(rec["args"])
            out.append(rec)
    return out


def replay_spool(path: str | Path, tracker: Tracker) -> int:
    """Send every spooled call to ``tracker`` in order; returns how many were replayed."""
    n = 0
    for rec in read_spool(path):
        if rec["call"] == "finish":
            continue
        getattr(tracker, rec["call"])(*rec["args"])
        n += 1
    return n
