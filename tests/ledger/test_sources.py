"""Which runs a ledger reads, and as what: run identity (never the folder's name), folders searched,
sources that hold no run refused, damaged rows left out with a note naming the file."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from gradloc_track.cli import main
from gradloc_track.ledger.sources import RunTable, tell_apart

COLS = ["step", "level", "token", "share", "sample", "position", "end", "sample_id", "source"]
SID = "aaaaaaaaaaaaaaaa"


def run_dir(root: Path, rel: str, rows: list[list], step: int = 100) -> Path:
    """A run dir as the local tracker writes it: one culprit-table part per event."""
    d = root / rel
    (d / "spikes" / "tokens").mkdir(parents=True)
    (d / "spikes" / "tokens" / f"step_{step:06d}.json").write_text(json.dumps({"columns": COLS, "data": rows}))
    return d


def ledger(tmp_path: Path, *sources, code: int = 0) -> dict:
    out = tmp_path / "ledger"
    assert main(["culprits", *map(str, sources), "-o", str(out)]) == code
    return json.loads((out / "culprits.json").read_text()) if code in (0, 1) else {}


def test_two_runs_with_one_folder_name_are_two_runs(tmp_path, capsys):
    row = [100, "sample", "the same document", 0.82, 1, 0, 64, SID, "web"]
    a, b = run_dir(tmp_path, "sweepA/0_clip=adagc", [row]), run_dir(tmp_path, "sweepB/0_clip=adagc", [row])
    doc = ledger(tmp_path, a, b)
    assert doc["runs"] == ["sweepA/0_clip=adagc", "sweepB/0_clip=adagc"] and doc["spike_events"] == 2
    (s,) = doc["samples"]
    assert (s["blamed"], s["runs"], s["max_share"]) == (2, doc["runs"], 0.82)  # not 1x in 1 run at 164%
    assert "blamed 2x in 2 run(s), max share 82%" in capsys.readouterr().out
    assert doc["run_ids"] == [str(a.resolve()), str(b.resolve())]
    assert ledger(tmp_path, tmp_path)["runs"] == doc["runs"]  # the folder holding both: searched, same answer


def test_runs_of_trackers_that_share_a_name_are_told_apart_by_id():
    runs = [RunTable("seed0", "0123456789abcdef" + "0" * 16, {}), RunTable("seed0", "0123456789abcdef" + "1" * 16, {}),
            RunTable("seed1", "f" * 32, {}), RunTable("seed0", "/x/a/seed0", {})]
    tell_apart(runs)  # the ids agree on 16 characters: the whole id tells them apart
    assert [r.name for r in runs] == [f"seed0#{runs[0].run_id}", f"seed0#{runs[1].run_id}", "seed1", "a/seed0"]
    short = [RunTable("seed0", "a" * 32, {}), RunTable("seed0", "b" * 32, {})]
    tell_apart(short)
    assert [r.name for r in short] == ["seed0#aaaaaaaa", "seed0#bbbbbbbb"]


@pytest.mark.parametrize("what", ["empty", "docs", "file"])
def test_a_source_that_is_no_run_dir_and_holds_none_is_an_error(tmp_path, capsys, what):
    src = tmp_path / what
    if what == "file":
        src.write_text("not a run")
    else:
        src.mkdir()
        if what == "docs":
            (src / "ledger.md").write_text("# docs")
            (src / "img").mkdir()
    out = tmp_path / "ledger"
    assert main(["culprits", str(src), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "a run dir is the folder the app printed" in err or "no such run directory" in err
    assert not out.exists()  # no empty ledger files


def test_the_spikes_folder_the_console_prints_is_its_run(tmp_path):
    a = run_dir(tmp_path, "runs/2026-01-01_00-00-00", [[100, "token", "x", 0.5, 0, 3, 4, SID, "web"]])
    assert ledger(tmp_path, a / "spikes")["run_ids"] == [str(a.resolve())]
    assert main(["report", str(a / "spikes"), "-o", str(tmp_path / "r.html")]) == 0


def test_a_run_with_no_spike_is_a_note_not_an_error(tmp_path, capsys):
    quiet = tmp_path / "runs" / "quiet"
    quiet.mkdir(parents=True)
    (quiet / "metrics.jsonl").write_text('{"step": 0, "metrics": {}}\n')
    loud = run_dir(tmp_path, "runs/loud", [[100, "token", "x", 0.5, 0, 3, 4, SID, "web"]])
    doc = ledger(tmp_path, tmp_path / "runs")
    assert doc["run_ids"] == [str(loud.resolve())] and any("no spike events" in n for n in doc["notes"])


def test_sources_with_no_run_to_read_are_status_2_and_write_nothing(tmp_path, capsys):
    quiet = tmp_path / "runs" / "quiet"
    quiet.mkdir(parents=True)
    (quiet / "metrics.jsonl").write_text('{"step": 0, "metrics": {}}\n')
    ledger(tmp_path, tmp_path / "runs", code=2)
    err = capsys.readouterr().err
    assert "quiet: no spike events" in err and "has a culprit table" in err and "nothing was written" in err
    assert not (tmp_path / "ledger").exists()


def test_damaged_rows_and_parts_are_left_out_naming_the_file(tmp_path, capsys):
    good = [100, "token", "x", 0.5, 0, 3, 4, SID, "web"]
    a = run_dir(tmp_path, "a", [good, [101, "token", "x", "abc", 0, 3, 4, SID, "web"],
                                [102, "token", "x", 0.1, 0, [3], 4, SID, "web"], [True, "token", "x", 0.1, 0, 3, 4,
                                                                                  SID, "web"]])
    deep = a / "spikes" / "tokens" / "step_000200.json"
    deep.write_text("[" * 200_000 + "]" * 200_000)  # 200k levels deep
    doc = ledger(tmp_path, a, code=1)  # a part unreadable: the ledger is written from the rest, and not whole (stop 54)
    assert doc["spike_events"] == 1 and doc["samples"][0]["blamed"] == 1
    notes = " | ".join(doc["notes"])
    assert "spikes/tokens/step_000100.json: 3 row(s) left out (row 1: share='abc' is not a finite number" in notes
    assert "step_000200.json is nested too deeply" in notes
    assert "Traceback" not in capsys.readouterr().err


def test_output_paths_that_are_files_or_folders(tmp_path, capsys):
    a = run_dir(tmp_path, "a", [[100, "token", "x", 0.5, 0, 3, 4, SID, "web"]])
    taken = tmp_path / "taken.txt"
    taken.write_text("mine")
    assert main(["culprits", str(a), "-o", str(taken)]) == 2
    assert "is a file; the ledger is a folder" in capsys.readouterr().err and taken.read_text() == "mine"
    folder = tmp_path / "pages"
    folder.mkdir()
    assert main(["report", str(a), "-o", str(folder)]) == 0 and (folder / "spike_report.html").is_file()
    assert main(["report", str(a), "-o", str(taken / "r.html")]) == 2
    assert "cannot write" in capsys.readouterr().err


@pytest.mark.slow  # a real W&B offline run: 10-40 s here (run_key's W&B identity is unit-tested in test_run_dirs)
def test_a_wandb_run_reached_by_its_run_dir_and_its_wandb_folder_is_one_run(tmp_path):
    from gradloc_track.artifacts import SpikeArtifactWriter
    from gradloc_track.config import TrackerConfig
    from gradloc_track.trackers import make_tracker
    from gradloc_track.trackers.run_record import read_run_views

    from ..artifacts.cases import make_case

    events, result, ctx = make_case(T=40, culprits=((0, 5),), pad_from=30)
    cfg = TrackerConfig(kind="wandb", run_name="wb-run")
    cfg.wandb.mode = "offline"
    cfg.wandb.dir = str(tmp_path / "wandb-root")
    run = tmp_path / "runs" / "b"
    tracker = make_tracker(cfg, run_dir=run)
    SpikeArtifactWriter(tracker, run, window=8).write(9, events, result, ctx)
    tracker.finish()
    view = read_run_views(run)["wandb"]
    doc = ledger(tmp_path, run, view["dir"])
    assert doc["run_ids"] == [f"wandb:{view['path'].rsplit('/', 1)[-1]}"] and doc["spike_events"] == 1


def test_one_bad_cell_in_a_wandb_run_drops_one_row_named(tmp_path, capsys, monkeypatch):
    """W&B refuses a table whose column mixes types: the run's table must still reach it whole, and the
    ledger then leaves out the bad rows only, each named, every event kept (and --by still works)."""
    from gradloc_track.config import TrackerConfig
    from gradloc_track.trackers import make_tracker

    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-root"))
    run = tmp_path / "runs" / "w"
    tracker = make_tracker(TrackerConfig(kind="wandb"), run_dir=run)
    good = [[s, "token", "x", 0.5, 0, 3, 4, f"{s:016x}", "web"] for s in (100, 200, 300)]
    bad = {100: [100, "token", "y", "abc", 1, 3, 4, "b" * 16, "web"],
           200: [200, "token", "y", 0.2, 1, 3, 4, ["c" * 16], "web"],
           300: ["300", "token", "y", 0.2, 1, 3, 4, SID, "web"]}
    for row in good:
        tracker.log_metrics({"loss": 1.0}, row[0])
        tracker.log_table("spikes/tokens", COLS, [row, bad[row[0]]], row[0])
    tracker.finish("success")
    assert main(["culprits", str(run), "--by", "source", "-o", str(tmp_path / "ledger")]) == 0
    doc = json.loads((tmp_path / "ledger" / "culprits.json").read_text())
    assert doc["spike_events"] == 3 and sorted(s["sample_id"] for s in doc["samples"]) == [
        f"{s:016x}" for s in (100, 200, 300)]
    notes = " | ".join(doc["notes"])
    assert all(f in notes for f in ("share='abc' is not a finite number", "sample_id=['cccccccccccccccc'] is not a "
                                    "16-hex sample fingerprint", "step='300' is not an integer")), notes
    assert "source web caused 3 of 3 spike(s)" in capsys.readouterr().out


def test_by_a_column_every_row_of_which_was_left_out_says_so(tmp_path, capsys):
    a = run_dir(tmp_path, "a", [[100, "token", "x", "abc", 0, 3, 4, SID, "web"]])
    # (its only row left out, the ledger is empty: nothing written, exit 2; held-out tester, stop 63: exit 0)
    assert main(["culprits", str(a), "--by", "source", "-o", str(tmp_path / "ledger")]) == 2
    out = capsys.readouterr()
    assert "no run's culprit table has that column" not in out.err and "1 row(s) left out" in out.err
    assert "hold no row the ledger can use" in out.err and not (tmp_path / "ledger").exists()


def test_parts_without_a_step_column_are_one_event_each_and_a_ledger_of_no_usable_row_is_no_ledger(tmp_path, capsys):
    """Held-out tester, stop 63: a hand-made table without ``step`` merged its parts into one spike event (its two
    shares summed to 110%); a run whose parts hold no usable row wrote an empty ledger with exit 0."""
    run = tmp_path / "run"
    (run / "spikes" / "tokens").mkdir(parents=True)
    for step, share in ((3, 0.8), (4, 0.3)):
        (run / "spikes" / "tokens" / f"step_{step:06d}.json").write_text(json.dumps(
            {"columns": ["level", "token", "share", "sample_id"], "data": [["sample", "x", share, SID]]}))
    assert main(["culprits", str(run), "-o", str(tmp_path / "l")]) == 0
    doc = json.loads((tmp_path / "l" / "culprits.json").read_text())
    assert doc["spike_events"] == 2 and doc["samples"][0]["blamed"] == 2 and doc["samples"][0]["max_share"] == 0.8
    for part in (run / "spikes" / "tokens").iterdir():
        part.write_text(json.dumps({"columns": ["step", "level", "share", "sample_id"], "data": []}))
    assert main(["culprits", str(run), "-o", str(tmp_path / "l2")]) == 2
    assert "hold no row the ledger can use" in capsys.readouterr().err and not (tmp_path / "l2").exists()
    for part in (run / "spikes" / "tokens").iterdir():  # events the data did not make: an answer, not a failure
        part.write_text(json.dumps({"columns": ["step", "level", "share", "sample_id", "data_fault"],
                                    "data": [[int(part.stem[5:]), "sample", 0.9, SID, False]]}))
    assert main(["culprits", str(run), "-o", str(tmp_path / "l3")]) == 0
    doc = json.loads((tmp_path / "l3" / "culprits.json").read_text())
    assert doc["samples"] == [] and "2 culprit row(s) of 2 spike event(s) the data did not make" in doc["notes"][0]


def test_a_tracker_both_run_counts_once_by_any_two_of_its_identities(tmp_path, sqlite_uri, monkeypatch, capsys):
    """Held-out tester, stop 63: a ``tracker=both`` run given by its run dir and its W&B folder, or by its MLflow
    run and that folder, was two runs ("blamed 2x"). A real MLflow store and a real W&B offline run."""
    from gradloc_track.config import TrackerConfig
    from gradloc_track.trackers import make_tracker

    monkeypatch.delenv("WANDB_DIR", raising=False)  # W&B's folder inside the run dir, as the demo has it
    cfg = TrackerConfig(kind="both")
    cfg.mlflow.tracking_uri = sqlite_uri
    run = tmp_path / "run"
    tracker = make_tracker(cfg, run_dir=run, run_name="both")
    tracker.log_table("spikes/tokens", COLS, [[100, "sample", "junk", 0.9, 0, 0, 9, SID, "web"]], 100)
    tracker.finish("success")
    (folder,) = (run / "wandb").glob("offline-run-*")
    mlflow_id = json.loads((run / "tracker" / "mlflow.json").read_text())["view"]["run_id"]
    for sources in ([run, folder], [folder, run], [mlflow_id, folder], [folder, mlflow_id], [run, mlflow_id]):
        out = tmp_path / "l"
        assert main(["culprits", *map(str, sources), "--tracking-uri", sqlite_uri, "-o", str(out)]) == 0, sources
        doc = json.loads((out / "culprits.json").read_text())
        assert (len(doc["runs"]), doc["spike_events"], doc["samples"][0]["blamed"]) == (1, 1, 1), sources
        err = capsys.readouterr().err
        # a second identity of the same run is said; the same id twice (a dir and its own MLflow run) is not
        assert ("counted once" in err) == (sources != [run, mlflow_id]), (sources, err)


def test_a_tracker_both_run_counts_once_by_its_mlflow_run_and_a_w_and_b_folder_kept_elsewhere(
        tmp_path, sqlite_uri, monkeypatch, capsys):
    """Stop 63 left this pair counted twice: with ``WANDB_DIR`` outside the run dir neither the MLflow run nor the
    W&B folder named the other. Both now carry one identity (an MLflow tag, a file in the W&B run's files). A run of
    one backend carries none, and two ``tracker=both`` runs stay two."""
    from gradloc_track.config import TrackerConfig
    from gradloc_track.trackers import make_tracker
    from gradloc_track.trackers.naming import RUN_FILE, SAME_RUN_TAG
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-root"))
    cfg = TrackerConfig(kind="both")
    cfg.mlflow.tracking_uri = sqlite_uri
    ids, folders = [], []
    for name in ("a", "b"):
        run = tmp_path / name
        tracker = make_tracker(cfg, run_dir=run, run_name=name)
        tracker.log_table("spikes/tokens", COLS, [[100, "sample", "junk", 0.9, 0, 0, 9, SID, "web"]], 100)
        tracker.finish("success")
        ids.append(json.loads((run / "tracker" / "mlflow.json").read_text())["view"]["run_id"])
        folders.append(Path(json.loads((run / "tracker" / "wandb.json").read_text())["view"]["dir"]))
        assert not folders[-1].is_relative_to(run)  # W&B kept its folder elsewhere
    same = [MlflowClient(sqlite_uri).get_run(i).data.tags[SAME_RUN_TAG] for i in ids]
    assert same[0] != same[1]
    assert [json.loads((f / "files" / RUN_FILE).read_text())["same_run"] for f in folders] == same
    for sources in ([ids[0], folders[0]], [folders[0], ids[0]]):
        out = tmp_path / "l"
        assert main(["culprits", *map(str, sources), "--tracking-uri", sqlite_uri, "-o", str(out)]) == 0, sources
        doc = json.loads((out / "culprits.json").read_text())
        assert (len(doc["runs"]), doc["spike_events"], doc["samples"][0]["blamed"]) == (1, 1, 1), sources
        assert "counted once" in capsys.readouterr().err
    # the other run's MLflow run and this run's W&B folder are two runs
    assert main(["culprits", ids[1], str(folders[0]), "--tracking-uri", sqlite_uri, "-o", str(tmp_path / "l2")]) == 0
    doc = json.loads((tmp_path / "l2" / "culprits.json").read_text())
    assert (len(doc["runs"]), doc["samples"][0]["blamed"]) == (2, 2)
    # one backend: no shared identity to record
    single = TrackerConfig(kind="mlflow")
    single.mlflow.tracking_uri = sqlite_uri
    tracker = make_tracker(single, run_dir=tmp_path / "c", run_name="c")
    tracker.finish("success")
    only = json.loads((tmp_path / "c" / "tracker" / "mlflow.json").read_text())["view"]["run_id"]
    assert SAME_RUN_TAG not in MlflowClient(sqlite_uri).get_run(only).data.tags
