"""``locate(reuse_forward=True)`` (issue 38, item 4): one forward per micro-batch serves its later
probes (``localizer/kept_forward.py``). Checked against independent plain backward passes of
``loss_fn(mask)`` (dropout replayed), and against the same search run with a forward per probe."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import gradloc_track
from gradloc_track.grouping import LayerGrouping
from gradloc_track.localizer.kept_forward import KeptForward
from gradloc_track.localizer.probe import Prober, restore_rng, save_rng

from .oracles import grads_of, norm, tiny_gpt
from .test_surgery import batches

V, B, T, K = 64, 4, 16, 2


def step(heavy: dict[tuple[int, int, int], float], dropout: float = 0.1, seed: int = 0):
    """K micro-batches, a loss_fn each that counts its forwards, the RNG state of each, and the step's .grad."""
    model = tiny_gpt(V, T, dropout=dropout).train()
    x, y, w = batches(heavy, seed, K)
    forwards = []

    def make(k):
        def loss_fn(mask):
            forwards.append(k)
            per = F.cross_entropy(model(x[k]).reshape(-1, V), y[k].reshape(-1), reduction="none").view(B, T)
            return (per * w[k] * mask).sum() / (B * T)
        return loss_fn

    fns = [make(k) for k in range(K)]
    rngs = []
    model.zero_grad(set_to_none=True)
    for fn in fns:
        rngs.append(save_rng())
        fn(torch.ones(B, T)).backward()
    forwards.clear()
    return model, fns, rngs, forwards


def rows(res):
    return [(c.level, c.micro_batch, c.batch, c.start, c.end) for c in res.culprits]


@pytest.mark.parametrize("heavy,saved", [({(1, 2, 7): 60.0, (1, 2, 8): 50.0, (1, 0, 3): 40.0}, 2),  # tokens
                                         ({(0, 1, t): 9.0 for t in range(T)}, 0)])  # a sample: no probe to spare
def test_the_same_search_with_fewer_forwards(heavy, saved):
    model, fns, rngs, forwards = step(heavy)
    ones = [torch.ones(B, T)] * K
    plain = gradloc_track.locate(model, fns, ones, rng_state=rngs)
    n_plain = len(forwards)
    forwards.clear()
    kept = gradloc_track.locate(model, fns, ones, rng_state=rngs, reuse_forward=True)
    assert rows(kept) == rows(plain) and kept.probes == plain.probes and plain.culprits
    for a, b in zip(kept.culprits, plain.culprits):
        assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-6)
        assert a.share == pytest.approx(b.share, rel=1e-6, abs=1e-9)
    assert kept.step_check.replayed and kept.step_check.residual <= 1e-6
    # a forward per probe (and the step check's none) before; now the full and the checked subset probe
    # of each micro-batch run one, and a micro-batch probed again after another has its forward again
    assert n_plain == plain.probes and len(forwards) == n_plain - saved


def test_a_probe_of_the_kept_forward_is_the_plain_backward_of_its_mask():
    """Tokens, a span and a whole sample of micro-batch 1, each against ``loss_fn(mask).backward()``."""
    model, fns, rngs, forwards = step({}, dropout=0.2)
    params = [p for p in model.parameters() if p.requires_grad]
    grouping = LayerGrouping.build([n for n, p in model.named_parameters() if p.requires_grad], "block")
    saved = [p.grad for p in params]
    prober = Prober(params, fns, [torch.ones(B, T)] * K, rngs, 100, grouping, reuse_forward=True)
    subsets = [[(2, 7)], [(0, t) for t in range(3, 9)], [(3, t) for t in range(T)], [(1, 0), (2, 15)]]
    try:
        prober.probe(1, prober.masks[1])  # the full mask's forward, kept
        got = [prober.probe_terms(1, s) for s in subsets]  # the first runs a forward: its values match, then kept
    finally:
        prober.forget()
        for p, g in zip(params, saved):
            p.grad = g
    assert forwards == [1, 1]
    for s, g in zip(subsets, got):
        mask = torch.zeros(B, T)
        for b, t in s:
            mask[b, t] = 1.0
        restore_rng(rngs[1])
        want = grads_of(model, fns[1](mask))
        assert norm([a - b for a, b in zip(g, want)]) <= 1e-6 * norm(want), s


def test_a_forward_whose_values_move_with_the_mask_is_not_kept():
    """A subset forward that gives a kept term another value than the full mask did (a mask that reaches
    the model, a normaliser counted from it) keeps no graph: later probes run their own forward."""
    w = torch.nn.Parameter(torch.ones(B, T))
    full = torch.ones(B, T)
    kept = KeptForward(True)
    leaf = full.clone().requires_grad_(True)
    assert kept.keep(0, (w * leaf).sum() / (B * T), leaf, full, is_full=True)
    assert not kept.holds(0)  # no subset forward has shown the values stay: no probe replays it yet
    part = torch.zeros(B, T)
    part[0, :4] = 1.0
    leaf = part.clone().requires_grad_(True)
    assert kept.keep(0, (w * leaf).sum() / (B * T), leaf, full, is_full=False)  # additive: the same values
    assert kept.holds(0)
    leaf = part.clone().requires_grad_(True)
    assert not kept.keep(0, (w * leaf).sum() / leaf.detach().sum(), leaf, full, is_full=False)
    assert not kept.holds(0)
    inf = torch.full((B, T), float("inf"))
    leaf = full.clone().requires_grad_(True)
    assert not kept.keep(1, (w * inf * leaf).sum(), leaf, full, is_full=True)  # non-finite values
    leaf = part.clone().requires_grad_(True)
    assert not kept.keep(1, (w * leaf).sum(), leaf, full, is_full=False)  # no full forward to compare with


def test_mask_dependent_normalisers_are_still_rejected():
    model, fns, rngs, _ = step({})
    model.zero_grad(set_to_none=True)  # not this loss's step: no step check
    x = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(3))

    def token_mean(m):
        per = F.cross_entropy(model(x).reshape(-1, V), x.reshape(-1), reduction="none").view(B, T)
        return (per * m).sum() / m.detach().sum()

    with pytest.raises(ValueError, match="not additive"):
        gradloc_track.locate(model, token_mean, torch.ones(B, T), reuse_forward=True)


def test_a_loss_fn_that_writes_into_its_mask_runs_a_forward_per_probe():
    model, fns, rngs, forwards = step({(0, 1, 3): 60.0}, dropout=0.0)
    model.zero_grad(set_to_none=True)  # the step held both micro-batches: no step check for one

    calls = []

    def strict(mask):
        calls.append(mask.requires_grad)
        if mask.requires_grad:
            raise RuntimeError("a leaf Variable that requires grad is being used in an in-place operation")
        return fns[0](mask)

    res = gradloc_track.locate(model, strict, torch.ones(B, T), rng_state=rngs[0], reuse_forward=True)
    assert [(c.batch, c.position) for c in res.tokens] == [(1, 3)]
    assert calls.count(True) == 1  # tried once with a leaf, then never again


def test_one_kept_graph_at_a_time(monkeypatch):
    """The kept graph goes before any fresh forward: two forwards' activations are never held at once."""
    model, fns, rngs, _ = step({(0, 2, 7): 60.0, (0, 2, 8): 50.0, (0, 0, 3): 40.0}, dropout=0.0)
    model.zero_grad(set_to_none=True)
    held = []
    forward = Prober._forward

    def spy(self, *args):
        held.append(self.kept.values is not None)  # a graph still kept when a forward starts
        return forward(self, *args)

    monkeypatch.setattr(Prober, "_forward", spy)
    res = gradloc_track.locate(model, fns[0], torch.ones(B, T), rng_state=rngs[0], reuse_forward=True)
    assert res.probes >= 4 and len(held) == 2  # the ghost pass and the checked subset probe; the rest replay
    assert held == [False, False]


class _OnceMul(torch.autograd.Function):
    """``l * m`` whose backward cannot be differentiated again (as fused loss kernels often are)."""

    @staticmethod
    def forward(ctx, losses, mask):
        ctx.save_for_backward(losses, mask)
        return losses * mask

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        losses, mask = ctx.saved_tensors
        return grad * mask, grad * losses


def test_a_graph_that_cannot_be_replayed_falls_back_to_a_forward_per_probe():
    """The mask enters the loss through a once-differentiable function: the kept graph's backward fails, so
    each probe runs its own forward and the search names what the plain one names."""
    model, fns, rngs, _ = step({(1, 2, 7): 60.0, (1, 2, 8): 50.0})

    def once(k):
        def loss_fn(mask):  # the plain loss_fn, its mask passed through _OnceMul
            return fns[k](_OnceMul.apply(torch.ones_like(mask), mask))
        return loss_fn

    ones = [torch.ones(B, T)] * K
    want = rows(gradloc_track.locate(model, fns, ones, rng_state=rngs))
    got = gradloc_track.locate(model, [once(k) for k in range(K)], ones, rng_state=rngs, reuse_forward=True)
    assert rows(got) == want and ("token", 1, 2, 7, 8) in want


def test_no_probe_replays_a_graph_before_a_subset_forward_matched_it():
    """A loss whose forward reads the mask (here it scales the model's input), probed with no check armed:
    the subset forward gives other values than the full mask did, so no graph is replayed and every probe
    is the plain backward of its own mask."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(T, T)
    x = torch.randn(B, T)

    def loss_fn(mask):
        return (lin(x * mask.detach()) * mask).sum() / (B * T)  # the forward itself depends on the mask

    params = list(lin.parameters())
    grouping = LayerGrouping.build(["weight", "bias"], "block")
    prober = Prober(params, [loss_fn], [torch.ones(B, T)], [save_rng()], 100, grouping, reuse_forward=True)
    subsets = [[(0, 3)], [(1, t) for t in range(4)], [(2, 5), (3, 9)]]
    prober.probe(0, prober.masks[0])
    got = [prober.probe_terms(0, s) for s in subsets]
    for s, g in zip(subsets, got):
        mask = torch.zeros(B, T)
        for b, t in s:
            mask[b, t] = 1.0
        want = grads_of(lin, loss_fn(mask))
        assert norm([a - b for a, b in zip(g, want)]) <= 1e-6 * norm(want), s
