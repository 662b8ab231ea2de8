"""grpo_loss: TRL's GRPO objectives rebuilt as sums over tokens with fixed normalisers.

Each loss type is checked against the equation written out plainly (row means, batch means,
TRL's per-token formula), and every rebuild adds up over disjoint keep masks."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from gradloc_track.integrations.trl.grpo_loss import (GRPOLossSpec, PolicyInputs, ratio_terms, row_weights,
                                                      token_losses, unsupported)

B, C, G = 3, 5, 2


def spec(**kw) -> GRPOLossSpec:
    base = dict(loss_type="grpo", eps_low=0.2, eps_high=0.2, delta=None, beta=0.0, bias_correction_kl=False,
                sequence_level=False, temperature=1.0, accum=G, processes=1, steps_per_generation=1,
                max_completion_length=C, sapo_tau=(1.0, 1.0), vespo=(0.0, 0.0, 0.0, 0.0), entropy_quantile=1.0,
                off_policy_threshold=None, vllm_is=False, entropy_coef=0.0)
    base.update(kw)
    return GRPOLossSpec(**base)


@pytest.fixture
def batch():
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float32)
    lp = -torch.rand(B, C, generator=g) * 3
    old = lp + 0.3 * torch.randn(B, C, generator=g)  # ratios well outside the clip range on some tokens
    ref = lp + 0.1 * torch.randn(B, C, generator=g)
    adv = torch.tensor([1.5, -0.7, 0.4])
    p = PolicyInputs(mask=mask, advantages=adv.unsqueeze(1), old_logps=old, ref_logps=ref, is_ratio=None,
                     sampling_logps=None, num_items=torch.tensor(9.0))
    return lp, p


def clipped_token_loss(lp, old, adv, eps):
    """TRL's clipped surrogate, token by token, in plain loops."""
    out = torch.zeros_like(lp)
    for b in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            r = float(torch.exp(lp[b, t] - old[b, t]))
            a = float(adv[b])
            out[b, t] = -min(r * a, min(max(r, 1 - eps), 1 + eps) * a)
    return out


def test_grpo_is_the_mean_over_rows_of_each_rows_token_mean_over_accumulation(batch):
    lp, p = batch
    terms = token_losses(spec(), None, lp, torch.zeros_like(lp), p)
    per_token = clipped_token_loss(lp, p.old_logps, p.advantages[:, 0], 0.2)
    rows = [(per_token[b] * p.mask[b]).sum() / p.mask[b].sum() for b in range(B)]
    assert torch.allclose(terms.sum(), torch.stack(rows).mean() / G, atol=1e-7)


@pytest.mark.parametrize("loss_type, denominator", [
    ("bnpo", lambda mask: mask.sum() * G),
    ("dr_grpo", lambda mask: B * C * G),
    ("luspo", lambda mask: B * G),
    ("dapo", lambda mask: 9.0 * G),  # num_items_in_batch, one process, one step per generation
])
def test_each_loss_types_normaliser_is_the_papers(batch, loss_type, denominator):
    lp, p = batch
    w = row_weights(spec(loss_type=loss_type), p)
    assert w.shape == (B, 1)
    assert torch.allclose(w, torch.full((B, 1), 1.0 / float(denominator(p.mask))))


def test_kl_term_is_k3_times_beta_and_its_bias_correction_multiplies_by_the_ratio(batch):
    lp, p = batch
    plain = token_losses(spec(), None, lp, torch.zeros_like(lp), p)
    with_kl = token_losses(spec(beta=0.04), None, lp, torch.zeros_like(lp), p)
    d = p.ref_logps - lp
    k3 = torch.exp(d) - d - 1
    w = 1.0 / (B * p.mask.sum(-1, keepdim=True) * G)
    assert torch.allclose(with_kl - plain, 0.04 * k3 * p.mask * w, atol=1e-7)
    corrected = token_losses(spec(beta=0.04, bias_correction_kl=True), None, lp, torch.zeros_like(lp), p)
    r = torch.exp(lp - p.old_logps)
    assert torch.allclose(corrected - plain, 0.04 * k3 * r * p.mask * w, atol=1e-7)


def test_sequence_level_ratio_is_the_masked_mean_of_log_ratios(batch):
    lp, p = batch
    log_r, r = ratio_terms(spec(sequence_level=True), lp, p)
    for b in range(B):
        n = int(p.mask[b].sum())
        want = float((lp[b, :n] - p.old_logps[b, :n]).mean())
        assert log_r[b, 0].item() == pytest.approx(want, abs=1e-6)
    assert torch.allclose(r, torch.exp(log_r))
    tok_log_r, _ = ratio_terms(spec(), lp, p)
    assert tok_log_r.shape == (B, C)


def test_missing_old_logps_means_ratio_one_and_the_loss_is_minus_the_advantage(batch):
    lp, p = batch
    p.old_logps = None
    terms = token_losses(spec(loss_type="luspo"), None, lp, torch.zeros_like(lp), p)
    want = -p.advantages * p.mask / (B * G)
    assert torch.allclose(terms, want, atol=1e-7)


def test_the_entropy_bonus_subtracts_coef_times_the_masked_mean_entropy(batch):
    lp, p = batch
    entropy = torch.rand(B, C, generator=torch.Generator().manual_seed(1))
    plain = token_losses(spec(), None, lp, entropy, p)
    bonus = token_losses(spec(entropy_coef=0.01), None, lp, entropy, p)
    assert (bonus - plain).sum().item() == pytest.approx(
        float(-0.01 * (entropy * p.mask).sum() / p.mask.sum() / G), rel=1e-5)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo"])
def test_subset_losses_add_up_to_the_full_loss_with_gradients(batch, loss_type):
    lp, p = batch
    lp = lp.clone().requires_grad_(True)
    s = spec(loss_type=loss_type, beta=0.02, entropy_coef=0.0)

    def loss(keep):
        return (token_losses(s, None, lp, torch.zeros_like(lp), p) * keep).sum()

    keep_a = torch.zeros(B, C)
    keep_a[0] = 1
    keep_a[1, :2] = 1
    total = loss(torch.ones(B, C))
    parts = loss(keep_a) + loss(1 - keep_a)
    assert torch.allclose(total, parts, atol=1e-7)
    (g_total,) = torch.autograd.grad(total, lp)
    (g_a,) = torch.autograd.grad(loss(keep_a), lp)
    (g_b,) = torch.autograd.grad(loss(1 - keep_a), lp)
    assert torch.allclose(g_total, g_a + g_b, atol=1e-7)


def test_unsupported_names_the_reason_and_the_fix():
    assert "loss_type='gspo_x'" in unsupported(SimpleNamespace(loss_type="gspo_x"))
    moe = unsupported(SimpleNamespace(loss_type="grpo", aux_loss_enabled=True))
    assert "router_aux_loss_coef=0" in moe
    assert "multimodal" in unsupported(SimpleNamespace(loss_type="grpo"), {"pixel_values": torch.zeros(1)})
    assert unsupported(SimpleNamespace(loss_type="dapo"), {"pixel_values": None}) is None


def test_policy_inputs_take_the_tool_mask_and_widen_a_per_row_advantage():
    inputs = {"completion_mask": torch.ones(2, 3, dtype=torch.long), "tool_mask": torch.tensor([[1, 0, 1], [1, 1, 0]]),
              "advantages": torch.tensor([0.5, -0.5])}
    p = PolicyInputs.from_inputs(inputs)
    assert p.mask.dtype == torch.float32 and p.mask.tolist() == [[1, 0, 1], [1, 1, 0]]
    assert p.advantages.shape == (2, 1) and p.old_logps is None and p.num_items is None
