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

CORE = ("sample_id", "blamed", "runs", "steps", "max_share", "text", "nonfinite")
SHARE_FLOOR = 0.05  # see the module doc


def _indices(value: Any) -> Any:
    """The ledger joins several indices of one sample as ``"3 | 7"``: back to a list. Only for samples given
    without their ledger: the joined cell shows at most ``MAX_VALUES`` of them (``sample_values`` has all)."""
    if isinstance(value, str) and " | " in value:
        parts = [p.strip() for p in value.split(" | ")]
        return [int(p) if p.lstrip("-").isdigit() else p for p in parts if not p.startswith("(+")]
    return value


def sample_values(ledger: Any, column: str) -> dict[str, Any]:
    """``sample_id`` -> its ``column`` value in the ledger's rows: the one value, or every distinct one (a list,
    first seen first) when runs disagree. The blocklist's index (held-out tester, stop 63: a sample blamed at 7
    indices was exported with 4 and the display text "104 (+2)", its other indices not blocked)."""
    sid, at = ledger.cell("sample_id"), ledger.cell(column)
    seen: dict[str, dict[Any, Any]] = {}
    for r in ledger.data:
        if not r[sid] or r[at] is None:
            continue
        mine = seen.setdefault(r[sid], {})
        for v in r[at] if isinstance(r[at], list) else [r[at]]:  # a cell that lists several: each (a flat list)
            if v is not None:
                mine.setdefault(v if isinstance(v, (str, int, float)) else repr(v), v)
    return {k: (next(iter(vals.values())) if len(vals) == 1 else list(vals.values())) for k, vals in seen.items()}


def exported(sample: dict, min_blamed: int = 1, min_share: float = SHARE_FLOOR) -> bool:
    """Whether a ledger sample goes into the blocklist: a sample that made a step's gradient NaN/Inf
    has no share (the step had no finite norm to share) and goes in when blamed often enough."""
    return sample["blamed"] >= min_blamed and (sample["max_share"] >= min_share or bool(sample.get("nonfinite")))


def blocklist_entries(samples: list[dict], index_column: str = "dataset_index", min_blamed: int = 1,
                      min_share: float = SHARE_FLOOR, ledger: Any = None) -> list[dict]:
    """One entry per sample ``exported``: fingerprint, index, why, metadata. ``ledger``: the samples' ledger,
    whose rows give every index of a sample (without it, the joined cell's)."""
    indices = None if ledger is None else sample_values(ledger, index_column)
    out = []
    for s in (s for s in samples if exported(s, min_blamed, min_share)):
        meta = {k: v for k, v in s.items() if k not in CORE and k != index_column and v is not None}
        index = _indices(s.get(index_column)) if indices is None else indices.get(s["sample_id"])
        out.append({"sample_id": s["sample_id"], "index": index, "blamed": s["blamed"],
                    "runs": s["runs"], "steps": s["steps"], "max_share": s["max_share"], "text": s["text"],
                    "metadata": meta, **({"nonfinite": True} if s.get("nonfinite") else {})})
    return out


def export_blocklist(path: str | Path, samples: list[dict], index_column: str = "dataset_index",
                     min_blamed: int = 1, min_share: float = SHARE_FLOOR, ledger: Any = None) -> tuple[Path, int]:
    """Write the blocklist (atomically); returns (path, number of samples in it). ``ledger``: as
    ``blocklist_entries``."""
    from ..data.blocklist import write_blocklist  # not at import: ``culprits --help`` reads no blocklist

    entries = blocklist_entries(samples, index_column, min_blamed, min_share, ledger)
    return write_blocklist(path, entries, index_column), len(entries)
