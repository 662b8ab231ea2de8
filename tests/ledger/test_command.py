"""``ledger/command``: ``gradloc-track culprits``'s options (share and seconds parsed at their
boundaries, the documented defaults), what it prints, and its exit status: 0 written (and
delivered), 2 a source or an option that cannot be used, 1 a ledger run that did not reach the
tracker (the message names ``replay``)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from gradloc_track.ledger import command
from gradloc_track.ledger.export import SHARE_FLOOR
from gradloc_track.ledger.publish import Delivery

COLS = ["step", "level", "token", "share", "sample", "position", "end", "sample_id", "dataset_index"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gradloc-track")
    command.add_parser(p.add_subparsers(dest="command"))
    return p


def run_dir(root: Path, rows: list[list]) -> Path:
    """A run dir as the local tracker writes it: one culprit-table part for the spike at step 100."""
    d = root / "run"
    (d / "spikes" / "tokens").mkdir(parents=True)
    (d / "spikes" / "tokens" / "step_000100.json").write_text(json.dumps({"columns": COLS, "data": rows}))
    return d


ROWS = [[100, "sample", "bad doc", 0.8, 1, 0, 8, "a" * 16, 11], [100, "sample", "other", 0.1, 0, 0, 8, "b" * 16, 10]]


@pytest.mark.parametrize("text,value", [("0", 0.0), ("1", 1.0), ("0.05", 0.05), ("1e-3", 0.001)])
def test_a_share_is_a_fraction_from_0_to_1(text, value):
    assert command._share(text) == value


@pytest.mark.parametrize("text", ["1.5", "-0.1", "five", "nan", "inf", ""])
def test_anything_else_is_not_a_share(text):
    with pytest.raises(argparse.ArgumentTypeError, match=r"is not a share: use a fraction between 0 and 1"):
        command._share(text)


@pytest.mark.parametrize("text,ok", [("60", True), ("0.5", True), ("0", False), ("-1", False), ("inf", False),
                                     ("nan", False), ("soon", False)])
def test_seconds_are_positive_and_finite(text, ok):
    if ok:
        assert command._seconds(text) == float(text)
    else:
        with pytest.raises(argparse.ArgumentTypeError, match="is not a number of seconds"):
            command._seconds(text)


def test_the_documented_defaults():
    a = parser().parse_args(["culprits", "exp"])
    assert (a.sources, a.output_dir, a.min_blamed, a.min_share, a.index_column, a.log_to, a.log_timeout,
            a.experiment, a.project, a.export_blocklist, a.by, a.tracking_uri) == \
        (["exp"], "culprit_ledger", 1, SHARE_FLOOR, "dataset_index", None, 60.0, "gradloc-track", "gradloc-track",
         None, None, None)
    with pytest.raises(SystemExit):
        parser().parse_args(["culprits"])  # a source is required
    with pytest.raises(SystemExit):
        parser().parse_args(["culprits", "exp", "--log-to", "neptune"])  # no such backend (tensorboard now is one)


def test_a_ledger_is_written_and_summarised(tmp_path, capsys):
    args = parser().parse_args(["culprits", str(run_dir(tmp_path, ROWS)), "-o", str(tmp_path / "led")])
    assert command.run(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "1 run(s), 1 spike event(s) with culprits, 2 blamed sample(s)"
    assert out[1] == f"  {'a' * 16}  blamed 1x in 1 run(s), max share 80%  'bad doc'"
    assert out[-1].startswith("wrote ") and str(tmp_path / "led" / "culprits.csv") in out[-1]
    assert json.loads((tmp_path / "led" / "culprits.json").read_text())["samples"][0]["sample_id"] == "a" * 16


def test_an_output_that_is_a_file_or_a_source_that_is_no_run_is_status_2(tmp_path, capsys):
    src = run_dir(tmp_path, ROWS)
    taken = tmp_path / "taken"
    taken.write_text("x")
    assert command.run(parser().parse_args(["culprits", str(src), "-o", str(taken)])) == 2
    assert "gradloc-track culprits: -o " in capsys.readouterr().err
    missing = parser().parse_args(["culprits", str(tmp_path / "nowhere"), "-o", str(tmp_path / "o")])
    assert command.run(missing) == 2 and "gradloc-track culprits: " in capsys.readouterr().err


def test_an_unwritable_blocklist_is_status_2_after_the_ledger(tmp_path, capsys):
    args = parser().parse_args(["culprits", str(run_dir(tmp_path, ROWS)), "-o", str(tmp_path / "led"),
                                "--export-blocklist", str(tmp_path / "led" / "culprits.csv" / "b.json")])
    assert command.run(args) == 2
    assert "--export-blocklist" in capsys.readouterr().err and (tmp_path / "led" / "culprits.json").is_file()


def test_the_blocklist_says_what_the_floors_left_out(tmp_path, capsys):
    block = tmp_path / "b.json"
    args = parser().parse_args(["culprits", str(run_dir(tmp_path, ROWS)), "-o", str(tmp_path / "led"),
                                "--export-blocklist", str(block), "--min-share", "0.5"])
    assert command.run(args) == 0 and block.is_file()
    out = capsys.readouterr().out
    assert f"wrote blocklist {block} (1 sample(s); 1 under --min-blamed 1 or --min-share 0.5 left out)" in out
    assert f"train without them with data.blocklist={block}" in out


@pytest.mark.parametrize("where,spooled,code", [({"mlflow": "http://h/#/run"}, 0, 0), ({}, 3, 1),
                                               ({"mlflow": "http://h/#/run"}, 2, 1)])
def test_log_to_maps_the_delivery_to_the_exit_status(tmp_path, capsys, monkeypatch, where, spooled, code):
    """The delivery itself is tested against a real stopped server in test_publish.py; here only what
    the command makes of its outcome."""
    import gradloc_track.ledger.publish as publish

    monkeypatch.setattr(publish, "log_ledger", lambda *a: Delivery(tmp_path / "ledger_run", where, spooled))
    args = parser().parse_args(["culprits", str(run_dir(tmp_path, ROWS)), "-o", str(tmp_path / "led"),
                                "--log-to", "mlflow", "--log-timeout", "5"])
    assert command.run(args) == code
    captured = capsys.readouterr()
    if code == 0:
        assert "logged the ledger to mlflow: http://h/#/run" in captured.out
    else:
        err = captured.err
        assert "did NOT reach mlflow within --log-timeout 5 s" in err and f"its {spooled} record(s) are spooled" in err
        assert f"gradloc-track replay {tmp_path / 'ledger_run'}" in err
        assert ("nothing of it was delivered" if not where else "it was not all delivered") in err


def test_unreadable_culprit_tables_are_no_empty_ledger(tmp_path, capsys):
    """Held-out tester, stop 54: a run whose only culprit table part was truncated gave '1 run(s), 0 spike
    event(s) with culprits', wrote the files and exited 0: an empty ledger that reads as 'nothing blamed'. Now
    such a run is left out (status 2 when it is the only one), a run with one bad part of two is read from the
    other with status 1, and the notes name the file by its place in the run."""
    bad = run_dir(tmp_path / "a", ROWS)
    (bad / "spikes" / "tokens" / "step_000100.json").write_text('{"columns": ["step", "lev')
    assert command.run(parser().parse_args(["culprits", str(bad), "-o", str(tmp_path / "led")])) == 2
    err = capsys.readouterr().err
    assert "spikes/tokens/step_000100.json is not valid JSON" in err
    assert "1 of its 1 culprit table part(s) could not be read" in err and not (tmp_path / "led").exists()
    half = run_dir(tmp_path / "b", ROWS)
    (half / "spikes" / "tokens" / "step_000200.json").write_text("{not json")
    assert command.run(parser().parse_args(["culprits", str(half), "-o", str(tmp_path / "led2")])) == 1
    assert "1 of its 2 culprit table part(s) could not be read" in capsys.readouterr().err
    assert json.loads((tmp_path / "led2" / "culprits.json").read_text())["samples"][0]["sample_id"] == "a" * 16


def test_a_run_dir_whose_tracker_record_is_truncated_is_not_read_as_having_no_spikes(tmp_path, capsys):
    """Held-out tester, stop 54: with tracker/mlflow.json cut short, report said the run 'logged no spike
    events', culprits 'no spike events', and replay sent the spool toward a new run; the record names the run
    where the events are. Each now says the file is damaged and what to do."""
    from gradloc_track.cli import main

    run = tmp_path / "run"
    (run / "tracker").mkdir(parents=True)
    (run / "tracker" / "mlflow.json").write_text('{"backend": "mlflow", "run": {"run_id": "ab')
    assert main(["report", str(run), "-o", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err
    assert "tracker/mlflow.json is not valid JSON" in err and "logged no spike events" not in err
    assert "restore the file" in err
    assert main(["culprits", str(run), "-o", str(tmp_path / "led")]) == 2
    err = capsys.readouterr().err
    assert "tracker/mlflow.json is not valid JSON" in err and not (tmp_path / "led").exists()
    (run / "spool").mkdir()
    (run / "spool" / "mlflow.jsonl").write_text("")
    assert main(["replay", str(run)]) == 2
    assert "tracker/mlflow.json is not valid JSON" in capsys.readouterr().err
    assert (run / "tracker" / "mlflow.json").read_text().startswith('{"backend": "mlflow", "run": {"run_id": "ab')


def test_by_a_column_no_row_has_writes_a_header_and_says_so(tmp_path, capsys):
    """Held-out tester, stop 54: '--by token' over runs whose culprits are whole samples wrote a 2-byte
    culprits_by_token.csv (no header) and said nothing."""
    args = parser().parse_args(["culprits", str(run_dir(tmp_path, ROWS)), "-o", str(tmp_path / "led"), "--by", "token"])
    assert command.run(args) == 0
    assert "--by token: no culprit row is a single token" in capsys.readouterr().err
    head = (tmp_path / "led" / "culprits_by_token.csv").read_text().splitlines()
    assert head == ["token,spikes,of_spikes,samples,runs,rows,max_share,summary"]


@pytest.mark.parametrize("text", ["[1, 2]", "null"])
def test_a_tracker_record_that_is_json_but_no_record_is_named_not_a_traceback(tmp_path, capsys, text):
    """Review, stop 54: a record holding valid JSON that is no object ('[1, 2]', 'null') crashed report and
    culprits with an AttributeError, also beside a local spikes/ folder."""
    from gradloc_track.cli import main

    run = tmp_path / "run"
    (run / "tracker").mkdir(parents=True)
    (run / "tracker" / "mlflow.json").write_text(text)
    assert main(["report", str(run), "-o", str(tmp_path / "r.html")]) == 2
    assert "tracker/mlflow.json is not a run record" in capsys.readouterr().err
    local = run_dir(tmp_path / "b", ROWS)
    (local / "tracker").mkdir()
    (local / "tracker" / "mlflow.json").write_text(text)
    assert main(["culprits", str(local), "-o", str(tmp_path / "led")]) == 0  # its spikes/ is the whole run


def test_replay_refuses_only_the_backend_whose_record_is_damaged(tmp_path, capsys):
    """Review, stop 54: a damaged tracker/wandb.json made replay refuse every backend, an intact MLflow spool
    too. The intact one is replayed; the damaged one is named, and the exit says not all went."""
    from gradloc_track.cli import main
    from gradloc_track.trackers.replay import replay_run_dir

    run = tmp_path / "run"
    (run / "tracker").mkdir(parents=True)
    (run / "spool").mkdir()
    (run / "tracker" / "wandb.json").write_text('{"backend": "wand')
    (run / "spool" / "memory.jsonl").write_text("")  # a backend with an intact (empty) spool: nothing to send
    results = {r.backend: r for r in replay_run_dir(run)}
    assert results["wandb"].refused and "tracker/wandb.json is not valid JSON" in results["wandb"].refused
    assert results["memory"].refused is None and results["memory"].sent == 0
    assert main(["replay", str(run)]) == 2
    err = capsys.readouterr().err
    assert "wandb: not replayed: tracker/wandb.json is not valid JSON" in err


def test_runs_whose_events_have_no_culprit_table_write_no_ledger(tmp_path, capsys):
    """Held-out tester, stop 55: a run with locate.enabled=false (its spike detected, not localized) gave an
    empty ledger and exit 0, "0 spike event(s) with culprits", where docs/ledger.md promises exit 2 and nothing
    written when no run has a culprit table. Beside a run that has one, it is a note."""
    bare = tmp_path / "bare"
    (bare / "spikes" / "events").mkdir(parents=True)
    (bare / "spikes" / "events" / "step_000100.json").write_text(json.dumps({"columns": ["step"], "data": [[100]]}))
    assert command.run(parser().parse_args(["culprits", str(bare), "-o", str(tmp_path / "led")])) == 2
    err = capsys.readouterr().err
    assert "its spike events have no culprit table (none was localized" in err and "has a culprit table" in err
    assert not (tmp_path / "led").exists()
    assert command.run(parser().parse_args(["culprits", str(bare), str(run_dir(tmp_path, ROWS)), "-o",
                                            str(tmp_path / "led2")])) == 0
    out, err = capsys.readouterr()
    assert out.startswith("1 run(s), 1 spike event(s) with culprits") and "have no culprit table" in err


@pytest.mark.parametrize("enabled", [True, False])
def test_the_collector_is_as_it_was_after_a_ledger_written_or_refused(tmp_path, enabled, monkeypatch):
    """``culprits`` pauses Python's cyclic collector while it aggregates and writes the ledger (each collection
    walked every part read again), not while it reads (a tracker's client may leave cycles), and leaves it as it
    found it: after a ledger, after a refused source."""
    import gc

    from gradloc_track.ledger import aggregate, render, sources

    seen = []
    for module, name in ((sources, "read_runs"), (aggregate, "collect"), (render, "write_files")):
        def wrapped(*a, _f=getattr(module, name), _name=name, **k):
            seen.append((_name, gc.isenabled()))
            return _f(*a, **k)
        monkeypatch.setattr(module, name, wrapped)
    d = run_dir(tmp_path, ROWS)
    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        assert command.run(parser().parse_args(["culprits", str(d), "-o", str(tmp_path / "out")])) == 0
        assert gc.isenabled() is enabled
        assert seen == [("read_runs", enabled), ("collect", False), ("write_files", False)]
        assert command.run(parser().parse_args(["culprits", str(tmp_path / "nope" / "run"), "-o",
                                                str(tmp_path / "o2")])) == 2
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()
