"""The ledger's two views of every culprit row of every run: per sample, and per group (``--by``).

A spike event is one (run, step), the run by its identity (``RunTable.run_id``), never its name.
Rows of one event never overlap (``artifacts.table``), so a sample's share of an event is the sum
of its rows' shares; its ``max_share`` is the largest such sum over the events that blamed it,
never below 0 (a negative share is interference noise, not a cause). Rows without a
``sample_id`` (micro-batch rows, tables from before sample identity) count in the groups, not in
the per-sample table.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from ..artifacts.table import BASE_COLUMNS, WHERE_COLUMNS, cut_text
from .sources import RunTable

OURS = set(BASE_COLUMNS) | set(WHERE_COLUMNS)  # every other column is the user's metadata
EXCERPT_CHARS = 200
UNIT_RANK = {"sample": 0, "document": 1, "span": 2}  # whose text stands for the sample (the widest first)
BUCKETED = ("length", "position")  # --by values computed from the rows, not read from a column
MAX_VALUES = 5  # distinct metadata values listed per sample


@dataclass
class Ledger:
    """Rows of every run (``run``: the run's id), their metadata columns, the runs' names (in order, and
    by id), and the number of spike events that blamed anything."""

    rows: list[dict[str, Any]]
    metadata: list[str]
    runs: list[str]
    events: int
    notes: list[str] = field(default_factory=list)
    names: dict[str, str] = field(default_factory=dict)  # run id -> its name in the ledger
    run_ids: list[str] = field(default_factory=list)


@dataclass
class Views:
    """A ledger and what is shown of it: one entry per blamed sample, and per group with ``--by``."""

    ledger: Ledger
    samples: list[dict[str, Any]]
    groups: list[dict[str, Any]] | None = None
    by: str | None = None


def views(ledger: Ledger, by: str | None = None) -> Views:
    """The per-sample view, and the ``by`` groups (``KeyError`` for a column no run has; a note when no row has
    a value for it, e.g. ``--by token`` over runs whose culprits are all whole samples)."""
    groups = by_group(ledger, by) if by is not None else None
    if by is not None and not groups and ledger.rows:
        what = "no culprit row is a single token (every one is a span, a sample or a micro-batch)" if by == "token" \
            else f"no culprit row has a value in column {by!r}"
        ledger.notes.append(f"--by {by}: {what}; culprits_by_{by}.csv holds its header only")
    return Views(ledger, by_sample(ledger), groups, by)


def group_columns(by: str) -> list[str]:
    """The columns of a ``by_group`` entry (a CSV of no group still has them)."""
    return [by, "spikes", "of_spikes", "samples", "runs", "rows", "max_share", "summary"]


def collect(runs: Iterable[RunTable], notes: list[str] | None = None) -> Ledger:
    """Every culprit row as a dict with its ``run`` (the run's id); the user's columns in first-seen order."""
    rows, metadata, names = [], [], {}
    for run in runs:
        names[run.run_id] = run.name
        cols = run.table.get("columns", [])
        metadata += [c for c in cols if c not in OURS and c not in metadata]
        rows += [dict(zip(cols, r), run=run.run_id) for r in run.table.get("data", [])]
    # a row that only carried a step the data did not make (``data_fault`` False: a replay that is not the step,
    # a schedule; an ``unexplained`` step's weak rows are None and count) blames no sample (review, stop 56: an
    # irreproducible NaN multiplier's four clean rows went to the blocklist); tables written before the column
    # count every row, as they did
    kept = [r for r in rows if r.get("data_fault") is not False]
    if len(kept) < len(rows):
        steps = len({(r["run"], r.get("step")) for r in rows if r.get("data_fault") is False})
        notes = [*(notes or []), f"{len(rows) - len(kept)} culprit row(s) of {steps} spike event(s) the data did not "
                                 "make (their data_fault column is false: the step's own cause is not data, e.g. an "
                                 "irreproducible replay's largest rows or a schedule's) blame no sample"]
    rows = kept
    events = len({(r["run"], r.get("step")) for r in rows})
    return Ledger(rows, metadata, list(names.values()), events, list(notes or []), names, list(names))


def _event_shares(rows: list[dict]) -> dict[tuple, float]:
    """(run id, step) -> the summed share of ``rows`` in that event."""
    out: dict[tuple, float] = {}
    for r in rows:
        key = (r["run"], r.get("step"))
        out[key] = out.get(key, 0.0) + float(r.get("share") or 0.0)
    return out


def _largest(shares: dict[tuple, float]) -> float:
    """The largest share of one event, never below 0 (a negative one is noise, never shown as a cause)."""
    return max(0.0, *shares.values())


def excerpt(rows: list[dict]) -> str:
    """The sample's text: its widest unit row's text, else its culprit tokens in position order."""
    units = [r for r in rows if r.get("level") in UNIT_RANK]
    if units:
        best = min(units, key=lambda r: (UNIT_RANK[r["level"]], -float(r.get("share") or 0)))
        return cut_text(str(best.get("token") or ""), EXCERPT_CHARS)
    first = min((r["run"], r.get("step") or 0) for r in rows)  # one event's tokens, not every run's copies
    toks = sorted((r for r in rows if (r["run"], r.get("step") or 0) == first), key=lambda r: r.get("position") or 0)
    return cut_text("".join(str(r.get("token") or "") for r in toks), EXCERPT_CHARS)


def _value(values: list[Any]) -> Any:
    """One metadata cell: the value, or the distinct values joined (e.g. another index in another run)."""
    seen: dict[Any, Any] = {}  # in first-seen order; a list or dict cell by its JSON-ish text
    for v in values:
        if v is not None:
            seen.setdefault(v if isinstance(v, (str, int, float)) else repr(v), v)
    distinct = list(seen.values())
    if len(distinct) <= 1:
        return distinct[0] if distinct else None
    more = f" (+{len(distinct) - MAX_VALUES})" if len(distinct) > MAX_VALUES else ""
    return " | ".join(map(str, distinct[:MAX_VALUES])) + more


def by_sample(ledger: Ledger) -> list[dict[str, Any]]:
    """One entry per ``sample_id``: how often, where and how hard it was blamed, its text and metadata;
    the most blamed first."""
    groups: dict[str, list[dict]] = {}
    for r in ledger.rows:
        if r.get("sample_id"):
            groups.setdefault(r["sample_id"], []).append(r)
    out = []
    name = ledger.names
    for sid, rows in groups.items():
        if len(rows) == 1:  # the common case, without the per-event bookkeeping (the same entry)
            out.append(_one_row(sid, rows[0], name[rows[0]["run"]], ledger.metadata))
            continue
        shares = _event_shares(rows)
        runs = list(dict.fromkeys(name[run] for run, _ in shares))
        out.append({"sample_id": sid, "blamed": len(shares), "runs": runs,
                    "steps": [f"{name[run]}@{step}" for run, step in shares],
                    "max_share": _largest(shares), "text": excerpt(rows), **_nonfinite(rows),
                    **{c: _value([r.get(c) for r in rows]) for c in ledger.metadata}})
    return sorted(out, key=lambda e: (-e["blamed"], -len(e["runs"]), -e["max_share"], e["sample_id"]))


def _one_row(sid: str, r: dict, run: str, metadata: list[str]) -> dict[str, Any]:
    """``by_sample``'s entry of a sample blamed by one row."""
    return {"sample_id": sid, "blamed": 1, "runs": [run], "steps": [f"{run}@{r.get('step')}"],
            "max_share": max(0.0, float(r.get("share") or 0.0)),
            "text": cut_text(str(r.get("token") or ""), EXCERPT_CHARS), **_nonfinite([r]),
            **{c: r.get(c) for c in metadata}}


def _nonfinite(rows: list[dict]) -> dict[str, bool]:
    """``{"nonfinite": True}`` for a sample a non-finite step blamed (its share is empty: the whole
    step was NaN/Inf), so the blocklist takes it whatever its share; nothing otherwise."""
    return {"nonfinite": True} if any(r.get("nonfinite") is True for r in rows) else {}


def bucket(n: Any) -> str | None:
    """Power-of-two buckets: ``0``, ``1``, ``2-3``, ``4-7``, ``8-15``..."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        return None
    if n < 2:
        return str(n)
    lo = 1 << (n.bit_length() - 1)
    return f"{lo}-{2 * lo - 1}"


def group_key(row: dict, by: str) -> Any:
    """The row's group for ``--by``: a column's value, the token (token rows only), a length or position bucket."""
    if by == "token":
        return row.get("token") if row.get("level", "token") == "token" else None
    if by == "length":  # the culprit's length in positions: 1 for a token, a unit's [position, end)
        start, end = row.get("position"), row.get("end")
        return bucket(end - start) if isinstance(start, int) and isinstance(end, int) else None
    if by == "position":
        return bucket(row.get("position"))
    return row.get(by)


def check_by(ledger: Ledger, by: str) -> None:
    """A clear error for a ``--by`` that no run has."""
    known = set().union(*ledger.rows) | set(ledger.metadata) | {"token", *BUCKETED}  # (a column
    # whose every row was left out as damaged is still the runs' column: grouped, it has no group)
    if by not in known:
        raise KeyError(f"--by {by!r}: no run's culprit table has that column; use one of "
                       f"{', '.join(sorted(known - {'run'}))}")


def by_group(ledger: Ledger, by: str) -> list[dict[str, Any]]:
    """One entry per value of ``by``: how many of the ledger's spike events it caused, the most first."""
    check_by(ledger, by)
    groups: dict[Any, list[dict]] = {}
    for r in ledger.rows:
        key = group_key(r, by)
        if key is not None:
            groups.setdefault(str(key) if isinstance(key, (list, dict)) else key, []).append(r)
    out = []
    for key, rows in groups.items():
        shares = _event_shares(rows)
        n = len(shares)
        out.append({by: key, "spikes": n, "of_spikes": ledger.events,
                    "samples": len({r["sample_id"] for r in rows if r.get("sample_id")}),
                    "runs": len({run for run, _ in shares}), "rows": len(rows), "max_share": _largest(shares),
                    "summary": f"{by} {key} caused {n} of {ledger.events} spike(s)"})
    return sorted(out, key=lambda e: (-e["spikes"], -e["max_share"], str(e[by])))
