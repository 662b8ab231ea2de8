"""``integrations/verl/recorder.py``: verl's own micro-batch split, each with its RNG state and the
per-token outputs of its training forward."""
from __future__ import annotations


def test_the_recorder_keeps_verls_micro_batches(verl_unit):
    r = verl_unit["additivity"]["token-mean"]
    assert r["micro_batches"] == 4  # 8 rows, micro_batch_size_per_gpu=2: verl's own split
    assert r["rng"] and r["outputs"] == ["entropy", "log_probs"]
