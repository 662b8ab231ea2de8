"""search.py: confirmed culprits are summarised in the probe's one pass (norm, layer norms, share),
equal to a plain per-parameter backward per term; the confirmation stops at the first miss."""
from __future__ import annotations

import torch

from gradloc_track.grouping import LayerGrouping
from gradloc_track.localizer.probe import Prober, save_rng
from gradloc_track.localizer.search import Hits, _confirm_candidates

from .helpers import B, T, LM, data, sum_loss
from .oracles import dot, grads_of, norm, term_mask


def _setup(n_culprits: int):
    model = LM()
    x, y, w, truth = data(n_culprits=n_culprits, seed=3)
    loss_fn = sum_loss(model, x, y, w)
    names, params = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad])
    prober = Prober(params, [loss_fn], [torch.ones(B, T)], [save_rng()], budget=50,
                    grouping=LayerGrouping.build(names))
    total = grads_of(model, loss_fn(torch.ones(B, T)))
    return model, loss_fn, prober, total, truth, names


def test_confirmed_culprits_match_a_backward_per_term():
    model, loss_fn, prober, total, truth, names = _setup(n_culprits=3)
    per_term = {(b, t): grads_of(model, loss_fn(term_mask((B, T), [(b, t)]))) for b in range(B) for t in range(T)}
    scores = {(0, b, t): norm(g) for (b, t), g in per_term.items()}  # an exact ranking
    tau = sorted(scores.values())[-4] * 1.01  # above every innocent term: the 3 culprits, then a miss
    hits = Hits(prober, total, norm(total) ** 2, scores)
    exhausted, found_sum = _confirm_candidates(prober, hits, sorted(scores), tau)
    assert not exhausted
    assert {(c.batch, c.position) for c in hits.tokens} == truth
    assert prober.count == 4  # 3 hits and the miss that stops the confirmation
    for c in hits.tokens:
        g = per_term[(c.batch, c.position)]
        assert abs(c.grad_norm - norm(g)) <= 1e-5 * norm(g)
        assert abs(c.share - dot(g, total) / norm(total) ** 2) <= 1e-6
        for layer, v in c.layer_norms.items():
            ref = norm([x for x, n in zip(g, names) if prober.grouping.layers[prober.grouping.index[names.index(n)]]
                        == layer])
            assert abs(v - ref) <= 1e-5 * max(ref, 1e-12)
    # the running sum is the confirmed culprits' gradient: ONE buffer
    ref_sum = [sum(per_term[(c.batch, c.position)][k] for c in hits.tokens) for k in range(len(total))]
    assert norm([a - b for a, b in zip(found_sum, ref_sum)]) <= 1e-5 * norm(ref_sum)


def test_budget_that_runs_out_keeps_what_was_confirmed():
    _, _, prober, total, truth, _ = _setup(n_culprits=3)
    prober.budget = 2
    scores = {(0, b, t): (100.0 if (b, t) in truth else 0.0) for b in range(B) for t in range(T)}
    hits = Hits(prober, total, norm(total) ** 2, scores)
    exhausted, found_sum = _confirm_candidates(prober, hits, sorted(scores), tau=1e-6)
    assert exhausted and len(hits.tokens) == 2 and found_sum is not None


def test_a_plain_probers_summary_is_one_pass_a_wrappers_its_own_methods(monkeypatch):
    """``Prober.summary`` takes the fused path (one host transfer) for a plain prober, and a
    subclass with its own ``dot`` (sharded parts) keeps its own methods; both equal the reference."""
    model, loss_fn, prober, total, _, _ = _setup(n_culprits=1)
    g = grads_of(model, loss_fn(term_mask((B, T), [(0, 0), (1, 3)])))
    want = (norm(g), dot(g, total))
    calls = []

    class Wrapped(Prober):
        def dot(self, a, b):
            calls.append("dot")
            return Prober.dot(a, b)

    wrapped = Wrapped(prober.params, prober.loss_fns, prober.masks, prober.rng_states, 1, prober.grouping)
    monkeypatch.setattr(Prober, "layer_norms", lambda *_: (_ for _ in ()).throw(AssertionError("two passes")))
    n, layers, d = prober.summary(g, total)
    assert abs(n - want[0]) <= 1e-5 * want[0] and abs(d - want[1]) <= 1e-5 * abs(want[1])
    assert set(layers) == set(prober.grouping.layers)
    monkeypatch.undo()
    n, _, d = wrapped.summary(g, total)
    assert calls == ["dot"] and abs(d - want[1]) <= 1e-5 * abs(want[1])
