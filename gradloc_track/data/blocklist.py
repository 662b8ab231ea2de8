"""A blocklist: the samples a culprit ledger blamed, as a small versioned JSON file.

Written by ``gradloc-track culprits --export-blocklist FILE``; read by ``load_blocklist`` and the
filters in ``gradloc_track.data``. Each entry names a sample by its fingerprint (``sample_id``,
``artifacts.identity``: the same text gives the same id in any run and any dataset order) and, when
the runs logged one, by its dataset index (valid only for the dataset those runs read)::

    {"format": "gradloc-track-blocklist", "version": 1, "index_column": "dataset_index",
     "samples": [{"sample_id": "3f2a...", "index": 401, "blamed": 2, "runs": [...], "max_share": 0.97,
                  "text": "...", "metadata": {...}}]}
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

FORMAT = "gradloc-track-blocklist"
VERSION = 1
FINGERPRINT = re.compile(r"^[0-9a-f]{16}$")


class BlocklistError(ValueError):
    """A blocklist file that cannot be used; the message says what is wrong and how to fix it."""


@dataclass(frozen=True)
class Blocklist:
    """Fingerprints (always) and dataset indices (when known) of samples to leave out."""

    fingerprints: frozenset[str] = frozenset()
    indices: frozenset[Any] = frozenset()
    index_column: str = "dataset_index"
    entries: tuple[Mapping[str, Any], ...] = field(default=(), compare=False)

    def blocks(self, fingerprint: str | None = None, index: Any = None) -> bool:
        """Whether a sample with this fingerprint (or, if given, this dataset index) is listed."""
        return (fingerprint is not None and fingerprint in self.fingerprints) or \
            (index is not None and index in self.indices)

    def __len__(self) -> int:
        return len(self.entries) or len(self.fingerprints)


def _indices(entry: Mapping[str, Any]) -> list[Any]:
    idx = entry.get("index")
    return [] if idx is None else list(idx) if isinstance(idx, list) else [idx]


def write_blocklist(path: str | Path, samples: Iterable[Mapping[str, Any]],
                    index_column: str = "dataset_index") -> Path:
    """Write ``samples`` (each with ``sample_id``; ``index`` etc. optional) as a blocklist file."""
    entries = [dict(s) for s in samples]
    for i, e in enumerate(entries):
        if not FINGERPRINT.match(str(e.get("sample_id", ""))):
            raise BlocklistError(f"samples[{i}].sample_id={e.get('sample_id')!r} is not a 16-hex fingerprint")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"format": FORMAT, "version": VERSION, "index_column": index_column, "samples": entries}
    path.write_text(json.dumps(doc, indent=1, default=str), encoding="utf-8")
    return path


def load_blocklist(path: str | Path, field_name: str = "blocklist") -> Blocklist:
    """Read a blocklist file; ``BlocklistError`` naming ``field_name`` and the fix when it is not one."""
    where = f"{field_name}={str(path)!r}"
    fix = "pass a file written by 'gradloc-track culprits ... --export-blocklist FILE'"
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise BlocklistError(f"{where}: cannot read it ({exc.strerror or exc}); {fix}") from None
    except ValueError as exc:
        raise BlocklistError(f"{where}: not JSON ({exc}); {fix}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise BlocklistError(f"{where}: not a blocklist (no \"format\": \"{FORMAT}\"); {fix}")
    if doc.get("version") != VERSION:
        raise BlocklistError(f"{where}: blocklist version {doc.get('version')!r} is not {VERSION}, the one this "
                             "gradloc-track reads; export it again with this version")
    samples = doc.get("samples")
    if not isinstance(samples, list) or not all(isinstance(s, dict) for s in samples):
        raise BlocklistError(f"{where}: \"samples\" must be a list of objects; {fix}")
    for i, s in enumerate(samples):
        if not FINGERPRINT.match(str(s.get("sample_id", ""))):
            raise BlocklistError(f"{where}: samples[{i}].sample_id={s.get('sample_id')!r} is not a 16-hex "
                                 f"fingerprint; {fix}")
    return Blocklist(frozenset(s["sample_id"] for s in samples),
                     frozenset(i for s in samples for i in _indices(s)),
                     str(doc.get("index_column") or "dataset_index"), tuple(samples))
