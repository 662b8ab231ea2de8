"""grpo_batch: a GRPO micro-batch laid out at model positions, its log-probs against a plain loop, and
probes that replay the step's dropout exactly."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from gradloc_track.integrations.trl.grpo_batch import GRPOMicroBatch, make_loss_fn, policy_logps, rebuilt_grad
from gradloc_track.integrations.trl.grpo_loss import PolicyInputs
from gradloc_track.localizer.probe import save_rng

from .test_grpo_loss import spec

V = 13


class Tiny(torch.nn.Module):
    def __init__(self, dropout=0.0):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.drop, self.head = torch.nn.Embedding(V, 8), torch.nn.Dropout(dropout), torch.nn.Linear(8, V)

    def forward(self, input_ids, attention_mask=None):
        h = self.emb(input_ids).cumsum(1)  # causal enough: position t sees tokens <= t
        return SimpleNamespace(logits=self.head(self.drop(torch.tanh(h))))


def micro_batch(temperature=1.0) -> GRPOMicroBatch:
    prompt = torch.tensor([[0, 3, 4], [5, 6, 7]])  # left-padded (0 = pad)
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    completion = torch.tensor([[8, 9, 0, 0], [10, 11, 12, 1]])  # right-padded
    completion_mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    p = PolicyInputs(mask=completion_mask.float(), advantages=torch.tensor([[1.0], [-1.0]]), old_logps=None,
                     ref_logps=None, is_ratio=None, sampling_logps=None, num_items=None)
    s = spec(accum=1, max_completion_length=4, temperature=temperature)
    return GRPOMicroBatch(prompt, prompt_mask, completion, completion_mask, p, s, save_rng())


def test_completion_terms_sit_one_before_the_token_they_score():
    mb = micro_batch()
    assert (mb.P, mb.C) == (3, 4)
    assert mb.token_mask().tolist() == [[0, 0, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1, 0]]
    ids, _ = mb.model_inputs()
    shown = mb.display_ids()
    for b in range(2):
        for t in range(6):
            assert shown[b, t] == ids[b, t + 1]  # the term at t scores (and shows) token t+1
    # prompt (0) / completion (1) of the token each position shows, -1 where it shows padding (or nothing)
    assert mb.segment_ids().tolist() == [[0, 0, 1, 1, -1, -1, -1], [0, 0, 1, 1, 1, 1, -1]]


def test_log_probs_are_the_sampled_tokens_log_softmax_at_the_temperature():
    mb = micro_batch(temperature=0.7)
    model = Tiny()
    with torch.no_grad():
        lp, entropy = policy_logps(model, mb)
        logits = model(mb.model_inputs()[0]).logits / 0.7
    for b in range(2):
        for j in range(mb.C):
            if mb.completion_mask[b, j]:
                row = logits[b, mb.P - 1 + j].log_softmax(-1)
                assert lp[b, j].item() == pytest.approx(row[mb.completion_ids[b, j]].item(), abs=1e-6)
                assert entropy[b, j].item() == pytest.approx(float(-(row.exp() * row).sum()), abs=1e-5)
            else:
                assert lp[b, j] == 0 and entropy[b, j] == 0


def test_probes_replay_the_micro_batchs_dropout_and_add_up():
    model = Tiny(dropout=0.5)
    mb = micro_batch()  # its RNG saved now: the step's dropout
    torch.manual_seed(123)  # the caller's RNG moves on
    loss_fn = make_loss_fn(model, None, mb)
    from gradloc_track.localizer.probe import restore_rng

    def probe(keep):
        restore_rng(mb.rng)
        return loss_fn(keep)

    keep = mb.token_mask()
    first = torch.zeros_like(keep)
    first[0] = keep[0]
    full, a, b = probe(keep), probe(first), probe(keep - first)
    assert torch.allclose(full, a + b, atol=1e-7)
    w = model.head.weight
    g = rebuilt_grad(model, None, mb, w)
    (g_ref,) = torch.autograd.grad(probe(keep), w)
    assert torch.allclose(g, g_ref, atol=1e-7)  # the same dropout mask as the replayed probe
    state = save_rng()
    rebuilt_grad(model, None, mb, w)
    assert torch.equal(save_rng()["cpu"], state["cpu"])  # the caller's RNG is left where it was
