"""``localizer/nonfinite``: which samples made a step's gradient (or loss) NaN/Inf, on real small models.

Every finding is checked against a brute-force oracle that shares nothing with the search: each
sample's own forward and backward on its row ALONE (no mask, no prober), so "which rows are
non-finite by themselves" is known independently of masking.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import gradloc_track
from gradloc_track.demo.model import TinyGPT
from gradloc_track.localizer import nonfinite

from .helpers import LM

V, B, T = 32, 16, 8


def tiny(seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(vocab_size=V, n_layer=1, n_head=2, d_model=16, max_seq_len=T)


def batch(seed: int = 1, rows: int = B):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (rows, T), generator=g), torch.randint(0, V, (rows, T), generator=g)


def per_token(model, x, y, kind: str, where=()) -> torch.Tensor:
    """(rows, T) per-token losses; ``where``: (row, position) cells made bad, by ``kind``:
    ``log0``: -log of a softmax probability that underflows to 0 (loss Inf, gradient NaN: an RL
    ratio computed as ``log(probs)``); ``advantage``: a huge advantage on a surrogate whose value is
    0 (finite loss, gradient Inf); ``neginf``: a -inf target logit under log-softmax (loss Inf,
    gradient finite)."""
    logits = model(x)
    if kind == "log0":
        bias = torch.zeros_like(logits)
        for r, t in where:
            bias[r, t, y[r, t]] = -1e4
        return -torch.log((logits + bias).softmax(-1).gather(-1, y[..., None])[..., 0])
    if kind == "neginf":
        logits = logits.clone()
        for r, t in where:
            logits[r, t, y[r, t]] = -math.inf
    per = F.cross_entropy(logits.reshape(-1, V), y.reshape(-1), reduction="none").view(y.shape)
    if kind == "advantage":
        lp = -per
        huge = torch.zeros_like(per)
        for r, t in where:
            huge[r, t] = 1e30
        per = per + (lp - lp.detach()) * huge * huge  # value exactly 0; gradient 1e60 * dlogp = Inf
    return per


def loss_of(model, x, y, kind: str, where=()):
    n = x.numel()

    def loss_fn(mask):
        return (per_token(model, x, y, kind, where) * mask).sum() / n  # fixed normaliser: additive
    return loss_fn


def finite(model) -> bool:
    return all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)


def oracle(model, x, y, kind: str, where=()) -> tuple[set[int], set[int]]:
    """(rows whose OWN gradient is non-finite, rows whose own loss is), one forward+backward per row alone."""
    bad_grad, bad_loss = set(), set()
    for r in range(x.shape[0]):
        cells = [(0, t) for rr, t in where if rr == r]
        model.zero_grad(set_to_none=True)
        loss = per_token(model, x[r:r + 1], y[r:r + 1], kind, cells).sum() / x.numel()
        loss.backward()
        if not finite(model):
            bad_grad.add(r)
        if not math.isfinite(float(loss.detach())):
            bad_loss.add(r)
    model.zero_grad(set_to_none=True)
    return bad_grad, bad_loss


@pytest.mark.parametrize("method", ["auto", "gradloc"])
def test_a_log_of_zero_names_its_sample_and_token_and_says_its_loss_is_inf(method):
    model, (x, y) = tiny(), batch()
    bad = [(3, 5)]
    loss_fn = loss_of(model, x, y, "log0", bad)
    loss_fn(torch.ones(B, T)).backward()
    assert not finite(model)
    r = gradloc_track.locate(model, loss_fn, torch.ones(B, T), method=method, threshold=1.0)
    f = r.nonfinite
    grad_rows, loss_rows = oracle(model, x, y, "log0", bad)
    assert set(f.samples) == grad_rows == loss_rows == {3} and f.terms == ((3, 5),) and f.where == "samples"
    (u,) = f.units
    assert u.loss == math.inf and u.grad == "NaN"
    assert "sample 3's loss is Inf (token 5): its gradient is NaN" in f.detail
    # NaN reaches every probe through the mask (0 x Inf): said, not searched sample by sample
    assert "every probe is non-finite" in f.detail
    (row,) = r.culprits
    assert (row.level, row.batch, row.position, row.share, row.nonfinite) == ("token", 3, 5, None, True)
    assert r.probes <= 1 + 4  # the micro-batch probe; the term map, the sample, the rest, no term kept


def test_two_bad_samples_among_16_are_found_by_halving_and_agree_with_the_oracle():
    model, (x, y) = tiny(), batch()
    bad = [(4, 2), (11, 6)]
    loss_fn = loss_of(model, x, y, "advantage", bad)
    loss_fn(torch.ones(B, T)).backward()
    grads = [p.grad for p in model.parameters()]
    r = gradloc_track.locate(model, loss_fn, torch.ones(B, T))
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))  # .grad left as backward left it
    f = r.nonfinite
    grad_rows, loss_rows = oracle(model, x, y, "advantage", bad)
    assert set(f.samples) == grad_rows == {4, 11} and not loss_rows  # finite losses: found by isfinite halving
    assert f.terms == ((4, 2), (11, 6)) and f.where == "samples"
    assert all(u.grad != "finite" and math.isfinite(u.loss) for u in f.units)
    assert "sample 4's gradient is" in f.detail and "(token 2); its loss is" in f.detail
    k, n = 2, B
    assert f.probes <= 2 * k * math.log2(n) + 2 + 2 * k * math.log2(T)  # samples, map + empty, then terms


def test_an_fp16_overflow_from_the_sum_is_said_with_the_numbers():
    """Identical samples in float16 (a repeated document): each sample's gradient is finite, their
    sum is past 65504."""
    torch.manual_seed(0)
    model = LM().half()
    x, y = (t[:1].expand(8, T) for t in batch())
    scale = torch.ones(())

    def loss_fn(mask):
        per = F.cross_entropy(model(x).float().reshape(-1, 64), y.reshape(-1) % 64, reduction="none").view(8, T)
        return (per * mask).sum() * scale / (8 * T)

    one = torch.zeros(8, T)
    one[0] = 1
    loss_fn(one).backward()
    amax = max(float(p.grad.abs().max()) for p in model.parameters())
    scale.fill_(0.3 * 65504 / amax)  # one sample at 30% of float16's max: 4 of them overflow
    model.zero_grad(set_to_none=True)
    r = gradloc_track.locate(model, loss_fn, torch.ones(8, T))
    f = r.nonfinite
    assert f.where == "sum" and f.samples == () and r.culprits == []
    assert "float16's max 65504" in f.detail and "none is NaN or Inf" in f.detail
    largest = float(f.detail.split("largest element ")[1].split(")")[0])
    assert 0.25 * 65504 < largest < 0.35 * 65504
    for b in range(8):  # oracle: every sample alone is finite, all of them together are not
        model.zero_grad(set_to_none=True)
        loss_fn(nonfinite_mask(b)).backward()
        assert finite(model)
    model.zero_grad(set_to_none=True)
    loss_fn(torch.ones(8, T)).backward()
    assert not finite(model)


def nonfinite_mask(b: int) -> torch.Tensor:
    m = torch.zeros(8, T)
    m[b] = 1
    return m


def test_a_finite_step_has_no_finding():
    model, (x, y) = tiny(), batch(rows=4)
    r = gradloc_track.locate(model, loss_of(model, x, y, "advantage"), torch.ones(4, T))
    assert r.nonfinite is None and not any(c.nonfinite for c in r.culprits)


def test_an_inf_loss_with_a_finite_gradient_names_the_sample_next_to_the_norm_search():
    model, (x, y) = tiny(), batch(rows=4)
    loss_fn = loss_of(model, x, y, "neginf", [(2, 1)])
    r = gradloc_track.locate(model, loss_fn, torch.ones(4, T))
    f = r.nonfinite
    assert f is not None and f.samples == (2,) and f.terms == ((2, 1),)
    assert f.units[0].grad == "finite" and f.units[0].loss == math.inf
    assert oracle(model, x, y, "neginf", [(2, 1)]) == (set(), {2})
    assert [c for c in r.culprits if c.nonfinite][0].position == 1
    assert math.isfinite(r.total_norm) and r.step_check is None  # the norm search ran (no .grad to check)


def test_nan_weights_make_every_probe_nan_and_are_named():
    model, (x, y) = tiny(), batch(rows=4)
    with torch.no_grad():
        model.h[0].mlp.fc.weight[0, 0] = math.nan
    r = gradloc_track.locate(model, loss_of(model, x, y, "ok"), torch.ones(4, T))
    assert r.nonfinite.where == "all" and r.nonfinite.samples == ()
    assert "the weights hold NaN/Inf (h.0.mlp.fc.weight)" in r.nonfinite.detail


def test_micro_batches_that_overflow_only_together_cost_no_probe():
    torch.manual_seed(0)
    model = LM().half()
    x, y = (t[:2] for t in batch())
    scale = torch.ones(())

    def loss_fn(mask):
        per = F.cross_entropy(model(x).float().reshape(-1, 64), y.reshape(-1) % 64, reduction="none").view(2, T)
        return (per * mask).sum() * scale / (2 * T)

    loss_fn(torch.ones(2, T)).backward()
    scale.fill_(0.6 * 65504 / max(float(p.grad.abs().max()) for p in model.parameters()))
    model.zero_grad(set_to_none=True)
    r = gradloc_track.locate(model, [loss_fn, loss_fn], [torch.ones(2, T)] * 2)
    assert r.nonfinite.where == "sum" and "each micro-batch's gradient is finite" in r.nonfinite.detail
    assert r.nonfinite.probes == 0 and all(math.isfinite(v) for v in r.micro_batch_norms)


def test_culprit_rows_are_tokens_when_few_else_the_sample():
    few = nonfinite.NonfiniteFinding("samples", (1,), ((1, 2),), "", (nonfinite.NonfiniteSample(1, terms=(2,),
                                                                                                  n_terms=8),))
    many = nonfinite.NonfiniteFinding("samples", (1,), (), "", (nonfinite.NonfiniteSample(1, n_terms=8, end=8),))
    assert [(c.level, c.position, c.nonfinite, c.share) for c in nonfinite.culprit_rows(few)] == [
        ("token", 2, True, None)]
    assert [(c.level, c.batch, c.end, c.nonfinite) for c in nonfinite.culprit_rows(many)] == [("sample", 1, 8, True)]


def test_a_packed_document_is_named_not_its_whole_row():
    model, (x, y) = tiny(), batch(rows=4)
    docs = torch.zeros(4, T, dtype=torch.long)
    docs[:, T // 2:] = 1  # two documents per row
    loss_fn = loss_of(model, x, y, "advantage", [(2, T - 1)])
    f = gradloc_track.locate(model, loss_fn, torch.ones(4, T), document_ids=docs).nonfinite
    (u,) = f.units
    assert (u.batch, u.document, u.start, u.end, u.terms) == (2, 1, T // 2, T, (T - 1,))
    assert "document 1 (sample 2)'s gradient is" in f.detail


def test_a_nan_only_in_grad_does_not_replay_and_no_sample_is_blamed_for_it():
    """A corrupted ``.grad`` (a bit flip): the replayed probes are finite, so the finding says the
    NaN does not come from the batch."""
    model, (x, y) = tiny(), batch(rows=4)
    loss_fn = loss_of(model, x, y, "ok")
    loss_fn(torch.ones(4, T)).backward()
    model.h[0].mlp.fc.weight.grad[1, 2] = math.nan
    with pytest.warns(UserWarning, match="do not reproduce"):
        r = gradloc_track.locate(model, loss_fn, torch.ones(4, T))
    assert r.nonfinite.where == "replay" and r.nonfinite.samples == ()
    assert "the step's .grad holds NaN/Inf (h.0.mlp.fc.weight) but the replayed probes' gradient is finite" \
        in r.nonfinite.detail
    assert not any(c.nonfinite for c in r.culprits) and math.isfinite(r.total_norm)


def test_a_budget_too_small_says_so_and_keeps_what_it_found():
    model, (x, y) = tiny(), batch()
    loss_fn = loss_of(model, x, y, "advantage", [(4, 2), (11, 6)])
    r = gradloc_track.locate(model, loss_fn, torch.ones(B, T), budget=12)
    f = r.nonfinite
    assert r.probes <= 12 and f.budget_exhausted and r.budget_exhausted
    assert "the probe budget ran out (12 probes) before the search ended: raise locate.budget" in f.detail
    assert set(f.samples) <= {4, 11} and f.samples  # the halving had named one before it stopped
