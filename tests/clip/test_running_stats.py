"""Running statistics (``clip/running_stats.py``): a zero-norm step (an all-masked batch,
``loss * 0``) never enters them (issue 17)."""
from __future__ import annotations

import pytest
import torch

from gradloc_track.clip import LayerClip, ZClip

from .helpers import small_model


@pytest.mark.parametrize("cls", [ZClip, LayerClip])
def test_zero_norm_steps_do_not_enter_the_statistics(cls):
    """A run with two all-zero steps (one in warm-up) ends with the statistics of the run without them."""
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(8, 6, generator=g) for _ in range(14)]
    runs = []
    for zero_steps in ((), (1, 8)):
        model = small_model()
        clipper = cls(model, warmup_steps=4)
        for t, x in enumerate(xs):
            for z in ([0.0] if t in zero_steps else []) + [1.0]:  # the zero step comes in addition
                model.zero_grad()
                (model(x).pow(2).mean() * z).backward()
                clipper.clip()
        runs.append(clipper.stats)
    assert torch.equal(runs[0].mean, runs[1].mean) and torch.equal(runs[0].var, runs[1].var)
    assert (runs[1].mean > 0).all()
