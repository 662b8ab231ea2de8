"""``gradloc-track report`` on damaged files, missing runs and dead servers: a message, never a traceback.

Also: the run directory the app prints is followed to its MLflow run or W&B offline files
(``tracker/<backend>.json``). MLflow's own retry settings are left at their defaults; the waiting is
bounded in our code (``MLFLOW_WAIT_S``, the MLflow backend entry's).
"""
from __future__ import annotations

import json
import socket
import threading

import pytest

from gradloc_track import report
from gradloc_track.artifacts import SpikeArtifactWriter
from gradloc_track.cli import main
from gradloc_track.config import TrackerConfig
from gradloc_track.trackers import make_tracker
from gradloc_track.trackers.backends import mlflow as mlflow_backend
from gradloc_track.trackers.run_record import read_run_views

from ..artifacts.cases import make_case

PAGE = "<!DOCTYPE html><html><head><title>spike at step 7</title></head><body>ok</body></html>"


def run_dir_with(tmp_path, tokens: bytes | None, page: bytes | None = PAGE.encode()):
    d = tmp_path / "run"
    (d / "spikes" / "highlight").mkdir(parents=True)
    if tokens is not None:
        (d / "spikes" / "tokens.json").write_bytes(tokens)
    if page is not None:
        (d / "spikes" / "highlight" / "step_000007.html").write_bytes(page)
    return d


GOOD = json.dumps({"columns": ["step", "sample", "position", "token"], "data": [[7, 0, 3, "x"]]})


@pytest.mark.parametrize("tokens, says", [
    (GOOD[: len(GOOD) // 2].encode(), "not valid JSON"),  # a write cut short
    (b"[1, 2, 3]", "not a table"),
    (b"\x89PNG\r\n\x1a\n\x00\x00binary", "not valid"),
    (json.dumps({"columns": ["step", "token"], "data": [[7, "a"], [7], [7, "b", 1], "row"]}).encode(), "3 row(s)"),
])
def test_damaged_table_gives_a_note_and_a_page(tmp_path, capsys, tokens, says):
    d = run_dir_with(tmp_path, tokens)
    out = tmp_path / "r.html"
    assert main(["report", str(d), "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert "tokens.json" in err and says in err and "Traceback" not in err
    page = out.read_text(encoding="utf-8")
    assert says in page and "1 spike event(s)" in page


def test_ragged_rows_keep_the_good_ones(tmp_path):
    d = run_dir_with(tmp_path, json.dumps({"columns": ["step", "token"], "data": [[7, "kept"], [7]]}).encode())
    page = report.build_report(d)
    assert "kept" in page and "1 culprit token(s)" in page


def test_non_utf8_page_is_shown_with_replacement_and_a_note(tmp_path, capsys):
    d = run_dir_with(tmp_path, GOOD.encode(), page=PAGE.encode().replace(b"ok", b"ok \xff\xfe bad"))
    out = tmp_path / "r.html"
    assert main(["report", str(d), "-o", str(out)]) == 0
    assert "not valid UTF-8" in capsys.readouterr().err
    assert "\ufffd" in out.read_text(encoding="utf-8")


def test_nonexistent_dir_says_so_and_creates_no_store(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    for source in ("/nonexistent", "runs/2026-01-01_00-00-00", "0123456789abcdef0123456789abcdef"):
        assert main(["report", source, "-o", str(tmp_path / "r.html")]) == 2
        err = capsys.readouterr().err
        assert source in err and "Traceback" not in err
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "r.html").exists()


def test_dead_server_is_reported_fast(tmp_path, capsys):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = main(["report", "0123456789abcdef0123456789abcdef", "--tracking-uri", f"http://127.0.0.1:{port}",
                 "-o", str(tmp_path / "r.html")])
    assert code == 2 and "unreachable" in capsys.readouterr().err


def test_hung_server_is_bounded_by_our_wait(tmp_path, monkeypatch, capsys):
    """A server that accepts and never answers: MLflow would retry for minutes; we stop at our bound."""
    monkeypatch.setattr(mlflow_backend, "MLFLOW_WAIT_S", 2.0)
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    port = srv.getsockname()[1]
    held = []
    stop = threading.Event()

    def accept():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])  # accepted, never answered
            except OSError:
                pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        code = main(["report", "0123456789abcdef0123456789abcdef", "--tracking-uri", f"http://127.0.0.1:{port}",
                     "-o", str(tmp_path / "r.html")])
    finally:
        stop.set()
        t.join()
        for c in held:
            c.close()
        srv.close()
    err = capsys.readouterr().err
    assert code == 2 and "no answer within 2 s" in err


def test_run_dir_of_an_mlflow_run_is_followed_to_the_run(tmp_path, sqlite_uri, capsys):
    events, result, ctx = make_case(T=40, culprits=((0, 5),), pad_from=30)
    cfg = TrackerConfig(kind="mlflow", run_name="my-run")
    cfg.mlflow.tracking_uri = sqlite_uri
    run_dir = tmp_path / "runs" / "a"
    tracker = make_tracker(cfg, run_dir=run_dir)
    SpikeArtifactWriter(tracker, run_dir, window=8).write(12, events, result, ctx)
    tracker.finish()
    rec = read_run_views(run_dir)["mlflow"]
    assert not (run_dir / "spikes").exists()  # the artifacts live in MLflow only
    out = tmp_path / "r.html"
    assert main(["report", str(run_dir), "-o", str(out)]) == 0
    page = out.read_text(encoding="utf-8")
    assert "<title>my-run - gradloc-track spike report</title>" in page and "1 spike event(s) (steps 12)" in page
    assert f"#/experiments/{rec['experiment_id']}/runs/{rec['run_id']}" in page
    from mlflow.tracking import MlflowClient

    exp = MlflowClient(sqlite_uri).get_experiment(rec["experiment_id"])
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"  # opens in the model-training view


def test_wandb_offline_run_dir_is_reported(tmp_path, capsys):
    events, result, ctx = make_case(T=40, culprits=((0, 5),), pad_from=30)
    cfg = TrackerConfig(kind="wandb", run_name="wb-run")
    cfg.wandb.mode = "offline"
    cfg.wandb.dir = str(tmp_path / "wandb-root")
    run_dir = tmp_path / "runs" / "b"
    tracker = make_tracker(cfg, run_dir=run_dir)
    SpikeArtifactWriter(tracker, run_dir, window=8).write(9, events, result, ctx)
    tracker.finish()
    wdir = read_run_views(run_dir)["wandb"]["dir"]
    for source in (run_dir, wdir):  # the app's run dir, and W&B's own run dir
        page = report.build_report(source)
        assert "1 spike event(s) (steps 9)" in page and "<iframe sandbox" in page
        assert "1 culprit token(s)" in page


def test_a_10k_character_token_is_cut_in_the_table_as_on_the_highlight_page(tmp_path):
    from gradloc_track.artifacts.highlight import MAX_TOKEN_CHARS

    long = "A" * 10_000
    table = {"columns": ["step", "sample", "position", "token", "grad_norm"], "data": [[7, 0, 3, long, 2.5]]}
    page = report.build_report(run_dir_with(tmp_path, json.dumps(table).encode()))
    cell = page.split("<td class='tok'>", 1)[1].split("</td>", 1)[0]
    assert cell.startswith("A" * MAX_TOKEN_CHARS) and "A" * (MAX_TOKEN_CHARS + 1) not in cell
    assert f"+{10_000 - MAX_TOKEN_CHARS} chars" in cell  # says how much was left out
    assert "<td>2.5</td>" in page  # the columns after it stay on the page
