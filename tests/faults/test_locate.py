"""Localizer faults: non-additive losses, buffers, memory, sparse gradients, bad arguments."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import gradloc_track
from gradloc_track.config import ConfigError, LocateConfig
from gradloc_track.localizer.memory import TensorMemoryMeter

V, B, T = 64, 4, 24


class LM(torch.nn.Module):
    """Embedding -> Linear -> head, optionally with a BatchNorm or a sparse embedding."""

    def __init__(self, batchnorm: bool = False, sparse: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(V, 64, sparse=sparse)
        self.mid = torch.nn.Linear(64, 64)
        self.bn = torch.nn.BatchNorm1d(64) if batchnorm else None
        self.head = torch.nn.Linear(64, V)

    def forward(self, x):
        h = torch.tanh(self.mid(torch.tanh(self.emb(x))))  # (B, T, C)
        if self.bn is not None:
            h = self.bn(h.transpose(1, 2)).transpose(1, 2)
        return self.head(h)


def data(n_culprits: int = 1, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V, (B, T), generator=g)
    y = torch.randint(0, V, (B, T), generator=g)
    w = torch.ones(B, T)
    flat = torch.randperm(B * T, generator=g)[:n_culprits]
    w.view(-1)[flat] = 60.0
    return x, y, w, {(int(i) // T, int(i) % T) for i in flat}


def sum_loss(model, x, y, w):
    def loss_fn(mask):
        per = F.cross_entropy(model(x).reshape(-1, V), y.reshape(-1), reduction="none").view(B, T)
        return (per * w * mask).sum() / (B * T)  # fixed normalizer: additive over the mask
    return loss_fn


def test_a_mask_mean_loss_is_rejected_with_the_fix():
    model = LM()
    x, y, w, _ = data()

    def mean_loss(mask):  # a mean over the KEPT terms: subset gradients do not add up
        per = F.cross_entropy(model(x).reshape(-1, V), y.reshape(-1), reduction="none").view(B, T)
        return (per * w * mask).sum() / mask.sum()

    with pytest.raises(ValueError, match="not additive over the mask") as info:
        gradloc_track.locate(model, mean_loss, torch.ones(B, T))
    assert "mask.sum()" in str(info.value) and "n_tokens = token_mask.sum()" in str(info.value)  # the fixed form
    with pytest.raises(ValueError, match=r"not additive over the mask \(micro-batch 1\)"):
        gradloc_track.locate(model, [sum_loss(model, x, y, w), mean_loss], [torch.ones(B, T)] * 2)
    # a loss with a term outside the mask (a constant bonus) is not additive either
    with pytest.raises(ValueError, match="not additive"):
        gradloc_track.locate(model, lambda m: sum_loss(model, x, y, w)(m) + model.head.bias.sum(), torch.ones(B, T))


def test_batchnorm_buffers_are_restored_bitwise():
    model = LM(batchnorm=True).train()
    x, y, w, culprits = data()
    loss_fn = sum_loss(model, x, y, w)
    loss_fn(torch.ones(B, T)).backward()  # the training step moved the running stats once
    before = {n: b.clone() for n, b in model.named_buffers()}
    ids = {n: id(b) for n, b in model.named_buffers()}
    assert int(model.bn.num_batches_tracked) == 1
    res = gradloc_track.locate(model, loss_fn, torch.ones(B, T))
    assert res.probes > 1 and {(c.batch, c.position) for c in res.tokens} == culprits
    for n, b in model.named_buffers():
        assert id(b) == ids[n] and b.dtype == before[n].dtype and torch.equal(b, before[n]), n


def _extra_memory(method: str, n_culprits: int) -> tuple[float, int, int]:
    """Peak tensor bytes ``locate`` holds beyond one plain forward+backward, in gradient sizes."""
    model = LM()
    x, y, w, culprits = data(n_culprits)
    loss_fn = sum_loss(model, x, y, w)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    loss_fn(torch.ones(B, T)).backward()  # the step's own gradients exist, as in training
    with TensorMemoryMeter() as base:
        saved = [p.grad for p in model.parameters()]
        for p in model.parameters():
            p.grad = None
        loss_fn(torch.ones(B, T)).backward()
        for p, g in zip(model.parameters(), saved):
            p.grad = g
    with TensorMemoryMeter() as meter:
        res = gradloc_track.locate(model, loss_fn, torch.ones(B, T), method=method, budget=1000, threshold=0.05)
    assert {(c.batch, c.position) for c in res.tokens} == culprits
    return (meter.peak - base.peak) / grad_bytes, res.probes, len(res.tokens)


@pytest.mark.parametrize("method", ["auto", "bisect", "gradloc"])
def test_peak_extra_memory_does_not_grow_with_the_culprits(method):
    one, _, _ = _extra_memory(method, 1)
    many, probes, found = _extra_memory(method, 32)
    assert found == 32 and probes > 32
    assert many <= 4.0, f"{method}: {many:.2f} gradient sizes held with 32 culprits"
    assert many <= one + 0.25, f"{method}: {one:.2f} -> {many:.2f} gradient sizes from 1 to 32 culprits"


def test_sparse_embedding_gradients_are_localized_and_kept():
    model = LM(sparse=True)
    x, y, w, culprits = data()
    loss_fn = sum_loss(model, x, y, w)
    loss_fn(torch.ones(B, T)).backward()
    assert model.emb.weight.grad.is_sparse
    grad = model.emb.weight.grad
    res = gradloc_track.locate(model, loss_fn, torch.ones(B, T), method="bisect")
    assert {(c.batch, c.position) for c in res.tokens} == culprits
    # exact norm against the dense model's single-term backward
    dense = LM(sparse=False)
    (b, t), = culprits
    m = torch.zeros(B, T)
    m[b, t] = 1.0
    sum_loss(dense, x, y, w)(m).backward()
    ref = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in dense.parameters()))
    assert res.tokens[0].grad_norm == pytest.approx(ref, rel=1e-5)
    assert model.emb.weight.grad is grad and grad.is_sparse  # the step's sparse gradient is put back


@pytest.mark.parametrize("kwargs,match", [
    ({"budget": True}, r"budget=True must be a positive int"),
    ({"budget": 0}, r"budget=0 must be a positive int"),
    ({"budget": 2.5}, r"budget=2.5 must be a positive int"),
    ({"threshold": -1.0}, r"threshold=-1.0 must be a positive finite number"),
    ({"threshold": float("nan")}, r"threshold=nan must be a positive finite number"),
    ({"threshold": float("inf")}, r"threshold=inf must be a positive finite number"),
    ({"threshold": "0.5"}, r"threshold='0.5' must be a positive finite number"),
    ({"threshold": True}, r"threshold=True must be a positive finite number"),
    ({"method": "gradloc"}, r"method='gradloc' needs an explicit threshold"),
    ({"rng_state": [torch.get_rng_state()] * 3}, r"rng_state: pass one state, or one per micro-batch"),
])
def test_bad_arguments_name_the_argument_and_the_fix(kwargs, match):
    model = LM()
    x, y, w, _ = data()
    with pytest.raises(ValueError, match=match):
        gradloc_track.locate(model, [sum_loss(model, x, y, w)] * 2, [torch.ones(B, T)] * 2, **kwargs)


def test_a_loss_fn_returning_a_python_float_or_a_vector_says_what_to_return():
    model = LM()
    x, y, w, _ = data()
    loss_fn = sum_loss(model, x, y, w)
    with pytest.raises(TypeError, match=r"returned float; it must return a scalar torch.Tensor .*\.item\(\)"):
        gradloc_track.locate(model, lambda m: float(loss_fn(m)), torch.ones(B, T))
    with pytest.raises(TypeError, match=r"returned a tensor of shape \(4,\); it must return a scalar"):
        gradloc_track.locate(model, lambda m: loss_fn(m) * torch.ones(4), torch.ones(B, T))
    grads = [p.grad for p in model.parameters()]
    assert all(g is None for g in grads)  # nothing left behind by the failed calls


@pytest.mark.parametrize("field,value,fix", [
    ("max_events", -1, r"use 0 \(never localize\) or a positive whole number"),
    ("max_events", 2.5, "whole number"),
    ("budget", 0, "positive whole number of probes"),
    ("budget", True, "positive whole number of probes"),
    ("threshold", -0.1, "positive per-term gradient norm"),
    ("threshold", float("inf"), "positive per-term gradient norm"),
    ("top_layers", 0, "positive whole number of layers"),
    ("method", "magic", "'gradloc'"),
    ("enabled", "yes", "true or false"),
])
def test_locate_config_names_the_field_and_the_fix(field, value, fix):
    with pytest.raises(ConfigError, match=rf"locate\.{field}=.* is invalid: .*{fix}"):
        LocateConfig(**{field: value})


def test_locate_config_gradloc_needs_a_threshold_through_hydra():
    from hydra import compose, initialize_config_dir

    from gradloc_track.config import to_config
    from gradloc_track.demo.config import register_configs

    from ..conftest import CONF_DIR

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        with pytest.raises(ConfigError, match=r"locate\.threshold=None is invalid: locate\.method=gradloc needs"):
            to_config(compose("config", overrides=["locate.method=gradloc"]))
        with pytest.raises(ConfigError, match=r"locate\.max_events=-1"):
            to_config(compose("config", overrides=["locate.max_events=-1"]))
        cfg = to_config(compose("config", overrides=["locate.method=gradloc", "locate.threshold=0.5"]))
    assert (cfg.locate.method, cfg.locate.threshold) == ("gradloc", 0.5)
