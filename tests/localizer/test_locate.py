"""The localizer against a brute-force oracle (one backward per loss term)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import gradloc_track
from gradloc_track.demo.model import TinyGPT
from gradloc_track.grouping import layer_of

B, T, V = 4, 24, 64


def make_model(kind: str):
    torch.manual_seed(0)
    if kind == "tiny_gpt":
        return TinyGPT(vocab_size=V, n_layer=2, n_head=2, d_model=32, max_seq_len=T, dropout=0.1)
    from transformers import GPT2Config, GPT2LMHeadModel

    conf = GPT2Config(vocab_size=V, n_positions=T, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.1,
                      embd_pdrop=0.1, attn_pdrop=0.0)
    hf = GPT2LMHeadModel(conf)

    class Wrap(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = hf

        def forward(self, idx):
            return self.model(input_ids=idx).logits

    return Wrap()


def batch(culprits, seed=0, weight=60.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V, (B, T), generator=g)
    y = torch.randint(0, V, (B, T), generator=g)
    w = torch.ones(B, T)
    for b, t in culprits:
        w[b, t] = weight  # e.g. an importance ratio gone wild
    return x, y, w


def make_loss_fn(model, x, y, w):
    def loss_fn(mask):
        logits = model(x)
        per = F.cross_entropy(logits.reshape(-1, V), y.reshape(-1), reduction="none").view(B, T)
        return (per * w * mask).sum() / (B * T)  # fixed normalizer

    return loss_fn


def oracle(model, loss_fn):
    """Exact per-term gradient norms and per-layer norms, one backward per term."""
    rng = torch.get_rng_state()
    out = {}
    for b in range(B):
        for t in range(T):
            model.zero_grad(set_to_none=True)
            m = torch.zeros(B, T)
            m[b, t] = 1.0
            torch.set_rng_state(rng)
            loss_fn(m).backward()
            layers: dict[str, float] = {}
            for n, p in model.named_parameters():
                layers[layer_of(n)] = layers.get(layer_of(n), 0.0) + p.grad.double().pow(2).sum().item()
            out[(b, t)] = (math.sqrt(sum(layers.values())), {k: math.sqrt(v) for k, v in layers.items()})
    model.zero_grad(set_to_none=True)
    return out


CASES = [[(1, 5)], [(0, 3), (2, 17), (3, 22)]]


@pytest.mark.parametrize("kind", ["tiny_gpt", "hf_gpt2"])
@pytest.mark.parametrize("culprits", CASES, ids=["single", "multiple"])
def test_exact_methods_match_the_oracle(kind, culprits):
    model = make_model(kind)
    model.train()  # dropout on: probes must replay the same masks
    x, y, w = batch(culprits)
    loss_fn = make_loss_fn(model, x, y, w)
    rng = torch.get_rng_state()  # the "training step" RNG state: probes and oracle replay it
    truth = oracle(model, loss_fn)
    normal_max = max(v for k, (v, _) in truth.items() if k not in culprits)
    culprit_min = min(truth[c][0] for c in culprits)
    assert culprit_min > 5 * normal_max  # the injection makes real outliers
    explicit = math.sqrt(normal_max * culprit_min)
    mask = torch.ones(B, T)
    for method in ("auto", "bisect"):
        for threshold in (None, explicit):
            res = gradloc_track.locate(model, loss_fn, mask, method=method, threshold=threshold, rng_state=rng)
            found = {(c.batch, c.position) for c in res.tokens}
            assert found == set(culprits), (method, threshold, found)  # recall 1, no false positives
            for c in res.tokens:
                norm, layers = truth[(c.batch, c.position)]
                assert c.grad_norm == pytest.approx(norm, rel=1e-4)
                for lay, v in layers.items():
                    assert c.layer_norms[lay] == pytest.approx(v, rel=1e-3, abs=1e-7)
            assert [c.grad_norm for c in res.tokens] == sorted((c.grad_norm for c in res.tokens), reverse=True)
            assert 0 < sum(c.share for c in res.tokens) <= 1.05
            if method == "auto":
                assert res.probes <= len(culprits) + 2


def test_auto_uses_far_fewer_probes_than_bisect():
    model = make_model("tiny_gpt")
    x, y, w = batch([(2, 9)])
    loss_fn = make_loss_fn(model, x, y, w)
    a = gradloc_track.locate(model, loss_fn, torch.ones(B, T), method="auto")
    b = gradloc_track.locate(model, loss_fn, torch.ones(B, T), method="bisect")
    assert {(c.batch, c.position) for c in a.tokens} == {(c.batch, c.position) for c in b.tokens} == {(2, 9)}
    assert a.probes * 4 <= b.probes


def test_ghost_ranks_the_culprit_first_in_one_pass():
    model = make_model("tiny_gpt")
    x, y, w = batch([(3, 11)])
    res = gradloc_track.locate(model, make_loss_fn(model, x, y, w), torch.ones(B, T), method="ghost")
    assert res.probes == 1 and (res.tokens[0].batch, res.tokens[0].position) == (3, 11)
    assert res.ghost_map.shape == (B, T) and res.layer_map.shape[1:] == (B, T)
    assert int(res.ghost_map.argmax()) == 3 * T + 11


def test_budget_is_respected():
    model = make_model("tiny_gpt")
    x, y, w = batch(CASES[1])
    res = gradloc_track.locate(model, make_loss_fn(model, x, y, w), torch.ones(B, T), method="bisect", budget=6)
    assert res.probes <= 6 and res.budget_exhausted


def test_leaves_no_trace():
    model = make_model("tiny_gpt")
    model.train()
    model.h[0].eval()  # a mixed mode must survive too
    x, y, w = batch([(1, 5)])
    loss_fn = make_loss_fn(model, x, y, w)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn(torch.ones(B, T)).backward()
    opt.step()
    model.wpe.weight.grad = None  # a None grad must stay None
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt_state = {k: {kk: vv.clone() if torch.is_tensor(vv) else vv for kk, vv in v.items()}
                 for k, v in opt.state_dict()["state"].items()}
    modes = {n: m.training for n, m in model.named_modules()}
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    with pytest.warns(UserWarning, match="an optimizer step"):  # .grad is from before opt.step(): said
        gradloc_track.locate(model, loss_fn, torch.ones(B, T))
    assert torch.equal(torch.get_rng_state(), rng)
    assert {n: m.training for n, m in model.named_modules()} == modes
    for n, p in model.named_parameters():
        assert torch.equal(p, params[n])
        assert (p.grad is None) == (grads[n] is None)
        if p.grad is not None:
            assert torch.equal(p.grad, grads[n])
    for k, v in opt.state_dict()["state"].items():
        for kk, vv in v.items():
            assert torch.equal(torch.as_tensor(vv), torch.as_tensor(opt_state[k][kk]))


def test_bad_inputs_say_what_to_fix():
    model = make_model("tiny_gpt")
    x, y, w = batch([])
    loss_fn = make_loss_fn(model, x, y, w)
    with pytest.raises(ValueError, match="does not depend on the mask"):
        gradloc_track.locate(model, lambda m: model(x).logsumexp(-1).mean(), torch.ones(B, T))
    with pytest.raises(ValueError, match="shape"):
        gradloc_track.locate(model, loss_fn, torch.ones(B, T + 3))
    with pytest.raises(ValueError, match="2-D"):
        gradloc_track.locate(model, loss_fn, torch.ones(B * T))
    with pytest.raises(ValueError, match="floating point"):
        gradloc_track.locate(model, loss_fn, torch.ones(B, T, dtype=torch.long))
    with pytest.raises(ValueError, match="no loss terms"):
        gradloc_track.locate(model, loss_fn, torch.zeros(B, T))
    with pytest.raises(ValueError, match="method"):
        gradloc_track.locate(model, loss_fn, torch.ones(B, T), method="magic")
    frozen = make_model("tiny_gpt").requires_grad_(False)
    with pytest.raises(ValueError, match="requires_grad"):
        gradloc_track.locate(frozen, loss_fn, torch.ones(B, T))
    nan_w = w.clone()
    nan_w[0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="not finite"):
        gradloc_track.locate(model, make_loss_fn(model, x, y, nan_w), torch.ones(B, T))
