"""The additivity check catches every mask-dependent normaliser (issue 16, item 4).

A subset probe is meaningful only when ``loss_fn(mask)`` is a SUM over the kept terms with a
FIXED normaliser. Splitting the terms into a first and a second half keeps whole samples
together, so a per-sample mean passed; masks that change the per-sample counts unevenly
(interleaved within each sample) catch it. Each rejection shows the fixed-normaliser form for
that case; the fixed forms are accepted and localize the culprit at its true norm.
"""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import gradloc_track

from .oracles import grads_of, norm, term_mask, tiny_gpt

V, B, T = 64, 4, 16
CULPRIT = (1, 5)


def setup():
    model = tiny_gpt(V, T)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, V, (B, T), generator=g)
    y = torch.randint(0, V, (B, T), generator=g)
    w = torch.ones(B, T)
    w[CULPRIT] = 60.0
    full = torch.ones(B, T)
    full[2, 10:] = 0.0  # uneven per-sample counts: padding in sample 2
    full[3, 12:] = 0.0

    def per_tok():
        return F.cross_entropy(model(x).reshape(-1, V), y.reshape(-1), reduction="none").view(B, T) * w

    return model, x, y, per_tok, full


def per_sample_mean(per_tok, full):
    return lambda m: ((per_tok() * m).sum(1) / m.sum(1)).mean()


def per_sample_mean_clamped(per_tok, full):
    return lambda m: ((per_tok() * m).sum(1) / m.sum(1).clamp(min=1)).mean()


def token_mean(per_tok, full):
    return lambda m: (per_tok() * m).sum() / m.sum()


MEANS = {"per-sample mean": (per_sample_mean, "full_counts = token_mask.sum(1)"),
         "per-sample mean, clamped": (per_sample_mean_clamped, "full_counts = token_mask.sum(1)"),
         "batch token mean": (token_mean, "n_tokens = token_mask.sum()")}


@pytest.mark.parametrize("name", list(MEANS))
def test_mask_dependent_normalisers_are_rejected_with_their_fix(name):
    model, x, y, per_tok, full = setup()
    make, fix = MEANS[name]
    with pytest.raises(ValueError, match="not additive") as err:
        gradloc_track.locate(model, make(per_tok, full), full)
    assert fix in str(err.value), str(err.value)


def test_cross_entropy_ignore_index_mean_is_rejected_with_its_fix():
    model, x, y, per_tok, full = setup()

    def loss_fn(m):  # the usual HF/PyTorch way: masked targets become -100, then the default mean
        return F.cross_entropy(model(x).reshape(-1, V), y.masked_fill(m == 0, -100).reshape(-1), ignore_index=-100)

    with pytest.raises(ValueError, match="not additive") as err:
        gradloc_track.locate(model, loss_fn, full)
    assert "reduction='none'" in str(err.value) and "n_tokens = token_mask.sum()" in str(err.value)


def test_the_fixed_normaliser_forms_are_accepted_and_exact():
    model, x, y, per_tok, full = setup()
    full_counts = full.sum(1)  # computed ONCE from the full mask
    n_tokens = full.sum()
    fixed = {"per-sample": lambda m: ((per_tok() * m).sum(1) / full_counts).mean(),
             "token": lambda m: (per_tok() * m).sum() / n_tokens}
    for name, loss_fn in fixed.items():
        res = gradloc_track.locate(model, loss_fn, full)
        assert [(c.batch, c.position) for c in res.tokens] == [CULPRIT], name
        want = norm(grads_of(model, loss_fn(term_mask((B, T), [CULPRIT]))))
        assert res.tokens[0].grad_norm == pytest.approx(want, rel=1e-5), name


def test_a_per_sample_mean_over_micro_batches_is_caught_in_the_micro_batch_it_is_in():
    model, x, y, per_tok, full = setup()

    def fixed(m):
        return (per_tok() * m).sum() / full.sum()

    with pytest.raises(ValueError, match=r"not additive.*micro-batch 1"):
        gradloc_track.locate(model, [fixed, per_sample_mean_clamped(per_tok, full)], [full, full])


# -- judged on the scale of the terms, not of the loss (issue 28, TRL) ----------------------------


def grpo_case(on_policy: bool = True):
    """GRPO's per-token loss ``-A_b * ratio`` with groups of 2 completions whose advantages are
    reward minus the group's mean (float32): on-policy (ratio = exp(lp - lp.detach()) = 1) the
    terms cancel across each group, so the loss is ~1e-8 while every term and the gradient are
    O(1). Sample 3 holds a token with a wild advantage weight (the culprit)."""
    model = tiny_gpt(V, T)
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, V, (B, T), generator=g)
    y = torch.randint(0, V, (B, T), generator=g)
    rewards = torch.tensor([[0.3, 1.7], [2.9, 0.1]])
    adv = (rewards - rewards.mean(1, keepdim=True)).reshape(B, 1).expand(B, T).clone()
    adv[CULPRIT] *= 60.0
    adv[CULPRIT[0] ^ 1, CULPRIT[1]] *= 60.0  # the same term of its group partner: the loss still cancels
    shift = 0.0 if on_policy else 0.3 * torch.randn(B, T, generator=g)

    def logp():
        return -F.cross_entropy(model(x).reshape(-1, V), y.reshape(-1), reduction="none").view(B, T)

    def ratio():
        lp = logp()
        return torch.exp(lp - (lp.detach() + shift))

    return model, adv, ratio


def test_an_on_policy_grpo_loss_of_1e_8_with_an_o1_gradient_is_additive():
    model, adv, ratio = grpo_case()
    n = B * T

    def loss_fn(m):  # additive: a fixed normaliser
        return (-adv * ratio() * m).sum() / n

    full = torch.ones(B, T)
    value = float(loss_fn(full))
    grad = norm(grads_of(model, loss_fn(full)))
    assert abs(value) < 1e-6 < 1e-2 < grad  # the loss cancels, the gradient does not
    res = gradloc_track.locate(model, loss_fn, full)  # 0.3 rejected this (tolerance relative to the loss)
    assert CULPRIT in {(c.batch, c.position) for c in res.tokens}
    c = next(c for c in res.tokens if (c.batch, c.position) == CULPRIT)
    assert c.grad_norm == pytest.approx(norm(grads_of(model, loss_fn(term_mask((B, T), [CULPRIT])))), rel=1e-5)


@pytest.mark.parametrize("on_policy", [True, False], ids=["on-policy", "off-policy"])
def test_a_per_sample_mean_grpo_loss_is_still_rejected(on_policy):
    model, adv, ratio = grpo_case(on_policy)
    full = torch.ones(B, T)

    def loss_fn(m):  # GRPO's default: each completion's mean over its KEPT tokens
        return ((-adv * ratio() * m).sum(1) / m.sum(1).clamp(min=1)).mean()

    with pytest.raises(ValueError, match="not additive|does not depend on the mask"):
        gradloc_track.locate(model, loss_fn, full)


def test_a_loss_without_a_derivative_in_the_mask_is_checked_on_its_halves():
    """``loss_fn`` that indexes with the mask (no gradient reaches it): additive is accepted,
    a mean over the kept terms rejected, from the two halves' losses."""
    model, x, y, per_tok, full = setup()
    n = full.sum()
    res = gradloc_track.locate(model, lambda m: per_tok()[m.bool()].sum() / n, full)
    assert [(c.batch, c.position) for c in res.tokens] == [CULPRIT]
    with pytest.raises(ValueError, match="not additive"):
        gradloc_track.locate(model, lambda m: per_tok()[m.bool()].mean(), full)


def test_an_auxiliary_term_that_ignores_the_mask_is_named_with_its_fix_and_the_fix_is_accepted():
    """Tester round 12: CE plus a router-style loss computed from the whole batch was met with the per-sample
    mean's fix, for a normaliser that was already right. Every split adds the constant part once too often
    (``a + b - full = aux``): said with its value, and the spread form it suggests localizes the culprit."""
    model, x, y, per_tok, full = setup()
    n_tokens = full.sum()

    def aux():  # depends on the parameters and the whole batch, never on the mask
        return 50.0 * model(x).softmax(-1).mean((0, 1)).pow(2).sum()

    with pytest.raises(ValueError, match="not additive") as err:
        gradloc_track.locate(model, lambda m: (per_tok() * m).sum() / n_tokens + aux(), full)
    said = str(err.value)
    counted = re.search(r"every split counts (\S+) twice", said)
    assert counted and float(counted.group(1)) == pytest.approx(float(aux()), rel=1e-3) and "ignores the mask" in said
    assert "aux * mask.sum() / token_mask.sum()" in said and "per-sample mean" not in said

    def spread(m):
        return (per_tok() * m).sum() / n_tokens + aux() * m.sum() / n_tokens
    res = gradloc_track.locate(model, spread, full)
    assert [(c.batch, c.position) for c in res.tokens] == [CULPRIT]
