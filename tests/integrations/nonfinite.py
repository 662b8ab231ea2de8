"""A NaN at step ``BAD`` and bitwise snapshots of parameters and optimizer state: what the
skip-means-skip tests of watch(), the HF Trainer and Lightning share (issue 17)."""
from __future__ import annotations

import torch

BAD = 3  # the step whose gradient gets a NaN


QUIET = {"tracker": "none", "clip": "global", "spikes": False, "locate": False}


def snapshot(params, opt):
    state = opt.state_dict()["state"]
    return ([p.detach().clone() for p in params],
            {k: {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in s.items()} for k, s in state.items()})


def assert_same(a, b):
    (pa, sa), (pb, sb) = a, b
    assert all(torch.equal(x, y) for x, y in zip(pa, pb))
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].keys() == sb[k].keys()
        for n, v in sa[k].items():
            assert torch.equal(v, sb[k][n]) if isinstance(v, torch.Tensor) else v == sb[k][n], (k, n)


def poison(model) -> None:
    next(p for p in model.parameters() if p.grad is not None).grad.view(-1)[0] = float("nan")
