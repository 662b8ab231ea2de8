"""``ledger/rows.py``: the cells the ledger computes with, checked; a bad row is left out, named."""
from __future__ import annotations

import math

from gradloc_track.ledger.rows import checked_rows, rows_ok

COLS = ["step", "level", "share", "position", "end", "sample_id", "mine"]
GOOD = [1, "token", 0.5, 3, 4, "a" * 16, {"any": ["thing"]}]


def test_good_rows_pass_and_bad_cells_are_named():
    bad = [[True] + GOOD[1:], [1, "token", "abc"] + GOOD[3:], [1, "token", math.nan] + GOOD[3:],
           [1, "token", 0.1, 2.5] + GOOD[4:], [1, ["level"]] + GOOD[2:], GOOD[:5] + [7, None]]
    table = {"columns": COLS, "data": [GOOD] + bad + [[2, None, None, None, None, None, None]]}
    assert not rows_ok(table) and rows_ok({"columns": COLS, "data": [GOOD]})
    notes: list[str] = []
    kept = checked_rows(table, "spikes/tokens/step_000001.json", notes)
    assert kept["data"] == [GOOD, [2, None, None, None, None, None, None]]  # the user's column is never checked
    assert notes == ["spikes/tokens/step_000001.json: 6 row(s) left out (row 1: step=True is not an integer; "
                     "row 2: share='abc' is not a finite number; row 3: share=nan is not a finite number; row 4: "
                     "position=2.5 is not an integer; row 5: level=['level'] is not a string; +1 more; a hand-edited "
                     "or damaged file?)"]
    one: list[str] = []
    checked_rows({"columns": COLS, "data": [[1, "token", "abc"] + GOOD[3:]]}, "p.json", one)
    assert one == ["p.json: 1 row(s) left out (row 0: share='abc' is not a finite number; a hand-edited or damaged "
                   "file?)"]


def test_an_integer_too_large_for_a_float_is_a_bad_share_not_a_crash():
    table = {"columns": COLS, "data": [GOOD, [1, "token", 10 ** 400] + GOOD[3:]]}
    notes: list[str] = []
    assert not rows_ok(table) and checked_rows(table, "p.json", notes)["data"] == [GOOD]
    assert "row 1: share=1000" in notes[0] and "is not a finite number" in notes[0]


def test_every_bad_row_is_named_up_to_a_few():
    bad = [[1, "token", "abc"] + GOOD[3:], [1, "token", 0.1, "3"] + GOOD[4:], [1, "token", math.inf] + GOOD[3:]]
    notes: list[str] = []
    checked_rows({"columns": COLS, "data": [GOOD, *bad] + [bad[0]] * 6}, "p.json", notes)
    assert notes == ["p.json: 9 row(s) left out (row 1: share='abc' is not a finite number; row 2: position='3' is "
                     "not an integer; row 3: share=inf is not a finite number; row 4: share='abc' is not a finite "
                     "number; row 5: share='abc' is not a finite number; +4 more; a hand-edited or damaged file?)"]


def test_every_copy_of_a_repeated_column_is_checked():
    """A hand-made table with ``share`` (or ``step``, ``sample_id``) twice: the ledger reads the last copy, as a
    dict would; only the first was checked, and "abc" there crashed the sums (held-out tester, stop 63)."""
    cols = ["step", "share", "sample_id", "share", "step"]
    good, bad = [5, 0.5, "a" * 16, 0.5, 5], [5, 0.5, "b" * 16, "abc", 5]
    table = {"columns": cols, "data": [good, bad, [5, 0.5, "c" * 16, 0.2, "x"]]}
    assert not rows_ok(table)
    notes: list[str] = []
    assert checked_rows(table, "p.json", notes)["data"] == [good]
    assert notes == ["p.json: 2 row(s) left out (row 1: share='abc' is not a finite number; row 2: step='x' is not "
                     "an integer; a hand-edited or damaged file?)"]


def test_a_sample_id_that_is_no_fingerprint_is_left_out_named():
    """The blocklist takes 16 lowercase hex characters; a row whose sample_id was something else passed the row
    checks and the export refused the whole file, a traceback (held-out tester, stop 63). An empty one is no id."""
    cols = ["step", "share", "sample_id"]
    rows = [[5, 0.5, "a" * 16], [5, 0.2, "ABCDEF0123456789"], [5, 0.1, "xyz"], [5, 0.1, ""], [5, 0.1, None]]
    notes: list[str] = []
    assert not rows_ok({"columns": cols, "data": rows}) and rows_ok({"columns": cols, "data": [rows[0], *rows[3:]]})
    assert checked_rows({"columns": cols, "data": rows}, "p.json", notes)["data"] == [rows[0], *rows[3:]]
    assert notes == ["p.json: 2 row(s) left out (row 1: sample_id='ABCDEF0123456789' is not a 16-hex sample "
                     "fingerprint; row 2: sample_id='xyz' is not a 16-hex sample fingerprint; a hand-edited or "
                     "damaged file?)"]
