"""``--log-to`` when the tracker is down: a bounded wait (ours; MLflow's retries at their defaults), a
non-zero exit that says the ledger run is spooled and how to replay it, never ``logged ...: {}``."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from gradloc_track.cli import main
from gradloc_track.ledger.publish import Destination, fresh_run_dir
from gradloc_track.trackers import read_spool

from ..conftest import running_mlflow_server

assert not any(k.startswith("MLFLOW_HTTP_REQUEST") for k in os.environ), "tests must use MLflow's defaults"
COLS = ["step", "level", "token", "share", "sample", "position", "end", "sample_id"]


@pytest.mark.slow  # a real mlflow server is started (then stopped): 10-20 s, minutes on a loaded box
def test_a_stopped_server_fails_loudly_within_our_bound_and_spools_the_ledger(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "spikes" / "tokens").mkdir(parents=True)
    (run / "spikes" / "tokens" / "step_000100.json").write_text(json.dumps(
        {"columns": COLS, "data": [[100, "sample", "junk", 0.9, 1, 0, 9, "0123456789abcdef"]]}))
    with running_mlflow_server(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path) as uri:
        pass  # a real server, now stopped: its port refuses connections
    out = tmp_path / "ledger"
    import mlflow.tracking  # noqa: F401 - loaded before the clock starts: importing is not waiting on the server

    t0 = time.monotonic()
    rc = main(["culprits", str(run), "-o", str(out), "--log-to", "mlflow", "--tracking-uri", uri,
               "--log-timeout", "3"])
    took = time.monotonic() - t0
    printed = capsys.readouterr()
    # our bound: 3 s to open the run, 3 s to finish (MLflow alone retries for ~2 min); slack for a busy box
    assert rc == 1 and took < 30, f"exit {rc} after {took:.0f} s"
    assert "logged the ledger" not in printed.out
    err = printed.err
    assert "did NOT reach mlflow within --log-timeout 3 s (nothing of it was delivered)" in err
    assert f"spooled in {out / 'ledger_run' / 'spool'}" in err and f"gradloc-track replay {out / 'ledger_run'}" in err
    calls = [r["call"] for r in read_spool(out / "ledger_run" / "spool" / "mlflow.jsonl")]
    assert {"log_params", "log_table", "log_artifact", "finish"} <= set(calls)  # all of it, for replay
    assert (out / "culprits.json").is_file()  # the files are written whatever the tracker does


def test_each_ledger_run_gets_a_run_dir_of_its_own(tmp_path):
    assert fresh_run_dir(tmp_path) == tmp_path / "ledger_run"
    (tmp_path / "ledger_run").mkdir()
    (tmp_path / "ledger_run-2").mkdir()
    assert fresh_run_dir(tmp_path) == tmp_path / "ledger_run-3"  # never a previous ledger's record or spool
    cfg = Destination("mlflow", timeout_s=7).config()
    assert (cfg.open_timeout_s, cfg.finish_timeout_s, cfg.call_timeout_s) == (7, 7, 7)
    assert Path(cfg.mlflow.experiment_name) == Path("gradloc-track")
