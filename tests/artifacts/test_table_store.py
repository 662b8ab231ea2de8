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
    assert table_parts(tmp_path, "spikes/events") == []
