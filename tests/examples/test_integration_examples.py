"""Smoke runs of examples/hf_trainer.py and examples/lightning_lm.py: a few steps, local files."""
from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from .load import load_example as load

SMALL = ["--steps", "3", "--inject-at", "2", "--micro", "2", "--seq", "16", "--span", "4"]


def steps_logged(out) -> list[int]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return sorted({json.loads(x)["step"] for x in lines if "grad_norm/global" in json.loads(x)["metrics"]})


def test_hf_trainer_example_runs(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "unused")
    callback = load("hf_trainer").main([*SMALL, "--report-to", "none", "--out", str(tmp_path / "hf")])
    assert callback.handle.finished
    assert steps_logged(tmp_path / "hf") == [1, 2, 3]  # Trainer's global_step of each update


def test_hf_trainer_example_names_the_garbage_at_the_step_it_injected(tmp_path, capsys):
    """--inject-at 60 is the update Trainer logs as step 60 (its first is step 1): the block says step 60 (it
    said 61), names the garbage's tokens in the second micro-batch as text (the byte tokens decoded together,
    not '\\xd9\\xe7...'), with their share, and the summary counts them the same way; all on stdout."""
    pytest.importorskip("transformers")
    callback = load("hf_trainer").main(["--steps", "61", "--report-to", "none", "--out", str(tmp_path / "hf")])
    assert [s.step for s in callback.handle.spikes] == [60]
    out = capsys.readouterr().out
    block = out[out.index("── spike at step 60"):out.index("done: 61 steps")]
    assert re.search(r"culprits   micro-batch 1, sample 1, tokens 0-7: '\u00e2\u20ac\u2122'  \(\d+% of the", block)
    assert "\\x" not in block
    assert re.search(r"  step 60: 1 sample \(8 tokens\): micro-batch 1, sample 1, tokens 0-7", out)
    assert f"gradloc-track report {tmp_path / 'hf'}" in out


def test_each_example_run_gets_a_run_dir_of_its_own(tmp_path, monkeypatch, capsys):
    """Two runs of the same example line never share a run dir: the default is a new runs/<example>/<date>_<time>,
    and an --out that holds a run already is refused, naming the fix (it was silently taken over)."""
    from gradloc_track.demo.out_dir import run_dir_for

    monkeypatch.chdir(tmp_path)
    first, second = run_dir_for(None, "hf_trainer"), run_dir_for(None, "hf_trainer")
    assert first != second and first.parent == second.parent == Path("runs/hf_trainer")
    example = load("custom_loop")
    example.main(["--steps", "2", "--inject-at", "-1", "--out", str(tmp_path / "mine")])
    with pytest.raises(SystemExit, match="holds a run already"):
        example.main(["--steps", "2", "--inject-at", "-1", "--out", str(tmp_path / "mine")])


def test_lightning_example_runs(tmp_path):
    pytest.importorskip("lightning")
    callback = load("lightning_lm").main([*SMALL, "--logger", "none", "--out", str(tmp_path / "pl")])
    assert callback.handle.finished
    assert steps_logged(tmp_path / "pl") == [0, 1, 2]


@pytest.mark.skipif(importlib.util.find_spec("verl") is not None, reason="verl is installed: the example runs")
def test_the_verl_example_without_verl_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    """New-user tester round 12: in the README's venv it printed only "ranks [0, 1] failed" (each rank's
    error went with its os._exit)."""
    monkeypatch.chdir(tmp_path)
    assert load("verl_grpo").main([]) == 2
    assert "pip install 'gradloc-track[verl]'" in capsys.readouterr().err
