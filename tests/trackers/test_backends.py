"""The backend registry (``trackers/backends``): one entry per backend, every per-backend path through it.

The round trip runs for every registered backend: a run opened by ``tracker=<name>`` with a run dir logs
metrics and two spikes; ``gradloc-track report`` and ``culprits`` read them back from the run dir (the
MLflow run's artifacts, the W&B run folder's media, the TensorBoard log dir's events), and the console
says where the run is. A new backend (its file in ``trackers/backends``) is in these tests by being there.
"""
from __future__ import annotations

import html
import json
import re
import subprocess
import sys

import pytest

from gradloc_track.artifacts import SpikeArtifactWriter
from gradloc_track.cli import main
from gradloc_track.config import TrackerConfig
from gradloc_track.config.tracker import TRACKER_KINDS
from gradloc_track.console import view_commands, where_to_look
from gradloc_track.run_dirs import is_run_dir, run_key
from gradloc_track.trackers import make_tracker
from gradloc_track.trackers.backends import BACKENDS
from gradloc_track.trackers.join import OpenRuns

from ..artifacts.cases import make_case

NAMES = list(BACKENDS)
SLOW = {"wandb": "a real W&B offline run: 10-40 s here"}


def test_every_backend_is_a_tracker_kind_and_has_its_yaml():
    from ..conftest import ROOT

    assert NAMES[:2] == ["mlflow", "wandb"] and "tensorboard" in NAMES  # registry order: a run's identity
    assert set(NAMES) == set(TRACKER_KINDS) - {"none", "memory", "both"}
    for name, b in BACKENDS.items():
        assert b.name == name and b.title and (ROOT / "conf" / "tracker" / f"{name}.yaml").is_file()
    with pytest.raises(TypeError, match="no backend named neptune"):
        OpenRuns(neptune=object())


def test_import_needs_no_backend_sdk():
    code = ("import sys, gradloc_track, gradloc_track.trackers.backends, gradloc_track.report, gradloc_track.console\n"
            f"print([m for m in {NAMES!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def _cfg(name: str, tmp_path) -> TrackerConfig:
    cfg = TrackerConfig(kind=name, run_name=f"{name}-run")
    cfg.wandb.mode, cfg.wandb.dir = "offline", str(tmp_path / "wandb-root")
    return cfg


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in NAMES])
def test_a_run_of_each_backend_is_read_back_by_the_report_and_the_ledger(name, tmp_path, sqlite_uri, capsys):
    events, result, ctx = make_case(T=80, culprits=((1, 10), (1, 60)), pad_from=70)
    run = tmp_path / "runs" / name
    tracker = make_tracker(_cfg(name, tmp_path), run_dir=run)
    tracker.log_metrics({"grad_norm/global": 2.0}, 11)
    writer = SpikeArtifactWriter(tracker, run, window=8)
    for step in (12, 30):
        writer.write(step, events, result, ctx)
    tracker.finish()
    assert not (run / "spikes").exists() and is_run_dir(run)  # the backend holds them, not the run dir
    key = run_key(run)
    assert key and key != str(run.resolve())  # the run it logged to, not its folder
    out = tmp_path / "r.html"
    assert main(["report", str(run), "-o", str(out)]) == 0
    page = out.read_text(encoding="utf-8")
    assert "2 spike event(s) (steps 12, 30)" in page and page.count("<iframe sandbox") == 2
    docs = [html.unescape(d) for d in re.findall(r'srcdoc="([^"]*)"', page)]
    assert all("Gradient spike at step" in d for d in docs)
    assert main(["culprits", str(run), "-o", str(tmp_path / "ledger")]) == 0
    doc = json.loads((tmp_path / "ledger" / "culprits.json").read_text())
    assert doc["run_ids"] == [key] and doc["spike_events"] == 2
    capsys.readouterr()
    lines = where_to_look(run, step=12) + view_commands(run)
    assert any(BACKENDS[name].title in line or name in line for line in lines), lines



def test_tensorboard_shows_a_page_as_markdown_with_the_culprits_bold_and_nothing_unescaped():
    from tensorboard.plugin_util import markdown_to_safe_html

    from gradloc_track.trackers.backends.tensorboard import page_markdown

    page = ("<html><head><title>spike at step 3</title><style>.c{outline:1px}</style></head><body>"
            "<h1>Gradient spike at step 3</h1><div class='text'><span class='t'>the </span>"
            "<span class='t c' style='background:red'>&lt;script&gt;alert(1)&lt;/script&gt;</span>"
            "<span class='u'><span class='t c'>*x*</span><span class='t'> tail</span></span></div></body></html>")
    md = page_markdown(page)
    assert md.startswith("# Gradient spike at step 3") and ".c{" not in md
    shown = markdown_to_safe_html(md)  # what TensorBoard's Text tab puts on the page
    assert "<script" not in shown and "&lt;script&gt;alert(1)&lt;/script&gt;" in shown
    # the culprit token, then the culprit span around another (nested: one bold run; the stars literal)
    assert "the <strong>&lt;script&gt;alert(1)&lt;/script&gt;*x* tail</strong>" in shown


def test_a_tensorboard_run_whose_records_were_spooled_is_replayed_into_its_log_dir(tmp_path):
    from gradloc_track.trackers import replay_run_dir
    from gradloc_track.trackers.backends.tensorboard import EventFiles
    from gradloc_track.trackers.run_record import update_run_record
    from gradloc_track.trackers.spool import Spool

    run, logdir = tmp_path / "run", tmp_path / "run" / "tensorboard"
    update_run_record(run, "tensorboard", spec={"logdir": str(logdir), "run_name": "r"})  # never opened
    spool = Spool(run / "spool" / "tensorboard.jsonl", "tensorboard")
    spool.write("log_metrics", [{"loss": 2.5}, 7], "down", ts=1)
    spool.write("log_table", ["spikes/tokens", ["step", "token"], [[7, "x"]], 7], "down", ts=2)
    spool.write("finish", ["success"], "down", ts=3)
    (result,) = replay_run_dir(run)
    assert (result.backend, result.sent, result.status) == ("tensorboard", 3, "success")
    reader = EventFiles(logdir)
    assert json.loads(reader.tables("tokens")[0][1]) == {"columns": ["step", "token"], "data": [[7, "x"]]}
    assert [e.step for e in reader.acc.Tensors("loss")] == [7]
    assert replay_run_dir(run)[0].sent == 0  # once


def test_a_lightning_tensorboard_logger_is_joined_in_its_log_dir(tmp_path):
    pytest.importorskip("lightning")
    from lightning.pytorch.loggers import TensorBoardLogger

    from gradloc_track.integrations.lightning import logger_runs

    class Trainer:
        loggers = [TensorBoardLogger(str(tmp_path), name="lt")]

    runs = logger_runs(Trainer())
    assert runs.backends == ("tensorboard",) and runs.tensorboard == Trainer.loggers[0].log_dir


def test_a_tensorboard_text_table_shows_each_cell_as_it_is(tmp_path):
    """The Text tab reads each cell as Markdown (sanitized): a culprit token is shown as its text, never read
    as Markdown or HTML (held-out tester, stop 56: ``&amp;`` showed as ``&``, ``'><img src=x ...>`` became an
    image, a right-to-left override reordered the row); the JSON part keeps the exact text for programs."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.text.text_plugin import text_array_to_html
    from tensorboard.util import tensor_util

    from gradloc_track.trackers.backends.tensorboard import EventFiles, TensorBoardTracker

    hostile = ["&amp;", "'><img src=x onerror=alert(3)>", "a\u202eb", "x\x00y", "# h", "*b* _i_", "a|b", "C:\\p"]
    tracker = TensorBoardTracker(tmp_path / "tb")
    tracker.log_table("spikes/tokens", ["step", "text"], [[7, t] for t in hostile], step=7)
    tracker.finish()
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0})
    acc.Reload()
    shown = text_array_to_html(tensor_util.make_ndarray(acc.Tensors("spikes/tokens")[0].tensor_proto), True)
    tds = re.findall(r"<td>(.*?)</td>", shown, re.S)
    cells = [c.strip().removeprefix("<p>").removesuffix("</p>") for c in tds][3::2]  # the text column's rows
    assert cells == ["&amp;amp;", "'&gt;&lt;img src=x onerror=alert(3)&gt;", "a\\u202eb", "x\\x00y", "# h",
                     "*b* _i_", "a|b", "C:\\p"], cells
    assert "<img" not in shown and "\u202e" not in shown and "\x00" not in shown
    (_, part), = EventFiles(tmp_path / "tb").tables("tokens")
    assert [r[-1] for r in json.loads(part)["data"]] == hostile  # the JSON part: exact, for the report
