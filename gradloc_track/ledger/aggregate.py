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
from operator import itemgetter
from typing import Any, Callable, Iterable

from ..artifacts.table import BASE_COLUMNS, WHERE_COLUMNS, cut_text
from .sources import RunTable

OURS = set(BASE_COLUMNS) | set(WHERE_COLUMNS)  # every other column is the user's metadata
EXCERPT_CHARS = 200
UNIT_RANK = {"sample": 0, "document": 1, "span": 2}  # whose text stands for the sample (the widest first)
BUCKETED = ("length", "position")  # --by values computed from the rows, not read from a column
MAX_VALUES = 5  # distinct metadata values listed per sample


@dataclass
class Ledger:
    """Every kept culprit row of every run, as one table: ``data``'s rows are lists aligned with ``columns``
    (the columns of the runs with kept rows, then ``run``: the run's id), then whether the row's run had no
    ``level`` column (its rows are token rows), then a cell that is always ``None`` (what ``cell`` points a
    missing column at); the user's metadata columns, the runs' names (in order, and by id), and the number of
    spike events that blamed anything. Lists, not a dict per row: a 1000-run ledger has 60,000 rows."""

    columns: list[str]
    data: list[list[Any]]
    metadata: list[str]
    runs: list[str]
    events: int
    notes: list[str] = field(default_factory=list)
    names: dict[str, str] = field(default_factory=dict)  # run id -> its name in the ledger
    run_ids: list[str] = field(default_factory=list)
    not_data: int = 0  # spike events whose every row the data did not make (``data_fault`` false): none blamed

    def cell(self, column: str) -> int:
        """The index of ``column`` in a row; a column no run with rows has points at the ``None`` cell."""
        try:
            return self.columns.index(column)
        except ValueError:
            return -1

    @property
    def rows(self) -> list[dict[str, Any]]:
        """The rows as dicts (every column -> its cell, ``None`` where the row's run had none; ``run`` included)."""
        return [dict(zip(self.columns, r)) for r in self.data]


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
    if by is not None and not groups and ledger.data:
        what = "no culprit row is a single token (every one is a span, a sample or a micro-batch)" if by == "token" \
            else f"no culprit row has a value in column {by!r}"
        ledger.notes.append(f"--by {by}: {what}; culprits_by_{by}.csv holds its header only")
    return Views(ledger, by_sample(ledger), groups, by)


def group_columns(by: str) -> list[str]:
    """The columns of a ``by_group`` entry (a CSV of no group still has them)."""
    return [by, "spikes", "of_spikes", "samples", "runs", "rows", "max_share", "summary"]


def collect(runs: Iterable[RunTable], notes: list[str] | None = None) -> Ledger:
    """Every culprit row with its ``run`` (the run's id), the columns of every run with kept rows (a column a
    row's run lacks is ``None`` in it); the user's columns in first-seen order."""
    metadata: list[str] = []
    names: dict[str, str] = {}
    parts: list[tuple[str, list[str], list[list[Any]]]] = []  # (run id, columns none twice, rows of their length)
    dropped, dropped_steps = 0, set()
    for run in runs:
        names[run.run_id] = run.name
        cols = list(run.table.get("columns", []))
        metadata += [c for c in dict.fromkeys(cols) if c not in OURS and c not in metadata]  # (a column twice: once)
        data = run.table.get("data", [])
        if len(set(cols)) == len(cols) and not set(map(len, data)) - {len(cols)}:
            pieces = [(cols, data)]
        else:  # a hand-made table (a file's rows are checked): a column twice, a short or long row. Each row by
            # name, as a dict reads it: a column's last cell the row has; a column it has no cell for is absent
            pieces = [(list(d), [list(d.values())]) for d in (dict(zip(cols, r)) for r in data)]
        for cols, data in pieces:
            # a row that only carried a step the data did not make (``data_fault`` False: a replay that is not the
            # step, a schedule; an ``unexplained`` step's weak rows are None and count) blames no sample (review,
            # stop 56: an irreproducible NaN multiplier's four clean rows went to the blocklist); tables written
            # before the column count every row, as they did
            if "data_fault" in cols:
                j, step = cols.index("data_fault"), cols.index("step") if "step" in cols else -1
                out = [r for r in data if r[j] is not False]
                if len(out) < len(data):
                    dropped += len(data) - len(out)
                    dropped_steps |= {(run.run_id, None if step < 0 else r[step]) for r in data if r[j] is False}
                data = out
            if data:
                parts.append((run.run_id, cols, data))
    own = list(dict.fromkeys(c for _, cols, _ in parts for c in cols if c != "run"))  # (a run's "run": its id)
    columns = [*own, "run"] if parts else []
    rows: list[list[Any]] = []
    for run_id, cols, data in parts:
        no_level = "level" not in cols  # its rows are token rows (``group_key``)
        if cols == own:  # the common case: every run has the same columns
            rows += [[*r, run_id, no_level, None] for r in data]
            continue
        n = len(cols)  # another run's columns, or another order: by name; a column it lacks is None
        at = [cols.index(c) if c in cols else n for c in own]
        rows += [[*(ext[j] for j in at), run_id, no_level, None] for ext in ([*r, None] for r in data)]
    if dropped:
        notes = [*(notes or []), f"{dropped} culprit row(s) of {len(dropped_steps)} spike event(s) the data did not "
                                 "make (their data_fault column is false: the step's own cause is not data, e.g. an "
                                 "irreproducible replay's largest rows or a schedule's) blame no sample"]
    run, step = len(columns) - 1, columns.index("step") if "step" in columns else -1
    events = len({(r[run], r[step]) for r in rows})
    return Ledger(columns, rows, metadata, list(names.values()), events, list(notes or []), names, list(names),
                  len(dropped_steps - {(r[run], r[step]) for r in rows}) if dropped_steps else 0)


def _event_shares(rows: list[list[Any]], run: int, step: int, share: int) -> dict[tuple, float]:
    """(run id, step) -> the summed share of ``rows`` in that event (``run``, ``step``, ``share``: cell indices)."""
    out: dict[tuple, float] = {}
    for r in rows:
        key = (r[run], r[step])
        out[key] = out.get(key, 0.0) + float(r[share] or 0.0)
    return out


def _largest(shares: dict[tuple, float]) -> float:
    """The largest share of one event, never below 0 (a negative one is noise, never shown as a cause)."""
    return max(0.0, *shares.values())


@dataclass(frozen=True)
class _Cells:
    """Where ``by_sample`` finds each cell it reads in a ledger's rows."""

    sample_id: int
    run: int
    step: int
    share: int
    token: int
    level: int
    position: int
    nonfinite: int
    metadata: tuple[tuple[str, int], ...]

    @classmethod
    def of(cls, ledger: Ledger) -> "_Cells":
        c = ledger.cell
        return cls(c("sample_id"), c("run"), c("step"), c("share"), c("token"), c("level"), c("position"),
                   c("nonfinite"), tuple((m, c(m)) for m in ledger.metadata))


def excerpt(rows: list[list[Any]], at: _Cells) -> str:
    """The sample's text: its widest unit row's text, else its culprit tokens in position order."""
    units = [r for r in rows if r[at.level] in UNIT_RANK]
    if units:
        best = min(units, key=lambda r: (UNIT_RANK[r[at.level]], -float(r[at.share] or 0)))
        return cut_text(str(best[at.token] or ""), EXCERPT_CHARS)
    first = min((r[at.run], r[at.step] or 0) for r in rows)  # one event's tokens, not every run's copies
    toks = sorted((r for r in rows if (r[at.run], r[at.step] or 0) == first), key=lambda r: r[at.position] or 0)
    return cut_text("".join(str(r[at.token] or "") for r in toks), EXCERPT_CHARS)


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
    at = _Cells.of(ledger)
    groups: dict[str, list[list[Any]]] = {}
    sid_at = at.sample_id
    for r in ledger.data:
        if r[sid_at]:
            groups.setdefault(r[sid_at], []).append(r)
    out = []
    name = ledger.names
    run_at, step_at, share_at, token_at, nonfinite_at = at.run, at.step, at.share, at.token, at.nonfinite
    for key, rows in groups.items():
        if len(rows) == 1:  # the common case, without the per-event bookkeeping (the same entry)
            r = rows[0]
            where = name[r[run_at]]
            entry = {"sample_id": key, "blamed": 1, "runs": [where], "steps": [f"{where}@{r[step_at]}"],
                     "max_share": max(0.0, float(r[share_at] or 0.0)), "text": cut_text(str(r[token_at] or ""),
                                                                                        EXCERPT_CHARS)}
            if r[nonfinite_at] is True:
                entry["nonfinite"] = True
            for c, j in at.metadata:
                entry[c] = r[j]
            out.append(entry)
            continue
        shares = _event_shares(rows, run_at, step_at, share_at)
        runs = list(dict.fromkeys(name[run] for run, _ in shares))
        out.append({"sample_id": key, "blamed": len(shares), "runs": runs,
                    "steps": [f"{name[run]}@{step}" for run, step in shares],
                    "max_share": _largest(shares), "text": excerpt(rows, at), **_nonfinite(rows, at.nonfinite),
                    **{c: _value([r[j] for r in rows]) for c, j in at.metadata}})
    return sorted(out, key=lambda e: (-e["blamed"], -len(e["runs"]), -e["max_share"], e["sample_id"]))


def _nonfinite(rows: list[list[Any]], nonfinite: int) -> dict[str, bool]:
    """``{"nonfinite": True}`` for a sample a non-finite step blamed (its share is empty: the whole
    step was NaN/Inf), so the blocklist takes it whatever its share; nothing otherwise."""
    return {"nonfinite": True} if any(r[nonfinite] is True for r in rows) else {}


def bucket(n: Any) -> str | None:
    """Power-of-two buckets: ``0``, ``1``, ``2-3``, ``4-7``, ``8-15``..."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        return None
    if n < 2:
        return str(n)
    lo = 1 << (n.bit_length() - 1)
    return f"{lo}-{2 * lo - 1}"


def group_key(ledger: Ledger, by: str) -> Callable[[list[Any]], Any]:
    """A row's group for ``--by``: a column's value, the token (token rows only), a length or position bucket."""
    cell = ledger.cell
    if by == "token":  # a token row, or a row of a table without levels
        token, level, no_level = cell("token"), cell("level"), len(ledger.columns)
        return lambda r: r[token] if r[no_level] or r[level] == "token" else None
    if by == "length":  # the culprit's length in positions: 1 for a token, a unit's [position, end)
        start, end = cell("position"), cell("end")
        return lambda r: bucket(r[end] - r[start]) if isinstance(r[start], int) and isinstance(r[end], int) else None
    if by == "position":
        position = cell("position")
        return lambda r: bucket(r[position])
    return itemgetter(cell(by))


def check_by(ledger: Ledger, by: str) -> None:
    """A clear error for a ``--by`` that no run has."""
    known = set(ledger.columns) | set(ledger.metadata) | {"token", *BUCKETED}  # (a column
    # whose every row was left out as damaged is still the runs' column: grouped, it has no group)
    if by not in known:
        raise KeyError(f"--by {by!r}: no run's culprit table has that column; use one of "
                       f"{', '.join(sorted(known - {'run'}))}")


def by_group(ledger: Ledger, by: str) -> list[dict[str, Any]]:
    """One entry per value of ``by``: how many of the ledger's spike events it caused, the most first."""
    check_by(ledger, by)
    groups: dict[Any, list[list[Any]]] = {}
    for key, r in zip(map(group_key(ledger, by), ledger.data), ledger.data):
        if key is not None:
            groups.setdefault(str(key) if isinstance(key, (list, dict)) else key, []).append(r)
    out = []
    run_at, step_at, share_at, sid_at = (ledger.cell(c) for c in ("run", "step", "share", "sample_id"))
    for key, rows in groups.items():
        shares = _event_shares(rows, run_at, step_at, share_at)
        n = len(shares)
        out.append({by: key, "spikes": n, "of_spikes": ledger.events,
                    "samples": len({r[sid_at] for r in rows if r[sid_at]}),
                    "runs": len({run for run, _ in shares}), "rows": len(rows), "max_share": _largest(shares),
                    "summary": f"{by} {key} caused {n} of {ledger.events} spike(s)"})
    return sorted(out, key=lambda e: (-e["spikes"], -e["max_share"], str(e[by])))
