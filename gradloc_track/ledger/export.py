"""``--export-blocklist FILE``: the ledger's blamed samples as a blocklist (``data.blocklist``).

Only samples that could have caused a spike are exported: blamed ``--min-blamed`` times, and with
a largest share of at least ``--min-share`` (default ``SHARE_FLOOR`` = 0.05). A share is the
fraction of the step's squared gradient norm a culprit carries. A step is a spike only when its
norm is at least ``spikes.min_ratio`` (1.5) times its running mean, so at least 1 - 1/1.5^2 = 56%
of its squared norm is excess over a normal step; a row under 5% carries less than a tenth of
that excess (leaving it out scales the norm by sqrt(0.95) = 0.975): whatever made the step spike,
it was not that row. Such rows are the noise beside a culprit (measured on trl_sft_packing: 2%,
2%, 0% and -0% next to the document at 95%); exported, they would drop innocent documents.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

CORE = ("sample_id", "blamed", "runs", "steps", "max_share", "text")
SHARE_FLOOR = 0.05  # see the module doc


def _indices(value: Any) -> Any:
    """The ledger joins several indices of one sample as ``"3 | 7"``: back to a list."""
    if isinstance(value, str) and " | " in value:
        parts = [p.strip() for p in value.split(" | ")]
        return [int(p) if p.lstrip("-").isdigit() else p for p in parts if not p.startswith("(+")]
    return value


def exported(sample: dict, min_blamed: int = 1, min_share: float = SHARE_FLOOR) -> bool:
    """Whether a ledger sample goes into the blocklist."""
    return sample["blamed"] >= min_blamed and sample["max_share"] >= min_share


def blocklist_entries(samples: list[dict], index_column: str = "dataset_index", min_blamed: int = 1,
                      min_share: float = SHARE_FLOOR) -> list[dict]:
    """One entry per sample ``exported``: fingerprint, index, why, metadata."""
    out = []
    for s in (s for s in samples if exported(s, min_blamed, min_share)):
        meta = {k: v for k, v in s.items() if k not in CORE and k != index_column and v is not None}
        out.append({"sample_id": s["sample_id"], "index": _indices(s.get(index_column)), "blamed": s["blamed"],
                    "runs": s["runs"], "steps": s["steps"], "max_share": s["max_share"], "text": s["text"],
                    "metadata": meta})
    return out


def export_blocklist(path: str | Path, samples: list[dict], index_column: str = "dataset_index",
                     min_blamed: int = 1, min_share: float = SHARE_FLOOR) -> tuple[Path, int]:
    """Write the blocklist (atomically); returns (path, number of samples in it)."""
    from ..data.blocklist import write_blocklist  # not at import: ``culprits --help`` reads no blocklist

    entries = blocklist_entries(samples, index_column, min_blamed, min_share)
    return write_blocklist(path, entries, index_column), len(entries)
