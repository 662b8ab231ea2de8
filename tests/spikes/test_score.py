"""The spike score (OLMo's fraction of outliers) against a brute-force count."""
from __future__ import annotations

import random

import pytest

from gradloc_track.spikes import spike_score


def brute_force_score(values, window=128, n_sigma=6.0, min_history=16):
    spikes = seen = 0
    for i, v in enumerate(values):
        prev = values[max(0, i - window):i]
        if len(prev) < min_history:
            continue
        seen += 1
        mean = sum(prev) / len(prev)
        std = (sum((p - mean) ** 2 for p in prev) / len(prev)) ** 0.5
        spikes += v > mean + n_sigma * std
    return spikes / seen


def test_spike_score_matches_brute_force():
    rng = random.Random(1)
    values = [1 + rng.random() * 0.1 for _ in range(400)]
    for i in (150, 151, 300):
        values[i] = 5.0
    assert spike_score(values) == pytest.approx(brute_force_score(values))
    assert spike_score(values) > 0
