"""GradMonitor against a plain per-parameter loop, and its logging/sync contract."""
from __future__ import annotations

import math
import re

import pytest
import torch

from gradloc_track import GradMonitor, MemoryTracker
from gradloc_track.config import ConfigError, MonitorConfig
from gradloc_track.grouping import layer_of


def backward(model, seed=0, B=2, T=16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 64, (B, T), generator=g)
    model.zero_grad(set_to_none=True)
    model(x).float().logsumexp(-1).mean().backward()


def reference(model):
    """Plain loop: one norm per parameter, layers summed by hand."""
    per = {n: p.grad.double().norm().item() for n, p in model.named_parameters()}
    layers: dict[str, float] = {}
    for n, v in per.items():
        lay = layer_of(n, "block")
        layers[lay] = layers.get(lay, 0.0) + v * v
    return per, {k: math.sqrt(v) for k, v in layers.items()}


def test_norms_match_a_per_parameter_loop(tiny_gpt):
    tracker = MemoryTracker()
    mon = GradMonitor(tiny_gpt, tracker=tracker, per_tensor=True)
    backward(tiny_gpt)
    stats = mon.after_backward(0)
    per, layers = reference(tiny_gpt)
    assert stats.grad_norms.keys() == per.keys()
    for n, v in per.items():
        assert stats.grad_norms[n] == pytest.approx(v, rel=1e-5)
        assert tracker.metrics[0][1][f"grad_norm/tensor/{n}"] == pytest.approx(v, rel=1e-5)
    assert stats.global_norm == pytest.approx(math.sqrt(sum(v * v for v in per.values())), rel=1e-5)
    for lay, v in layers.items():
        assert tracker.metrics[0][1][f"grad_norm/{lay}"] == pytest.approx(v, rel=1e-5)
    assert set(layers) == {"wte", "wpe", "h.0", "h.1", "ln_f", "lm_head"}


def test_weight_norms_ratios_and_adamc_ratio(tiny_gpt):
    tracker = MemoryTracker()
    opt = torch.optim.AdamW(tiny_gpt.parameters(), lr=2e-3, weight_decay=0.1)
    mon = GradMonitor(tiny_gpt, tracker=tracker, optimizer=opt)
    backward(tiny_gpt)
    mon.after_backward(0)
    m = tracker.metrics[0][1]
    _, glayers = reference(tiny_gpt)
    w = {}
    for n, p in tiny_gpt.named_parameters():
        w[layer_of(n)] = w.get(layer_of(n), 0.0) + p.double().norm().item() ** 2
    for lay, sq in w.items():
        assert m[f"weight_norm/{lay}"] == pytest.approx(math.sqrt(sq), rel=1e-5)
        assert m[f"grad_weight_ratio/{lay}"] == pytest.approx(glayers[lay] / math.sqrt(sq), rel=1e-5)
    assert m["lr"] == pytest.approx(2e-3) and m["weight_decay"] == pytest.approx(0.1)
    assert m["adamc/steady_state_ratio"] == pytest.approx(math.sqrt(2 * 0.1 / 2e-3))


def test_log_every_and_the_documented_keys(tiny_gpt):
    tracker = MemoryTracker()
    mon = GradMonitor(tiny_gpt, tracker=tracker, log_every=3, per_tensor=True)
    for step in range(7):
        backward(tiny_gpt, seed=step)
        stats = mon.after_backward(step)
        assert stats.logged == (step % 3 == 0)
    assert [s for s, _ in tracker.metrics] == [0, 3, 6]
    doc = GradMonitor.__doc__
    documented = set(re.findall(r"``((?:grad_norm|weight_norm|grad_weight_ratio)/[^`]+)``", doc))
    patterns = [re.compile("^" + re.escape(k).replace(re.escape("<layer>"), "[^/]+")
                           .replace(re.escape("<param>"), ".+") + "$") for k in documented]
    for key in tracker.keys():
        if key.split("/")[0] in {"grad_norm", "weight_norm", "grad_weight_ratio"}:
            assert any(p.match(key) for p in patterns), f"{key} is logged but not documented"


def test_no_host_sync_on_steps_that_do_not_log(tiny_gpt, monkeypatch):
    calls = []
    for name in ("item", "tolist", "__float__", "cpu", "numpy", "__bool__"):
        orig = getattr(torch.Tensor, name)

        def spy(self, *a, _orig=orig, _name=name, **k):
            calls.append(_name)
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, spy)
    mon = GradMonitor(tiny_gpt, tracker=MemoryTracker(), log_every=2)
    backward(tiny_gpt)
    calls.clear()
    mon.after_backward(1)
    assert calls == []
    mon.after_backward(2)
    assert calls == ["tolist"]  # exactly one transfer per logging step


@pytest.mark.parametrize("mode,expected", [
    ("module", {"h.0.attn.qkv", "h.0.ln1", "lm_head"}),
    ("tensor", {"h.0.attn.qkv.weight", "lm_head.weight"}),
])
def test_grouping_modes(tiny_gpt, mode, expected):
    tracker = MemoryTracker()
    GradMonitor(tiny_gpt, tracker=tracker, group_by=mode)
    mon = GradMonitor(tiny_gpt, tracker=tracker, group_by=mode)
    backward(tiny_gpt)
    mon.after_backward(0)
    layers = {k[len("grad_norm/"):] for k in tracker.keys() if k.startswith("grad_norm/")}
    assert expected <= layers


def test_custom_groups(tiny_gpt):
    tracker = MemoryTracker()
    mon = GradMonitor(tiny_gpt, tracker=tracker, groups={"attention": r"\.attn\.", "mlp": r"\.mlp\."})
    backward(tiny_gpt)
    mon.after_backward(0)
    per, _ = reference(tiny_gpt)
    attn = math.sqrt(sum(v * v for n, v in per.items() if ".attn." in n))
    assert tracker.metrics[0][1]["grad_norm/attention"] == pytest.approx(attn, rel=1e-5)


def test_nonfinite_gradients_are_counted_not_fatal(tiny_gpt):
    tracker = MemoryTracker()
    mon = GradMonitor(tiny_gpt, tracker=tracker)
    backward(tiny_gpt)
    tiny_gpt.lm_head.weight.grad[0, 0] = float("nan")
    mon.after_backward(0)
    assert tracker.metrics[0][1]["grad_norm/nonfinite"] == 1.0


def test_bad_options_name_the_field(tiny_gpt):
    with pytest.raises(ConfigError, match="monitor.log_every"):
        GradMonitor(tiny_gpt, log_every=0)
    with pytest.raises(ConfigError, match="monitor.group_by"):
        MonitorConfig(group_by="rows")
    with pytest.raises(TypeError, match="log_evry"):
        GradMonitor(tiny_gpt, log_evry=2)
