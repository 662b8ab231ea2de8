"""The ledger's arithmetic and its page, on hand-made culprit tables checked against brute force."""
from __future__ import annotations

import json

import pytest

from gradloc_track.ledger import RunTable, by_group, by_sample, collect
from gradloc_track.ledger.aggregate import bucket, views
from gradloc_track.ledger.render import to_html, write_files

COLS = ["step", "level", "token", "share", "sample", "position", "end", "sample_id", "dataset_index", "source"]
A, B = "aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb"


def tables() -> list[RunTable]:
    run1 = [[5, "token", "x", 0.3, 0, 4, 5, A, 7, "forum"], [5, "token", "y", 0.2, 0, 3, 4, A, 7, "forum"],
            [5, "sample", "whole b", 0.1, 1, 0, 40, B, 8, "web"],
            [9, "token", "x", 0.6, 2, 4, 5, A, 7, "forum"],
            [9, "micro_batch", "", 0.2, None, None, None, None, None, None]]
    run2 = [[5, "span", "<script>alert(1)</script>", 0.9, 3, 2, 6, A, 12, "forum<img src=x onerror=y>"]]
    return [RunTable("r1", "id1", {"columns": COLS, "data": run1}),
            RunTable("r2", "id2", {"columns": COLS, "data": run2})]


def test_per_sample_counts_events_and_sums_shares_per_event():
    led = collect(tables())
    assert led.metadata == ["dataset_index", "source"] and led.events == 3  # r1@5, r1@9, r2@5
    a, b = by_sample(led)
    assert (a["sample_id"], a["blamed"], a["runs"], a["steps"]) == (A, 3, ["r1", "r2"], ["r1@5", "r1@9", "r2@5"])
    # brute force: the largest per-event sum of A's shares
    events = {}
    for run in tables():
        for r in run.table["data"]:
            if r[7] == A:
                events[(run.name, r[0])] = events.get((run.name, r[0]), 0) + r[3]
    assert a["max_share"] == pytest.approx(max(events.values())) == pytest.approx(0.9)
    assert a["text"] == "<script>alert(1)</script>"  # a unit row's text stands for the sample
    assert a["dataset_index"] == "7 | 12" and a["source"] == "forum | forum<img src=x onerror=y>"
    assert (b["sample_id"], b["blamed"], b["text"], b["dataset_index"]) == (B, 1, "whole b", 8)


def test_rows_of_a_step_the_data_did_not_make_blame_no_sample():
    """``data_fault`` False (an irreproducible step's replay rows, a schedule's): no sample blamed, a note says how
    many rows were left out (review, stop 56); True and None (a table written before the column) count."""
    cols = COLS + ["data_fault"]
    run = [[5, "sample", "clean", 0.3, 0, 0, 9, A, 7, "web", False], [5, "sample", "clean2", 0.3, 1, 0, 9, B, 8, "web",
                                                                     False],
           [9, "sample", "junk", 0.9, 2, 0, 9, B, 8, "web", True]]
    led = collect([RunTable("r1", "id1", {"columns": cols, "data": run}),
                   RunTable("r0", "id0", {"columns": COLS, "data": [[3, "token", "x", 0.5, 0, 4, 5, A, 7, "web"]]})])
    assert led.events == 2 and sorted((s["sample_id"], s["steps"]) for s in by_sample(led)) == [(A, ["r0@3"]),
                                                                                                 (B, ["r1@9"])]
    assert led.notes == ["2 culprit row(s) of 1 spike event(s) the data did not make (their data_fault column is "
                         "false: the step's own cause is not data, e.g. an irreproducible replay's largest rows or a "
                         "schedule's) blame no sample"]


def test_groups_by_column_token_length_and_position():
    led = collect(tables())
    src = {g["source"]: g for g in by_group(led, "source")}
    assert (src["forum"]["spikes"], src["forum"]["of_spikes"], src["web"]["spikes"]) == (2, 3, 1)
    assert src["forum"]["summary"] == "source forum caused 2 of 3 spike(s)"
    tok = {g["token"]: g for g in by_group(led, "token")}
    assert set(tok) == {"x", "y"} and tok["x"]["spikes"] == 2 and tok["x"]["max_share"] == pytest.approx(0.6)
    length = {g["length"]: g["rows"] for g in by_group(led, "length")}
    assert length == {"1": 3, "32-63": 1, "4-7": 1}
    pos = {g["position"]: g["rows"] for g in by_group(led, "position")}
    assert pos == {"4-7": 2, "2-3": 2, "0": 1}
    with pytest.raises(KeyError, match="no run's culprit table has that column; use one of .*source"):
        by_group(led, "domain")


def test_bucket_is_the_power_of_two_range_holding_n():
    for n in range(0, 300):
        b = bucket(n)
        lo, hi = (int(b), int(b)) if "-" not in b else map(int, b.split("-"))
        assert lo <= n <= hi and (n < 2 or (lo & (lo - 1) == 0 and hi == 2 * lo - 1))
    assert bucket(None) is None and bucket(-1) is None


def test_page_escapes_every_cell_and_runs_no_script(tmp_path):
    v = views(collect(tables()), "source")
    page = to_html(v)
    assert "<script" not in page.lower() and "<img" not in page.lower()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "forum&lt;img src=x onerror=y&gt;" in page
    assert "default-src 'none'" in page
    files = write_files(tmp_path, v)
    assert sorted(p.name for p in files) == ["culprits.csv", "culprits.html", "culprits.json", "culprits_by_source.csv"]
    doc = json.loads((tmp_path / "culprits.json").read_text())
    assert doc["spike_events"] == 3 and [s["sample_id"] for s in doc["samples"]] == [A, B]


def test_cli_names_a_source_it_cannot_find(tmp_path, capsys):
    from gradloc_track.cli import main

    rc = main(["culprits", "no-such-experiment", "--tracking-uri", f"sqlite:///{tmp_path / 'none.db'}"])
    assert rc == 2 and "no MLflow store at" in capsys.readouterr().err
    assert main(["culprits", str(tmp_path / "missing" / "run"), "-o", str(tmp_path / "o")]) == 2
    assert "no such run directory" in capsys.readouterr().err


def test_per_sample_entries_match_a_brute_force_oracle_on_random_tables():
    import random

    rng = random.Random(0)
    sids = [f"{i:016x}" for i in range(30)]
    runs = []
    for k in range(4):
        data = [[rng.randrange(5), rng.choice(["token", "token", "span", "sample"]), f"t{rng.randrange(9)}",
                 rng.uniform(-0.05, 0.6), 0, p, p + 1, rng.choice(sids), rng.randrange(3), "web"]
                for p in range(rng.randrange(5, 40))]
        runs.append(RunTable(f"r{k}", f"id{k}", {"columns": COLS, "data": data}))
    got = {e["sample_id"]: e for e in by_sample(collect(runs))}
    for sid in {r[7] for run in runs for r in run.table["data"]}:
        mine = [(run.name, r) for run in runs for r in run.table["data"] if r[7] == sid]
        events: dict = {}
        for name, r in mine:
            events[(name, r[0])] = events.get((name, r[0]), 0.0) + r[3]
        e = got[sid]
        assert e["blamed"] == len(events) and e["steps"] == [f"{n}@{s}" for n, s in events]
        assert e["runs"] == list(dict.fromkeys(n for n, _ in events))
        assert e["max_share"] == pytest.approx(max(0.0, max(events.values())))
        idx = list(dict.fromkeys(r[8] for _, r in mine))
        assert e["dataset_index"] == (idx[0] if len(idx) == 1 else " | ".join(map(str, idx)))
        units = [r for _, r in mine if r[1] != "token"]
        if units:  # the widest unit (sample before span), the largest share first
            best = min(units, key=lambda r: ({"sample": 0, "span": 1}[r[1]], -r[3]))
            assert e["text"] == best[2]


POOL = ["step", "level", "token", "share", "position", "end", "sample_id", "dataset_index", "source", "nonfinite",
        "data_fault"]


def _cell(rng, c):
    return {"step": lambda: rng.choice([1, 2, 5, None]), "level": lambda: rng.choice(["token", "span", "sample", None]),
            "token": lambda: rng.choice(["x", "y", "", None]), "share": lambda: rng.choice([0.1, 0.5, -0.2, None, 1]),
            "position": lambda: rng.choice([0, 3, 9, None]), "end": lambda: rng.choice([1, 4, 40, None]),
            "sample_id": lambda: rng.choice(["a" * 16, "b" * 16, "c" * 16, None, ""]),
            "nonfinite": lambda: rng.choice([True, False, None]), "data_fault": lambda: rng.choice([True, False, None]),
            "run": lambda: "the user's own"}.get(c, lambda: rng.choice([1, 2, "web", None, [1, 2]]))()


def _dict_groups(rows, by):
    """``by_group``'s counts from one dict per row (a column a run lacks is absent from its rows; a row without
    ``level`` is a token row): (key -> (spikes, rows, samples, runs))."""
    groups: dict = {}
    for r in rows:
        if by == "token":
            key = r.get("token") if r.get("level", "token") == "token" else None
        else:
            key = r.get(by)
        if key is not None:
            groups.setdefault(str(key) if isinstance(key, list) else key, []).append(r)
    return {k: (len({(r["run"], r.get("step")) for r in rs}), len(rs),
                len({r["sample_id"] for r in rs if r.get("sample_id")}), len({r["run"] for r in rs}))
            for k, rs in groups.items()}


def _samples(kept, names):
    """``by_sample``'s counts from one dict per row: sample id -> (blamed, steps, runs, max_share, nonfinite)."""
    out: dict = {}
    for sid in dict.fromkeys(r.get("sample_id") for r in kept if r.get("sample_id")):
        events: dict = {}
        for r in (r for r in kept if r.get("sample_id") == sid):
            key = (r["run"], r.get("step"))
            events[key] = events.get(key, 0.0) + float(r.get("share") or 0.0)
        out[sid] = (len(events), [f"{names[run]}@{step}" for run, step in events],
                    list(dict.fromkeys(names[run] for run, _ in events)), max(0.0, *events.values()),
                    any(r.get("nonfinite") is True for r in kept if r.get("sample_id") == sid))
    return out


def test_runs_with_other_columns_count_as_one_dict_per_row_would():
    """The ledger keeps rows as lists aligned with the union of the runs' columns. A run that lacks a column (an
    older run without ``data_fault``; without ``level``: its rows are token rows), orders them otherwise, has a
    ``run`` column of its own (its id wins), or a hand-made table with a column twice or rows short or long, counts
    as reading each row as a dict: its samples, groups, events, the data_fault note, ``--by`` columns it knows."""
    import random

    from gradloc_track.ledger.aggregate import OURS

    for seed in range(300):
        rng = random.Random(seed)
        runs = []
        for k in range(rng.randrange(1, 5)):
            cols = rng.sample(POOL + ["run"] * (seed % 5 == 0), rng.randrange(3, len(POOL)))
            cols += cols[:1] * (seed % 7 == 0)  # a column twice: the last cell a row has wins, as in a dict
            data = [[_cell(rng, c) for c in cols] for _ in range(rng.randrange(0, 10))]
            if seed % 3 == 0:  # a hand-made table's short and long rows
                data = [r[:rng.randrange(len(r) + 1)] if rng.random() < 0.5 else [*r, "extra"] for r in data]
            runs.append(RunTable(f"r{k}", f"id{k}", {"columns": cols, "data": data}))
        rows = [dict(zip(run.table["columns"], r), run=run.run_id) for run in runs for r in run.table["data"]]
        kept = [r for r in rows if r.get("data_fault") is not False]
        dropped = [r for r in rows if r.get("data_fault") is False]
        led = collect(runs)
        assert led.events == len({(r["run"], r.get("step")) for r in kept}), seed
        assert [n.split(" culprit row(s) of ")[0] + " " + n.split(" of ")[1].split(" spike")[0] for n in led.notes] \
            == ([f"{len(dropped)} {len({(r['run'], r.get('step')) for r in dropped})}"] if dropped else []), seed
        metadata = list(dict.fromkeys(c for run in runs for c in run.table["columns"] if c not in OURS))
        assert led.metadata == metadata
        known = set().union(*kept) | set(metadata) | {"token", "length", "position"}
        for by in ("token", "level", "source", "dataset_index", "step", "run", "end"):
            if by not in known:
                with pytest.raises(KeyError):
                    by_group(led, by)
                continue
            got = {g[by]: (g["spikes"], g["rows"], g["samples"], g["runs"]) for g in by_group(led, by)}
            assert got == _dict_groups(kept, by), (seed, by)
        names = {run.run_id: run.name for run in runs}
        got = {e["sample_id"]: (e["blamed"], e["steps"], e["runs"], e["max_share"], e.get("nonfinite", False))
               for e in by_sample(led)}
        assert got == _samples(kept, names), seed
        assert len(led.rows) == len(kept)
        for mine, ref in zip(led.rows, kept):  # each row's cells by name; a column its run lacked is None
            assert {k: mine[k] for k in ref} == ref and all(mine[k] is None for k in set(mine) - set(ref)), seed
