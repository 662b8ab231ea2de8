"""ghost: per-position, per-layer gradient norms from one backward, against one backward per loss term.

The helpers' LM is position-wise (no attention), so every layer's ghost norm is exact per term."""
from __future__ import annotations

import torch

from gradloc_track.localizer.ghost import GhostMap

from .helpers import B, T, LM, data, sum_loss


def per_term_layer_norms(model, loss_fn, layers):
    """Brute force: one backward per (b, t) term, each layer's gradient norm (weight and bias)."""
    out = torch.zeros(len(layers), B, T)
    for b in range(B):
        for t in range(T):
            keep = torch.zeros(B, T)
            keep[b, t] = 1
            model.zero_grad(set_to_none=True)
            loss_fn(keep).backward()
            for i, prefix in enumerate(layers):
                sq = sum(p.grad.pow(2).sum() for n, p in model.named_parameters() if n.startswith(prefix + "."))
                out[i, b, t] = sq.sqrt()
    return out


def test_ghost_norms_equal_each_terms_own_gradient_per_layer():
    model = LM()
    x, y, w, _ = data(n_culprits=2)
    loss_fn = sum_loss(model, x, y, w)
    with GhostMap(model, group_by="tensor", shape=(B, T)) as gm:
        loss_fn(torch.ones(B, T)).backward()
    norms, names = gm.result(["emb.weight", "mid.weight", "head.weight"])
    assert names == ["emb.weight", "mid.weight", "head.weight"]
    ref = per_term_layer_norms(model, loss_fn, ["emb", "mid", "head"])
    assert torch.allclose(norms, ref, rtol=1e-4, atol=1e-8)


def test_hooks_come_off_and_frozen_or_mismatched_layers_are_left_out():
    model = LM()
    model.mid.weight.requires_grad_(False)
    model.mid.bias.requires_grad_(False)
    x, y, w, _ = data()
    with GhostMap(model, shape=(B, T)) as gm:
        sum_loss(model, x, y, w)(torch.ones(B, T)).backward()
    assert "mid" not in gm.sq and {"emb", "head"} <= set(gm.sq)
    assert not any(m._forward_hooks for m in model.modules())
    with GhostMap(model, shape=(B + 1, T)) as wrong:  # a shape the activations do not have: nothing recorded
        sum_loss(model, x, y, w)(torch.ones(B, T)).backward()
    assert wrong.sq == {} and wrong.shape is None


def test_a_mask_over_other_positions_than_the_models_says_what_to_pass():
    """A shifted loss whose mask drops the last position ((B, T-1) against the model's T positions): no layer
    matched, and localizing failed with 'stack expects a non-empty TensorList' (held-out tester round 8). Now
    the mask's and the layers' shapes and the fix."""
    import re

    import pytest

    import gradloc_track

    model = LM()
    x, y, w, _ = data()

    def shifted(keep):
        return (sum_loss(model, x, y, w)(torch.nn.functional.pad(keep, (0, 1))))

    shifted(torch.ones(B, T - 1)).backward()
    with pytest.raises(ValueError, match=re.escape(f"token mask's {(B, T - 1)} positions (its layers see {(B, T)})")
                       + r".*token_mask\[:, -1\] = 0"):
        gradloc_track.locate(model, shifted, torch.ones(B, T - 1))
