"""The ``gradloc-track`` command line: it starts without torch, and reads run dirs without it."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from .conftest import ROOT

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
HEAVY = ("torch", "numpy", "mlflow", "wandb", "datasets")


def python(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], env=ENV, capture_output=True, text=True, timeout=120)


def test_importing_the_cli_leaves_torch_out():
    proc = python(f"import sys, gradloc_track.cli; print([m for m in {HEAVY!r} if m in sys.modules])")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_culprits_report_and_the_blocklist_run_without_torch(tmp_path):
    run = tmp_path / "run"
    (run / "spikes" / "tokens").mkdir(parents=True)
    cols = ["step", "level", "token", "share", "sample", "position", "end", "sample_id"]
    (run / "spikes" / "tokens" / "step_000005.json").write_text(json.dumps(
        {"columns": cols, "data": [[5, "token", "x", 0.9, 0, 3, 4, "0123456789abcdef"]]}))
    code = ("import sys; from gradloc_track.cli import main\n"
            "o = sys.argv[1]\n"
            "assert main(['culprits', sys.argv[2], '-o', o, '--export-blocklist', o + '/b.json']) == 0\n"
            "assert main(['report', sys.argv[2], '-o', o + '/r.html']) == 0\n"
            "from gradloc_track.data import load_blocklist\n"
            "assert len(load_blocklist(o + '/b.json')) == 1\n"
            f"print([m for m in {HEAVY!r} if m in sys.modules])")
    proc = python(code, str(tmp_path / "out"), str(run))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_a_reader_that_leaves_the_pipe_ends_the_command_without_a_traceback(tmp_path):
    """Held-out tester, stop 55: `gradloc-track culprits ... | head -3` ended in a BrokenPipeError traceback."""
    run = tmp_path / "run"
    (run / "spikes" / "tokens").mkdir(parents=True)
    (run / "spikes" / "tokens" / "step_000100.json").write_text(json.dumps(
        {"columns": ["step", "level", "share", "sample", "sample_id"], "data": [[100, "sample", 0.8, 1, "a" * 16]]}))
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line
    try:
        proc = subprocess.run([sys.executable, "-m", "gradloc_track.cli", "culprits", str(run), "-o",
                               str(tmp_path / "led")], stdout=write, stderr=subprocess.PIPE, text=True, timeout=120,
                              env=ENV)
    finally:
        os.close(write)
    assert proc.returncode == 141 and "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr
    assert (tmp_path / "led" / "culprits.json").is_file()  # the files were written before the output went nowhere
