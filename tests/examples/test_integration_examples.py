"""Smoke runs of examples/hf_trainer.py and examples/lightning_lm.py: a few steps, local files."""
from __future__ import annotations

import json
import re

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
    said 61), names the garbage's tokens in the second micro-batch with their share, and the summary counts
    them the same way."""
    pytest.importorskip("transformers")
    callback = load("hf_trainer").main(["--steps", "61", "--report-to", "none", "--out", str(tmp_path / "hf")])
    assert [s.step for s in callback.handle.spikes] == [60]
    err = capsys.readouterr().err
    block = err[err.index("── spike at step 60"):err.index("done: 61 steps")]
    garbage = r"'(\\x[0-9a-f]{2}){6}'"  # 6 bytes of invalid UTF-8, as ByteTokenizer decodes them
    assert re.search(r"culprits   micro-batch 1, sample 1, tokens 0-5: " + garbage + r"  \(\d+% of the batch", block)
    assert re.search(r"  step 60: 1 sample \(6 tokens\): micro-batch 1, sample 1, tokens 0-5", err)
    assert f"gradloc-track report {tmp_path / 'hf'}" in err


def test_lightning_example_runs(tmp_path):
    pytest.importorskip("lightning")
    callback = load("lightning_lm").main([*SMALL, "--logger", "none", "--out", str(tmp_path / "pl")])
    assert callback.handle.finished
    assert steps_logged(tmp_path / "pl") == [0, 1, 2]
