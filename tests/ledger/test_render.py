"""The ledger's files: cells that would execute in a spreadsheet are defused in both CSVs, bidi
controls and NUL are shown (page, CSVs, console), the JSON keeps the exact text."""
from __future__ import annotations

import csv
import json

from gradloc_track.cli import main
from gradloc_track.ledger import RunTable, collect
from gradloc_track.ledger.aggregate import views
from gradloc_track.ledger.render import MAX_PAGE_ROWS, to_html, write_files

COLS = ["step", "level", "token", "share", "sample", "position", "end", "sample_id", "source"]
FORMULA = '=HYPERLINK("http://evil","x")'
BIDI = "abc\u202edef\x00"


def table(rows) -> list[RunTable]:
    return [RunTable("run", "/runs/run", {"columns": COLS, "data": rows})]


def test_both_csvs_defuse_formulas_and_show_controls_and_the_json_keeps_the_text(tmp_path):
    rows = [[1, "sample", FORMULA, 0.5, 0, 0, 9, "a" * 16, "@SUM(A1)"],
            [2, "sample", BIDI, 0.4, 0, 0, 9, "b" * 16, "-2+3"],
            [3, "token", "+1", 0.3, 0, 3, 4, "c" * 16, "\u202eweb"]]
    files = write_files(tmp_path, views(collect(table(rows)), "source"))
    cells = {p.name: [c for r in csv.reader(p.open(encoding="utf-8")) for c in r]
             for p in files if p.suffix == ".csv"}
    assert set(cells) == {"culprits.csv", "culprits_by_source.csv"}
    for name, got in cells.items():
        assert not any(c.startswith(("=", "+", "-", "@", "\t", "\r")) for c in got), name
        assert not any(ch in c for c in got for ch in "\u202e\x00"), name
    shown = {"'" + FORMULA, "abc\\u202edef\\x00", "'+1", "'@SUM(A1)", "'-2+3", "\\u202eweb"}
    assert shown <= set(cells["culprits.csv"])
    assert "0.5" in cells["culprits.csv"] and "3" in cells["culprits_by_source.csv"]  # numbers stay numbers
    doc = json.loads((tmp_path / "culprits.json").read_text(encoding="utf-8"))
    assert {s["text"] for s in doc["samples"]} == {FORMULA, BIDI, "+1"}  # the record is exact
    page = (tmp_path / "culprits.html").read_text(encoding="utf-8")
    assert "\u202e" not in page and "\x00" not in page and "abc\\u202edef\\x00" in page


def test_the_console_shows_controls(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "spikes" / "tokens").mkdir(parents=True)
    (run / "spikes" / "tokens" / "step_000001.json").write_text(json.dumps(
        {"columns": COLS, "data": [[1, "token", BIDI, 0.5, 0, 3, 4, "a" * 16, "\u202eweb"]]}))
    assert main(["culprits", str(run), "-o", str(tmp_path / "l"), "--by", "source"]) == 0
    out = capsys.readouterr().out
    assert "\u202e" not in out and "\x00" not in out
    assert "'abc\\u202edef\\x00'" in out and "source \\u202eweb caused 1 of 1 spike(s)" in out


def test_the_page_shows_the_first_rows_and_says_where_the_rest_are():
    rows = [[s, "token", "x", 0.5, 0, 3, 4, f"{s:016x}", "web"] for s in range(MAX_PAGE_ROWS + 5)]
    page = to_html(views(collect(table(rows))))
    assert page.count("<tr>") == MAX_PAGE_ROWS + 1  # the header and the first rows
    assert f"(the first {MAX_PAGE_ROWS} of {MAX_PAGE_ROWS + 5}; every one is in the CSV and the JSON)" in page


def test_a_csv_written_column_by_column_equals_csv_cell_of_each_cell():
    """``to_csv`` passes a plain column (numbers; printable text that starts no formula; lists of them joined)
    through at once and every other column cell by cell: the same file as ``csv_cell`` of every cell."""
    import io
    import random

    from gradloc_track.ledger.render import LIST_SEP, to_csv
    from gradloc_track.text import csv_cell

    cells = [0, 1.5, True, None, "web", "", "=1+1", "-x", "a\tb", "\u202eabc", "x\x00", ["r1", "r2"], ["-a", 1],
             {"k": 1}, 10 ** 30, float("nan"), "tab\there"]
    for seed in range(300):
        rng = random.Random(seed)
        kinds = [rng.sample(cells, rng.randrange(1, 4)) for _ in range(rng.randrange(1, 6))]
        entries = [{f"c{j}": rng.choice(kind) for j, kind in enumerate(kinds) if rng.random() < 0.9}
                   for _ in range(rng.randrange(0, 8))]
        cols = list(dict.fromkeys(k for e in entries for k in e))
        buf = io.StringIO()
        w = csv.writer(buf)
        w.writerow(cols)
        w.writerows([csv_cell(LIST_SEP.join(map(str, v)) if isinstance(v, list) else v) for v in
                     (e.get(c) for c in cols)] for e in entries)
        assert to_csv(entries) == buf.getvalue(), seed


def test_the_json_is_strict_json_with_a_nan_in_the_metadata_or_an_infinite_share(tmp_path):
    """A NaN reward in a sample's metadata (TRL logs an unscorable completion's reward so) and a share that
    overflows were written as bare NaN / Infinity: no strict parser opened the file (held-out tester, stop 63)."""
    import math

    rows = [[1, "sample", "x", 1e308, 0, 0, 9, "a" * 16, math.nan], [2, "sample", "x", 1e308, 0, 0, 9, "a" * 16, None],
            [2, "sample", "y", 0.5, 1, 0, 9, "b" * 16, "web"]]
    write_files(tmp_path, views(collect(table(rows)), "source"))

    def refuse(name):
        raise ValueError(f"bare {name} is not JSON")

    doc = json.loads((tmp_path / "culprits.json").read_text(encoding="utf-8"), parse_constant=refuse)
    by_id = {s["sample_id"]: s for s in doc["samples"]}
    assert by_id["a" * 16]["source"] == "NaN" and by_id["b" * 16]["source"] == "web"
    assert by_id["b" * 16]["max_share"] == 0.5
    assert json.dumps(by_id["a" * 16]["max_share"], allow_nan=False)  # a number or a name, never bare
