"""``--export-blocklist FILE``: the ledger's blamed samples as a blocklist (``data.blocklist``)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..data.blocklist import write_blocklist

CORE = ("sample_id", "blamed", "runs", "steps", "max_share", "text")


def _indices(value: Any) -> Any:
    """The ledger joins several indices of one sample as ``"3 | 7"``: back to a list."""
    if isinstance(value, str) and " | " in value:
        parts = [p.strip() for p in value.split(" | ")]
        return [int(p) if p.lstrip("-").isdigit() else p for p in parts if not p.startswith("(+")]
    return value


def blocklist_entries(samples: list[dict], index_column: str = "dataset_index", min_blamed: int = 1) -> list[dict]:
    """One entry per sample blamed at least ``min_blamed`` times: fingerprint, index, why, metadata."""
    out = []
    for s in samples:
        if s["blamed"] < min_blamed:
            continue
        meta = {k: v for k, v in s.items() if k not in CORE and k != index_column and v is not None}
        out.append({"sample_id": s["sample_id"], "index": _indices(s.get(index_column)), "blamed": s["blamed"],
                    "runs": s["runs"], "steps": s["steps"], "max_share": s["max_share"], "text": s["text"],
                    "metadata": meta})
    return out


def export_blocklist(path: str | Path, samples: list[dict], index_column: str = "dataset_index",
                     min_blamed: int = 1) -> tuple[Path, int]:
    """Write the blocklist; returns (path, number of samples in it)."""
    entries = blocklist_entries(samples, index_column, min_blamed)
    return write_blocklist(path, entries, index_column), len(entries)
