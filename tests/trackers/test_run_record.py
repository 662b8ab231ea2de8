"""``trackers/run_record``: ``<run dir>/tracker/<backend>.json`` merged field by field, read back as
written (checked by reading the JSON file itself), never raising into training, and whole under
concurrent updates."""
from __future__ import annotations

import json
import math
import threading
import warnings
from pathlib import Path

import pytest

from gradloc_track.trackers.spool import decode
from gradloc_track.trackers.run_record import (read_backend_record, read_run_views, record_path, record_run,
                                               update_run_record)


def on_disk(run_dir: Path, backend: str) -> dict:
    return json.loads((run_dir / "tracker" / f"{backend}.json").read_text(encoding="utf-8"))


def test_the_record_lives_under_tracker_named_by_backend(tmp_path):
    assert record_path(tmp_path, "mlflow") == tmp_path / "tracker" / "mlflow.json"
    assert record_path(str(tmp_path), "wandb") == tmp_path / "tracker" / "wandb.json"


def test_updates_merge_field_by_field_and_name_the_backend(tmp_path):
    assert update_run_record(tmp_path, "mlflow", spec={"experiment": "e"})
    assert update_run_record(tmp_path, "mlflow", run={"run_id": "r1"})
    assert update_run_record(tmp_path, "mlflow", status="FINISHED", run={"run_id": "r2"})  # a field is replaced whole
    assert on_disk(tmp_path, "mlflow") == {"spec": {"experiment": "e"}, "run": {"run_id": "r2"},
                                           "status": "FINISHED", "backend": "mlflow"}
    assert read_backend_record(tmp_path, "mlflow") == on_disk(tmp_path, "mlflow")


def test_values_are_stored_json_safe(tmp_path):
    update_run_record(tmp_path, "local", spec={"dir": tmp_path / "x", "lr": float("nan"), "n": 3})
    spec = on_disk(tmp_path, "local")["spec"]
    assert spec["dir"] == str(tmp_path / "x") and spec["n"] == 3
    assert math.isnan(decode(spec["lr"]))  # a NaN is tagged (strict JSON has none), never dropped


def test_a_missing_or_damaged_record_reads_as_empty(tmp_path):
    assert read_backend_record(tmp_path, "mlflow") == {}
    (tmp_path / "tracker").mkdir()
    (tmp_path / "tracker" / "mlflow.json").write_text("{half a rec")
    assert read_backend_record(tmp_path, "mlflow") == {}
    assert update_run_record(tmp_path, "mlflow", run={"run_id": "r"})  # a damaged record is rewritten whole
    assert on_disk(tmp_path, "mlflow") == {"run": {"run_id": "r"}, "backend": "mlflow"}


def test_an_unwritable_run_dir_is_false_not_an_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert update_run_record(blocker, "mlflow", run={"run_id": "r"}) is False
    with pytest.warns(UserWarning, match=r"could not record the mlflow run in .*file/tracker/mlflow\.json"):
        record_run(blocker, "mlflow", {"run_id": "r"})


def test_record_run_keeps_the_view_without_empty_fields_and_needs_a_run_dir(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        record_run(None, "mlflow", {"run_id": "r"})  # no run dir: nothing to do, nothing said
    record_run(tmp_path, "mlflow", {"run_id": "r", "experiment_id": "1", "run_name": None})
    assert on_disk(tmp_path, "mlflow")["view"] == {"run_id": "r", "experiment_id": "1"}


def test_views_of_every_backend_and_only_records_that_have_one(tmp_path):
    assert read_run_views(tmp_path) == {} and read_run_views(tmp_path / "absent") == {}
    record_run(tmp_path, "wandb", {"path": "me/p/x", "offline": True})
    record_run(tmp_path, "mlflow", {"run_id": "r"})
    update_run_record(tmp_path, "local", spec={"dir": "."})  # no view yet
    (tmp_path / "tracker" / "broken.json").write_text("[")
    (tmp_path / "tracker" / "list.json").write_text("[1, 2]")
    (tmp_path / "tracker" / "notes.txt").write_text("{}")
    assert read_run_views(tmp_path) == {"mlflow": {"run_id": "r"}, "wandb": {"path": "me/p/x", "offline": True}}


def test_concurrent_updates_of_one_record_all_land(tmp_path):
    """Writers on several threads (the async writer, the main thread): each field they set is kept."""
    start = threading.Barrier(8)

    def write(i: int) -> None:
        start.wait()
        for j in range(5):
            update_run_record(tmp_path, "mlflow", **{f"f{i}_{j}": i * 10 + j})

    threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    rec = on_disk(tmp_path, "mlflow")
    expected = {f"f{i}_{j}": i * 10 + j for i in range(8) for j in range(5)}
    assert {k: v for k, v in rec.items() if k != "backend"} == expected
