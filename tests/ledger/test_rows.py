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
                     "a hand-edited or damaged file?)"]
    one: list[str] = []
    checked_rows({"columns": COLS, "data": [[1, "token", "abc"] + GOOD[3:]]}, "p.json", one)
    assert one == ["p.json: 1 row(s) left out (row 0: share='abc' is not a finite number; a hand-edited or damaged "
                   "file?)"]
