"""The CSV view of a table part: every cell survives a CSV reader, text exactly as logged."""
from __future__ import annotations

import csv
import io
import math

from gradloc_track.trackers.csv_view import csv_text


def test_cells_read_back_with_a_csv_reader():
    hostile = "<script>alert(1)</script>, \"quoted\"\nnext line"
    rows = [[7, hostile, 0.123456789, None, ["h.0", 1]], [8, "\u00e2\u20ac\u2122", math.inf, True, {"a": 1}]]
    text = csv_text(["step", "token", "share", "note", "extra"], rows)
    read = list(csv.reader(io.StringIO(text)))
    assert read[0] == ["step", "token", "share", "note", "extra"]
    assert read[1] == ["7", hostile, "0.123457", "", '["h.0", 1]']  # floats to 6 digits, None empty
    assert read[2] == ["8", "\u00e2\u20ac\u2122", "inf", "True", '{"a": 1}']
    assert len(read) == 3  # the newline inside a cell is quoted, not a row break


def test_no_rows_is_the_header_alone():
    assert csv_text(["step", "token"], []) == "step,token\n"
