"""What the localizer named, as plain rows, and whether it named the injected units at their level.

A truth unit (``kinds.py`` writes them) is ``{"level": "token"|"span"|"sample"|"document", "batch": b,
"start": s, "end": e, "document": d}`` in the localizer's position space (the term at position ``t``
predicts the token after it). A culprit row names it when:

- ``token``: a token row of that sample at that position;
- ``span``: a span row of that sample covering at least half the injected span and lying at least
  half inside it (a row of the whole sample is the wrong level);
- ``sample``: a sample row of that sample (not a span or tokens of it);
- ``document``: a sample-level row carrying that document id in that row (packed batches).

An injected step is *named* when every unit is; ``twice`` counts sample rows that name the same
sample (or document) more than once (the issue's "sample 1" listed twice); ``innocent`` counts the culprit
rows that lie in no injected unit's sample (or document) at all: clean rows named beside the culprits.
"""
from __future__ import annotations

from typing import Any


def rows_of(stats: Any) -> list[dict] | None:
    """The culprit rows of a monitor step's localization (None: the localizer did not run)."""
    loc = getattr(stats, "locate", None)
    if loc is None:
        return None
    out = []
    for c in loc.culprits:
        out.append({"level": c.level, "batch": c.batch, "start": c.start, "end": c.end,
                    "document": getattr(c, "document", None), "share": c.share,
                    "nonfinite": bool(getattr(c, "nonfinite", False))})
    if not out and loc.sample_shares:  # "no single culprit": keep the shares the console showed
        out = [{"level": "shares", "batch": d.get("sample"), "document": d.get("document"), "share": d.get("share")}
               for d in loc.sample_shares[:8]]
    return out


def _overlap(a0: int, a1: int, b0: int, b1: int) -> int:
    return max(0, min(a1, b1) - max(a0, b0))


def matches(unit: dict, row: dict) -> bool:
    if row.get("batch") != unit["batch"]:
        return False
    level = unit["level"]
    if level == "token":
        return row["level"] == "token" and row.get("start") == unit["start"]
    if level == "span":
        if row["level"] != "span" or row.get("start") is None:
            return False
        ov = _overlap(row["start"], row["end"], unit["start"], unit["end"])
        return ov >= 0.5 * (unit["end"] - unit["start"]) and ov >= 0.5 * (row["end"] - row["start"])
    if level == "document":
        return row["level"] == "sample" and row.get("document") == unit["document"]
    return row["level"] == "sample" and row.get("document") is None


def named(truth: list[dict], rows: list[dict] | None) -> tuple[int, int]:
    """(units named, units injected) of one step."""
    if not truth:
        return 0, 0
    rows = rows or []
    return sum(any(matches(u, r) for r in rows) for u in truth), len(truth)


def twice(rows: list[dict] | None) -> int:
    """Sample-level rows beyond the first for the same (sample, document)."""
    keys = [(r.get("batch"), r.get("document")) for r in rows or [] if r.get("level") == "sample"]
    return len(keys) - len(set(keys))


def innocent(truth: list[dict], rows: list[dict] | None) -> tuple[int, int]:
    """(culprit rows in no injected unit's sample or document, culprit rows) of one step; "shares" rows (no
    culprit named) are not culprits."""
    rows = [r for r in rows or [] if r.get("level") != "shares"]
    def inside(u: dict, r: dict) -> bool:
        return r.get("batch") == u["batch"] and (u["level"] != "document" or r.get("document") in (None, u["document"]))
    return sum(not any(inside(u, r) for u in truth) for r in rows), len(rows)
