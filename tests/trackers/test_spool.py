"""The spool file (``trackers/spool.py``): exact round trip of every value type; a spool that cannot
be written never raises and reports the loss once."""
from __future__ import annotations

import math
import warnings

from gradloc_track.trackers import files, read_spool
from gradloc_track.trackers.spool import Spool

VALUES = {"token": "inf", "tok2": "nan", "tok3": "-inf", "x": math.inf, "y": -math.inf, "n": 3, "big": 2 ** 60,
          "b": True, "none": None, "f": 0.1, "nested": [[1, "inf", 2.5], {"k": "NaN"}], "tag": {"__x": 1}}


def test_spool_round_trips_every_value_type_exactly(tmp_path):
    spool = Spool(tmp_path / "s.jsonl", "b")
    spool.write("log_table", ["k", list(VALUES), [list(VALUES.values()) + [math.nan]]], "err")
    (rec,) = read_spool(tmp_path / "s.jsonl")
    key, cols, (row,) = rec["args"]
    assert cols == list(VALUES) and row[:-1] == list(VALUES.values())
    assert [type(v) for v in row[:-1]] == [type(v) for v in VALUES.values()]  # ints stay ints, "inf" a str
    assert isinstance(row[-1], float) and math.isnan(row[-1])


def test_spool_write_failure_is_reported_once(tmp_path, monkeypatch):
    def full(path, line):
        raise OSError(28, "No space left on device (injected)")
    monkeypatch.setattr(files, "append_line", full)
    spool = Spool(tmp_path / "s.jsonl", "b")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(5):
            assert spool.write("log_metrics", [{"x": 1.0}, i], "down") is False
    assert spool.dropped == 5 and len([w for w in caught if "LOST" in str(w.message)]) == 1
