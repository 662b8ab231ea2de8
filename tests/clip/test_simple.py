"""GlobalClip and NoClip against torch's clip_grad_norm_."""
from __future__ import annotations

import pytest
import torch

from gradloc_track.clip import GlobalClip

from .helpers import grad_stream, set_grads, small_model


def test_global_clip_matches_torch():
    a, b = small_model(), small_model()
    for grads in grad_stream(a, 5, spike_at=(2,)):
        set_grads(a, grads)
        set_grads(b, grads)
        res = GlobalClip(a, max_norm=1.5).clip()
        total = torch.nn.utils.clip_grad_norm_(b.parameters(), 1.5, foreach=True)
        assert res.total_norm == pytest.approx(total.item(), rel=1e-6)
        for p, q in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-8)
