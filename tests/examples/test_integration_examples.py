"""Smoke runs of examples/hf_trainer.py and examples/lightning_lm.py: a few steps, local files."""
from __future__ import annotations

import json

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


def test_lightning_example_runs(tmp_path):
    pytest.importorskip("lightning")
    callback = load("lightning_lm").main([*SMALL, "--logger", "none", "--out", str(tmp_path / "pl")])
    assert callback.handle.finished
    assert steps_logged(tmp_path / "pl") == [0, 1, 2]
