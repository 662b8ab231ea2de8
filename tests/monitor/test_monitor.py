"""GradMonitor against a plain per-parameter loop, its keys, grouping and config errors."""
from __future__ import annotations

import math
import re

import pytest
import torch

from gradloc_track import GradMonitor, MemoryTracker
from gradloc_track.clip import AdaGC
from gradloc_track.config import ConfigError, MonitorConfig
from gradloc_track.grouping import layer_of


def backward(model, seed=0, B=2, T=16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 64, (B, T), generator=g)
    model.zero_grad(set_to_none=True)
    model(x).float().logsumexp(-1).mean().backward()


def reference(model, mode="block", patterns=None):
    """Plain loop in float64: one norm per parameter, layers summed by hand."""
    per = {n: p.grad.double().norm().item() for n, p in model.named_parameters()}
    layers: dict[str, float] = {}
    for n, v in per.items():
        lay = layer_of(n, mode, patterns)
        layers[lay] = layers.get(lay, 0.0) + v * v
    return per, {k: math.sqrt(v) for k, v in layers.items()}


def weight_layers(model, mode="block"):
    w: dict[str, float] = {}
    for n, p in model.named_parameters():
        w[layer_of(n, mode)] = w.get(layer_of(n, mode), 0.0) + p.double().norm().item() ** 2
    return {k: math.sqrt(v) for k, v in w.items()}


def test_norms_match_a_per_parameter_loop(tiny_gpt):
    tracker = MemoryTracker()
    mon = GradMonitor(tiny_gpt, tracker=tracker, per_tensor=True)
    backward(tiny_gpt)
    stats = mon.after_backward(0)
    per, layers = reference(tiny_gpt)
    m = tracker.metrics[0][1]
    assert list(stats.grad_norms) == [n for n, _ in tiny_gpt.named_parameters()]  # same names, same order
    for n, v in per.items():
        assert stats.grad_norms[n] == pytest.approx(v, rel=1e-5)
        assert m[f"grad_norm/tensor/{n}"] == pytest.approx(v, rel=1e-5)
    total = math.sqrt(sum(v * v for v in per.values()))
    assert stats.global_norm == pytest.approx(total, rel=1e-5)
    assert m["grad_norm/global"] == pytest.approx(total, rel=1e-5)
    assert set(layers) == {"wte", "wpe", "h.0", "h.1", "ln_f", "lm_head"} == set(stats.layer_norms)
    for lay, v in layers.items():
        assert m[f"grad_norm/{lay}"] == pytest.approx(v, rel=1e-5)
        assert stats.layer_norms[lay] == pytest.approx(v, rel=1e-5)
    assert m["grad_norm/nonfinite"] == 0.0
    assert stats.metrics == m and stats.logged


def test_weight_norms_ratios_and_adamc_ratio(tiny_gpt):
    tracker = MemoryTracker()
    opt = torch.optim.AdamW(tiny_gpt.parameters(), lr=2e-3, weight_decay=0.1)
    mon = GradMonitor(tiny_gpt, tracker=tracker, optimizer=opt, adamc_ratio=True)
    backward(tiny_gpt)
    mon.after_backward(0)
    m = tracker.metrics[0][1]
    _, glayers = reference(tiny_gpt)
    w = weight_layers(tiny_gpt)
    for lay, wn in w.items():
        assert m[f"weight_norm/{lay}"] == pytest.approx(wn, rel=1e-5)
        assert m[f"grad_weight_ratio/{lay}"] == pytest.approx(glayers[lay] / wn, rel=1e-5)
    total_w = math.sqrt(sum(p.double().norm().item() ** 2 for p in tiny_gpt.parameters()))
    assert m["weight_norm/global"] == pytest.approx(total_w, rel=1e-5)
    assert m["lr"] == 2e-3 and m["weight_decay"] == 0.1
    assert m["adamc/steady_state_ratio"] == pytest.approx(math.sqrt(2 * 0.1 / 2e-3), rel=1e-12)


def test_lr_and_weight_decay_sources(tiny_gpt):
    """Arguments win; from the optimizer: lr of group 0, the decayed groups' weight decay."""
    decay = [p for p in tiny_gpt.parameters() if p.dim() >= 2]
    no_decay = [p for p in tiny_gpt.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": no_decay, "weight_decay": 0.0},
                             {"params": decay, "weight_decay": 0.05}], lr=1e-3)
    tracker = MemoryTracker()
    mon = GradMonitor(tiny_gpt, tracker=tracker, optimizer=opt, adamc_ratio=True)
    backward(tiny_gpt)
    mon.after_backward(0)
    mon.after_backward(1, lr=1e-5, weight_decay=0.2)  # e.g. a scheduler's value at this step
    (_, a), (_, b) = tracker.metrics
    assert (a["lr"], a["weight_decay"]) == (1e-3, 0.05)
    assert a["adamc/steady_state_ratio"] == pytest.approx(math.sqrt(2 * 0.05 / 1e-3), rel=1e-12)
    assert b["adamc/steady_state_ratio"] == pytest.approx(math.sqrt(2 * 0.2 / 1e-5), rel=1e-12)
    # nothing known: no lr keys at all
    bare = MemoryTracker()
    GradMonitor(tiny_gpt, tracker=bare).after_backward(0)
    assert not {"lr", "weight_decay", "adamc/steady_state_ratio"} & bare.keys()


def test_weight_decay_logged_when_it_changes_and_adamc_ratio_only_with_adamc(tiny_gpt):
    from gradloc_track.adamc import AdamCWeightDecay, adamc_param_groups

    plain = MemoryTracker()
    opt = torch.optim.AdamW(tiny_gpt.parameters(), lr=1e-3, weight_decay=0.1)
    mon = GradMonitor(tiny_gpt, tracker=plain, optimizer=opt)
    backward(tiny_gpt)
    for step in range(3):
        mon.after_backward(step)
    logged = [m for _, m in plain.metrics]
    assert [("weight_decay" in m) for m in logged] == [True, False, False]
    assert all(m["lr"] == 1e-3 and "adamc/steady_state_ratio" not in m for m in logged)
    adamc = MemoryTracker()
    # AdamC's groups: corrected matrices, embeddings/head decayed at the base rate, no decay for 1-D
    opt2 = torch.optim.AdamW(adamc_param_groups(tiny_gpt, 0.1), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 1.0 / (s + 1))
    wd = AdamCWeightDecay(opt2)  # logs the corrected groups' decay, not the embeddings' fixed 0.1
    mon2 = GradMonitor(tiny_gpt, tracker=adamc, optimizer=opt2)
    for step in range(2):
        mon2.after_backward(step)
        sched.step()
        wd.step()
    (_, a), (_, b) = adamc.metrics
    assert a["weight_decay"] == pytest.approx(0.1) and b["weight_decay"] == pytest.approx(0.05)
    assert a["adamc/steady_state_ratio"] == pytest.approx(b["adamc/steady_state_ratio"]) == pytest.approx(math.sqrt(200))


def documented_patterns() -> list[re.Pattern]:
    """Every ``key`` in the docstring's bullet list, with <layer>/<param> as wildcards."""
    doc = GradMonitor.__doc__.split("Metric keys", 1)[1]
    keys = set(re.findall(r"``([a-z_]+(?:/[^`\s]*)?)``", doc))
    keys = {k for k in keys if "/" in k or k in {"lr", "weight_decay"}}
    pats = []
    for k in keys:
        rx = re.escape(k).replace(re.escape("<layer>"), "[^/]+").replace(re.escape("<param>"), ".+")
        pats.append(re.compile("^" + rx.replace(re.escape("..."), ".+") + "$"))
    return pats


def test_logged_keys_are_exactly_the_documented_ones(tiny_gpt):
    from gradloc_track.spikes import SpikeDetector

    tracker = MemoryTracker()
    opt = torch.optim.AdamW(tiny_gpt.parameters(), lr=1e-3, weight_decay=0.1)
    mon = GradMonitor(tiny_gpt, tracker=tracker, clipper=AdaGC(tiny_gpt, warmup_steps=1), optimizer=opt,
                      detector=SpikeDetector(warmup_steps=1), per_tensor=True, adamc_ratio=True)
    for step in range(3):
        backward(tiny_gpt, seed=step)
        mon.after_backward(step)
    logged = tracker.keys()
    pats = documented_patterns()
    for key in logged:
        assert any(p.match(key) for p in pats), f"{key} is logged but not documented"
    # every documented key except the spike-localization and surgery ones shows up in this run
    unmatched = [p.pattern for p in pats if not any(p.match(k) for k in logged)]
    assert sorted(unmatched) == sorted(p.pattern for p in pats if "locate" in p.pattern or "surgery" in p.pattern), \
        unmatched


def test_log_every_is_respected(tiny_gpt):
    tracker = MemoryTracker()
    mon = GradMonitor(tiny_gpt, tracker=tracker, log_every=3)
    for step in range(7):
        backward(tiny_gpt, seed=step)
        stats = mon.after_backward(step)
        assert stats.logged == (step % 3 == 0)
        if not stats.logged:
            assert stats.metrics == {}
    assert [s for s, _ in tracker.metrics] == [0, 3, 6]


def test_lazy_stats_on_a_non_logging_step_match_the_loop(tiny_gpt):
    mon = GradMonitor(tiny_gpt, tracker=MemoryTracker(), log_every=100)
    backward(tiny_gpt)
    stats = mon.after_backward(1)
    per, layers = reference(tiny_gpt)
    assert not stats.logged
    for n, v in per.items():
        assert stats.grad_norms[n] == pytest.approx(v, rel=1e-5)
    for lay, v in layers.items():
        assert stats.layer_norms[lay] == pytest.approx(v, rel=1e-5)
    assert stats.global_norm == pytest.approx(math.sqrt(sum(v * v for v in per.values())), rel=1e-5)


@pytest.mark.parametrize("mode", ["module", "tensor"])
def test_grouping_modes_match_the_loop(tiny_gpt, mode):
    tracker = MemoryTracker()
    mon = GradMonitor(tiny_gpt, tracker=tracker, group_by=mode)
    backward(tiny_gpt)
    mon.after_backward(0)
    m = tracker.metrics[0][1]
    _, layers = reference(tiny_gpt, mode)
    w = weight_layers(tiny_gpt, mode)
    logged = {k[len("grad_norm/"):] for k in m if k.startswith("grad_norm/")} - {"global", "nonfinite"}
    assert logged == set(layers)
    assert ("h.0.attn.qkv" if mode == "module" else "h.0.attn.qkv.weight") in logged
    for lay, v in layers.items():
        assert m[f"grad_norm/{lay}"] == pytest.approx(v, rel=1e-5)
        assert m[f"weight_norm/{lay}"] == pytest.approx(w[lay], rel=1e-5)


def test_custom_groups_and_their_fallback(tiny_gpt):
    tracker = MemoryTracker()
    groups = {"attention": r"\.attn\.", "mlp": r"\.mlp\."}
    mon = GradMonitor(tiny_gpt, tracker=tracker, groups=groups)
    backward(tiny_gpt)
    mon.after_backward(0)
    m = tracker.metrics[0][1]
    per, layers = reference(tiny_gpt, "block", groups)
    attn = math.sqrt(sum(v * v for n, v in per.items() if ".attn." in n))
    assert m["grad_norm/attention"] == pytest.approx(attn, rel=1e-5)
    assert set(layers) == {"attention", "mlp", "wte", "wpe", "h.0", "h.1", "ln_f", "lm_head"}
    for lay, v in layers.items():  # unmatched tensors (norms of the blocks, embeddings) fall back
        assert m[f"grad_norm/{lay}"] == pytest.approx(v, rel=1e-5)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_gradients_are_counted_not_fatal(tiny_gpt, bad):
    tracker = MemoryTracker()
    mon = GradMonitor(tiny_gpt, tracker=tracker)
    backward(tiny_gpt)
    tiny_gpt.lm_head.weight.grad[0, 0] = bad
    tiny_gpt.wte.weight.grad[1, 1] = bad
    stats = mon.after_backward(0)
    m = tracker.metrics[0][1]
    assert m["grad_norm/nonfinite"] == 2.0
    assert not math.isfinite(m["grad_norm/global"]) and not math.isfinite(stats.grad_norms["wte.weight"])
    assert math.isfinite(m["grad_norm/h.0"])  # the healthy layers still report


def test_parameters_without_grad_count_as_zero(tiny_gpt):
    tiny_gpt.wpe.weight.requires_grad_(False)  # frozen: not monitored at all
    mon = GradMonitor(tiny_gpt, tracker=MemoryTracker())
    backward(tiny_gpt)
    tiny_gpt.ln_f.weight.grad = None  # trainable but no gradient this step
    stats = mon.after_backward(0)
    assert "wpe.weight" not in stats.grad_norms and stats.grad_norms["ln_f.weight"] == 0.0
    per = [p.grad.double().norm().item() for p in tiny_gpt.parameters() if p.grad is not None]
    assert stats.global_norm == pytest.approx(math.sqrt(sum(v * v for v in per)), rel=1e-5)


@pytest.mark.parametrize("kwargs,field", [
    ({"log_every": 0}, "monitor.log_every"),
    ({"log_every": 2.5}, "monitor.log_every"),
    ({"log_every": True}, "monitor.log_every"),
    ({"group_by": "rows"}, "monitor.group_by"),
    ({"per_tensor": "yes"}, "monitor.per_tensor"),
    ({"weight_norms": 1}, "monitor.weight_norms"),
    ({"groups": ["attn"]}, "monitor.groups"),
    ({"groups": {"attention": "(unclosed"}}, "monitor.groups.attention"),
    ({"groups": {"a/b": "attn"}}, "monitor.groups"),
    ({"groups": {"global": "attn"}}, "monitor.groups"),
])
def test_bad_config_values_name_the_field(tiny_gpt, kwargs, field):
    with pytest.raises(ConfigError, match=re.escape(field)):
        MonitorConfig(**kwargs)
    with pytest.raises(ConfigError, match=re.escape(field)):
        GradMonitor(tiny_gpt, **kwargs)


def test_bad_arguments_raise_clear_type_errors(tiny_gpt):
    with pytest.raises(TypeError, match="log_evry"):
        GradMonitor(tiny_gpt, log_evry=2)
    with pytest.raises(TypeError, match="not both"):
        GradMonitor(tiny_gpt, config=MonitorConfig(), log_every=2)
    with pytest.raises(TypeError, match="MonitorConfig"):
        GradMonitor(tiny_gpt, config={"log_every": 2})
    with pytest.raises(ValueError, match="requires_grad"):
        GradMonitor(torch.nn.Linear(2, 2).requires_grad_(False))
    clashing = torch.nn.ModuleDict({"global": torch.nn.Linear(2, 2)})  # module layer "global"
    with pytest.raises(ValueError, match="monitor.groups"):
        GradMonitor(clashing, group_by="module")


def test_bf16_gradients_are_reduced_in_fp32(tiny_gpt):
    """A bf16 model: norms are accumulated and returned in fp32, not rounded to bf16 (~3 digits)."""
    model = tiny_gpt.to(torch.bfloat16)
    mon = GradMonitor(model, tracker=MemoryTracker())
    backward(model)
    stats = mon.after_backward(0)
    per, layers = reference(model)
    for n, v in per.items():
        assert stats.grad_norms[n] == pytest.approx(v, rel=1e-5), n
    for lay, v in layers.items():
        assert stats.layer_norms[lay] == pytest.approx(v, rel=1e-5), lay
