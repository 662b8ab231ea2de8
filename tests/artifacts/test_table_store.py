"""Reading a table back (``artifacts/table_store.py``): parts in step order after the legacy file,
other files ignored, an unreadable part skipped with a warning."""
from __future__ import annotations

import json

import pytest

from gradloc_track.artifacts.table_store import read_table, table_parts


def test_parts_in_step_order_and_a_broken_part_skipped(tmp_path):
    folder = tmp_path / "spikes" / "tokens"
    folder.mkdir(parents=True)
    for step in (100, 20, 3):
        (folder / f"step_{step:06d}.json").write_text(json.dumps({"columns": ["step"], "data": [[step]]}))
    (folder / "step_000007.csv").write_text("step\n7\n")  # the MLflow CSV twin: not a part
    (folder / "notes.json").write_text("{}")
    (tmp_path / "spikes" / "tokens.json").write_text(json.dumps({"columns": ["step"], "data": [[1]]}))  # legacy
    assert [p.name for p in table_parts(tmp_path, "spikes/tokens")] == \
        ["tokens.json", "step_000003.json", "step_000020.json", "step_000100.json"]
    (folder / "step_000050.json").write_text("[" * 200_000 + "]" * 200_000)  # nested too deeply to be one
    with pytest.warns(RuntimeWarning, match="step_000050.json"):
        assert read_table(tmp_path) == {"columns": ["step"], "data": [[1], [3], [20], [100]]}
    # a part with rows that are no rows keeps its others (the report's and the ledger's reading: one parser)
    (folder / "step_000050.json").write_text(json.dumps({"columns": ["step"], "data": [[50], 7, [51, 1], [52]]}))
    with pytest.warns(RuntimeWarning, match=r"step_000050.json: 2 row\(s\) without exactly 1 cells were left out"):
        assert read_table(tmp_path) == {"columns": ["step"], "data": [[1], [3], [20], [50], [52], [100]]}
    assert table_parts(tmp_path, "spikes/events") == []


def _strict(text: str):
    """JSON as a strict parser (JavaScript's JSON.parse, MLflow's viewer) reads it: no bare NaN / Infinity."""
    def refuse(name):
        raise ValueError(f"bare {name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_a_non_finite_step_is_strict_json_and_reads_back_as_numbers(tmp_path, mlflow_store):
    """A NaN step's grad norm and an infinite z-score were written as bare NaN / Infinity: no strict parser
    opened the part of exactly the step a person wants to read (held-out tester round 8). Strings now, the
    floats again when read back; a token whose text is "NaN" stays text. The local run dir and a real MLflow
    store alike."""
    import math

    import mlflow

    from gradloc_track.trackers import LocalTracker
    from gradloc_track.trackers.mlflow_tracker import MlflowTracker

    columns = ["step", "token", "share", "grad_norm", "z", "advantage", "source", "lang"]
    rows = [[7, "NaN", 0.5, float("nan"), float("inf"), -float("inf"), "NaN", "Infinity"],
            [7, "Infinity", None, 2.0, 3.5, 1.0, "web", None]]  # "lang": text alone in its column stays text
    local = LocalTracker(tmp_path / "run")
    local.log_table("spikes/tokens", columns, rows, step=7)
    local.finish()
    tracker = MlflowTracker(tracking_uri=mlflow_store.uri, experiment_name="nonfinite")
    tracker.log_table("spikes/tokens", columns, rows, step=7)
    tracker.finish()
    remote = tmp_path / "remote"
    mlflow.artifacts.download_artifacts(run_id=tracker.run_id, artifact_path="spikes/tokens", dst_path=str(remote),
                                        tracking_uri=mlflow_store.uri)
    for root, part in ((tmp_path / "run", tmp_path / "run" / "spikes" / "tokens" / "step_000007.json"),
                       (remote, remote / "tokens" / "step_000007.json")):
        assert _strict(part.read_text())["data"][0][3:6] == ["NaN", "Infinity", "-Infinity"]
    got = read_table(tmp_path / "run")
    assert got["columns"] == columns
    first, second = got["data"]
    assert first[:3] == [7, "NaN", 0.5] and math.isnan(first[3]) and first[4:6] == [math.inf, -math.inf]
    assert first[6:] == ["NaN", "Infinity"] and second == rows[1]  # text stays text
    one = tmp_path / "one"  # a one-row part of user text only (reviewer round 9: it was guessed to be numbers)
    local = LocalTracker(one)
    local.log_table("spikes/tokens", ["step", "source"], [[9, "NaN"]], step=9)
    local.finish()
    assert read_table(one)["data"] == [[9, "NaN"]]


def test_a_column_a_later_part_brings_is_kept():
    """A run resumed with a newer version (its parts gain ``data_fault``) or a ``rank`` first seen later: the merged
    table has every part's columns, None where a part had none (review, stop 56: the first part's columns were the
    table's, so the ledger never saw the later parts' ``data_fault``)."""
    from gradloc_track.artifacts.table_store import merge_tables

    parts = [{"columns": ["step", "share"], "data": [[1, 0.5]]},
             {"columns": ["step", "share", "data_fault"], "data": [[9, 0.4, False]]},
             {"columns": ["share", "step"], "data": [[0.3, 12]]}]
    assert merge_tables(parts) == {"columns": ["step", "share", "data_fault"],
                                   "data": [[1, 0.5, None], [9, 0.4, False], [12, 0.3, None]]}
