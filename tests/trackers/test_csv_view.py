"""The CSV view of a table part: every cell survives a CSV reader; text is shown as the pages show it
(controls visible), a cell a spreadsheet would evaluate is defused, numbers stay numbers."""
from __future__ import annotations

import csv
import io
import math

import pytest

from gradloc_track.trackers.csv_view import csv_text


def test_cells_read_back_with_a_csv_reader():
    hostile = "<script>alert(1)</script>, \"quoted\"\nnext line"
    rows = [[7, hostile, 0.123456789, None, ["h.0", 1]], [8, "\u00e2\u20ac\u2122", math.inf, True, {"a": 1}]]
    text = csv_text(["step", "token", "share", "note", "extra"], rows)
    read = list(csv.reader(io.StringIO(text)))
    assert read[0] == ["step", "token", "share", "note", "extra"]
    # floats to 6 digits, None empty, the newline shown (a C0 control, as on the pages)
    assert read[1] == ["7", hostile.replace("\n", "\u21b5"), "0.123457", "", '["h.0", 1]']
    assert read[2] == ["8", "\u00e2\u20ac\u2122", "inf", "True", '{"a": 1}']
    assert len(read) == 3


@pytest.mark.parametrize("cell, shown", [("=HYPERLINK(\"http://x\")", "'=HYPERLINK(\"http://x\")"), ("+1+2", "'+1+2"),
                                         ("-2+3", "'-2+3"), ("@SUM(A1)", "'@SUM(A1)"),
                                         ("\t=1", "\u2192=1"), ("\r=1", "\u240d=1")])  # OWASP's tab/CR: shown
def test_a_cell_a_spreadsheet_would_evaluate_is_text(cell, shown):
    read = list(csv.reader(io.StringIO(csv_text([cell], [[cell, cell]]))))
    assert read == [[shown], [shown, shown]]


def test_numbers_stay_numbers_and_controls_are_visible():
    rows = [[-3, -0.5, "a\u202eb\x00c\u2066", "-", ""]]
    read = list(csv.reader(io.StringIO(csv_text(["a", "b", "c", "d", "e"], rows))))
    assert read[1] == ["-3", "-0.5", "a\\u202eb\\x00c\\u2066", "'-", ""]


def test_no_rows_is_the_header_alone():
    assert csv_text(["step", "token"], []) == "step,token\n"
