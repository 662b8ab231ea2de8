"""``integrations/verl/columns.py``: the RL columns are verl's own tensors, at each term's position."""
from __future__ import annotations

import pytest


def test_token_columns_are_verls_tensors(verl_unit):
    c = verl_unit["columns"]
    assert c["advantage"] and c["old"]
    assert c["ratio"] < 1e-6
    assert {"advantage", "logprob", "old_logprob", "ratio", "ref_logprob", "rollout_is_weight", "entropy"} <= \
        set(c["keys"])


def test_sample_columns(verl_unit):
    c = verl_unit["columns"]
    assert c["reward"] == pytest.approx(c["scores"])  # verl's sequence score
    assert c["group"] == c["uid"]  # verl's uid: the prompt the response answers
    assert c["index"] == [0, 1]  # first micro-batch: the first two responses of their group
