"""What a step's clip hands to the optimizer (``clip.handoff``): the monitor's ``NonfiniteFlag`` where
no clipper runs, and the buffers a fused guard passes as ``found_inf`` / ``grad_scale``."""
from __future__ import annotations

import copy

import pytest
import torch

from gradloc_track.clip import GlobalClip, SkipStepGuard
from gradloc_track.clip.handoff import NonfiniteFlag

from .helpers import assert_bitwise_equal, backward, mlp, snapshot


@pytest.mark.parametrize("values,nonfinite", [
    ([1.0, 4.0], False), ([0.0, 0.0], False), ([1.0, float("nan")], True), ([float("inf"), 1.0], True),
    ([3e38, 3e38], False),  # large but finite per tensor: not a skip (the clippers' rule too)
])
def test_the_flag_is_non_finite_per_tensor_norm(values, nonfinite):
    flag = NonfiniteFlag(torch.device("cpu"))
    assert bool(flag.update(torch.tensor(values))) == nonfinite
    assert bool(flag.last_nonfinite) == nonfinite and flag.last_nonfinite_host is None


@pytest.mark.parametrize("fused", [False, True])
def test_a_guard_on_the_flag_alone_skips_bitwise(fused):
    """No clipper: the flag from the per-tensor squared norms makes the optimizer skip the step."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=fused)
    flag = NonfiniteFlag(torch.device("cpu"))
    guard = SkipStepGuard(opt, flag)
    assert guard.mode == ("fused" if fused else "sync") and flag.grad_scale is None  # a flag never scales
    clean = copy.deepcopy((model, opt))
    for s in (0, 99, 1):
        backward(model, s, nan=s == 99)
        before = snapshot(model, opt)
        flag.update(torch.stack([p.grad.pow(2).sum() for p in model.parameters()]))
        opt.step()
        if s == 99:
            assert_bitwise_equal(snapshot(model, opt), before)
            continue
        backward(clean[0], s)
        clean[1].step()
    assert_bitwise_equal(snapshot(model, opt), snapshot(*clean))


def test_buffers_are_reset_after_each_step_and_put_back_on_remove():
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    clipper = GlobalClip(model, max_norm=0.01)
    guard = SkipStepGuard(opt, clipper)
    backward(model, 0)
    clipper.clip()
    assert float(clipper.grad_scale) > 1.0 and clipper.deferred
    opt.step()
    assert float(clipper.grad_scale) == 1.0 and float(clipper.found_inf) == 0.0 and clipper.deferred is None
    guard.remove()
    assert clipper.grad_scale is None and clipper.found_inf is None and not clipper.skip_exact
    backward(model, 1)
    with pytest.warns(UserWarning, match="SkipStepGuard"):  # no guard: it scales (and zeroes) itself
        assert not clipper.clip().deferred
