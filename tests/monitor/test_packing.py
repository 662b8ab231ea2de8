"""The sync contract: one device->host transfer per logging step, none on other steps.

There is no device on CPU, so "sync" is checked where every sync on an accelerator starts:
(1) a TorchDispatchMode records the ATen ops that need the host to read device memory
(``_local_scalar_dense`` behind ``.item()/float()/bool()``, data-dependent shapes like
``nonzero``); (2) the Tensor methods that copy to the host without dispatching on CPU
(``tolist``, ``cpu``, ``numpy``) are wrapped. Both are real calls, only observed.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import gradloc_track.monitor.grad_monitor as monitor_mod
from gradloc_track import GradMonitor, MemoryTracker
from gradloc_track.clip import AdaGC
from gradloc_track.spikes import SpikeContext, SpikeDetector

from .helpers import backward, reference

SYNC_OPS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::is_nonzero",
            "aten::_unique2", "aten::equal", "aten::item"}


class SyncSpy(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in SYNC_OPS:
            self.calls.append(func._schema.name)
        return func(*args, **(kwargs or {}))


@pytest.fixture
def spy(monkeypatch):
    s = SyncSpy()
    for name in ("tolist", "cpu", "numpy"):
        orig = getattr(torch.Tensor, name)

        def wrapped(self, *a, _orig=orig, _name=name, **k):
            s.calls.append(_name)
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, wrapped)
    return s


def test_one_transfer_per_logging_step_none_otherwise(tiny_gpt, spy):
    opt = torch.optim.AdamW(tiny_gpt.parameters(), lr=1e-3, weight_decay=0.1)
    tracker = MemoryTracker()
    mon = GradMonitor(tiny_gpt, tracker=tracker, clipper=AdaGC(tiny_gpt, warmup_steps=2), optimizer=opt,
                      log_every=2, per_tensor=True)
    seen = {}
    for step in range(5):
        backward(tiny_gpt, seed=step)
        spy.calls.clear()
        with spy:
            mon.after_backward(step)  # norms + weight norms + AdaGC + clip metrics + lr keys
        seen[step] = list(spy.calls)
        opt.step()
    assert seen == {0: ["tolist"], 1: [], 2: ["tolist"], 3: [], 4: ["tolist"]}
    assert [s for s, _ in tracker.metrics] == [0, 2, 4]


def test_reading_stats_syncs_lazily_once(tiny_gpt, spy):
    mon = GradMonitor(tiny_gpt, tracker=MemoryTracker(), log_every=2)
    backward(tiny_gpt)
    with spy:
        stats = mon.after_backward(1)
        assert spy.calls == []
        norms, layers, total = stats.grad_norms, stats.layer_norms, stats.global_norm
        assert spy.calls == ["tolist"]  # one transfer for all three views, then cached
        stats.grad_norms
        assert spy.calls == ["tolist"]
        spy.calls.clear()
        logged = mon.after_backward(2)
        logged.grad_norms, logged.layer_norms, logged.global_norm  # already on the host
        assert spy.calls == ["tolist"]
    per, lay = reference(tiny_gpt)
    assert norms == pytest.approx(per, rel=1e-5) and layers == pytest.approx(lay, rel=1e-5)
    assert total == pytest.approx(logged.global_norm, rel=1e-6)


def test_an_armed_detector_syncs_once_every_step(tiny_gpt, spy):
    mon = GradMonitor(tiny_gpt, tracker=MemoryTracker(), log_every=10, detector=SpikeDetector(warmup_steps=2))
    mask = torch.ones(2, 16)
    ctx = SpikeContext(lambda m: tiny_gpt.wte.weight.sum() * m.sum(), mask)
    for step in range(1, 4):
        backward(tiny_gpt, seed=step)
        spy.calls.clear()
        with spy:
            stats = mon.after_backward(step, spike_context=ctx)
        assert spy.calls == ["tolist"] and not stats.logged and stats.events == []
    # without a batch to localize the detector only runs on logging steps: no sync in between
    spy.calls.clear()
    with spy:
        mon.after_backward(5)
    assert spy.calls == []


def test_surgery_mode_clips_after_the_verdict_with_one_more_transfer_on_logging_steps(tiny_gpt, spy):
    """``spikes.response=surgery``: the clipper waits for the detector, so its metrics travel in a
    second transfer on logging steps; steps that do not log still make one."""
    from gradloc_track.config import SpikeConfig

    mon = GradMonitor(tiny_gpt, tracker=MemoryTracker(), clipper=AdaGC(tiny_gpt, warmup_steps=2), log_every=2,
                      detector=SpikeDetector(SpikeConfig(warmup_steps=2, response="surgery")))
    ctx = SpikeContext(lambda m: tiny_gpt.wte.weight.sum() * m.sum(), torch.ones(2, 16))
    seen = {}
    for step in range(1, 5):
        backward(tiny_gpt, seed=step)
        spy.calls.clear()
        with spy:
            stats = mon.after_backward(step, spike_context=ctx)
        seen[step] = list(spy.calls)
        assert stats.events == [] and stats.clip is not None
    assert seen == {1: ["tolist"], 2: ["tolist", "tolist"], 3: ["tolist"], 4: ["tolist", "tolist"]}
    assert "clip/total_norm_post" in stats.metrics


def test_the_clipper_gets_the_monitors_norms_computed_once(tiny_gpt, monkeypatch):
    passes = []
    real = monitor_mod.sq_norms
    monkeypatch.setattr(monitor_mod, "sq_norms", lambda ts, **k: passes.append(len(ts)) or real(ts, **k))
    clipper = AdaGC(tiny_gpt, warmup_steps=1, lambda_abs=0.05)
    seen = []
    real_clip = clipper.clip
    monkeypatch.setattr(clipper, "clip", lambda sq: seen.append(sq.clone()) or real_clip(sq))
    tracker = MemoryTracker()
    mon = GradMonitor(tiny_gpt, tracker=tracker, clipper=clipper, weight_norms=False)
    backward(tiny_gpt)
    per, layers = reference(tiny_gpt)
    stats = mon.after_backward(0)
    assert len(passes) == 1  # one fused pass over the gradients, shared with the clipper
    assert seen[0].tolist() == pytest.approx([v * v for v in per.values()], rel=1e-5)
    m = tracker.metrics[0][1]
    total = math.sqrt(sum(v * v for v in per.values()))
    assert m["clip/total_norm_pre"] == pytest.approx(total, rel=1e-5)
    assert m["clip/total_norm_post"] == pytest.approx(0.05, rel=1e-4)  # warm-up = global clip at 0.05
    assert stats.clip is not None and stats.global_norm == pytest.approx(total, rel=1e-5)  # pre-clip
    for lay in layers:
        assert m[f"clip/coef/{lay}"] == pytest.approx(0.05 / total, rel=1e-4)
    post = math.sqrt(sum(p.grad.double().norm().item() ** 2 for p in tiny_gpt.parameters()))
    assert post == pytest.approx(0.05, rel=1e-4)  # and the gradients really were clipped


def test_the_detector_gets_host_floats_and_the_token_count(tiny_gpt):
    det = SpikeDetector(mode="fixed", per_token_threshold=1e6, warmup_steps=0)
    mon = GradMonitor(tiny_gpt, tracker=MemoryTracker(), log_every=10, detector=det)
    mask = torch.zeros(2, 16)
    mask[:, :9] = 1.0  # 18 loss terms
    backward(tiny_gpt)
    stats = mon.after_backward(3, spike_context=SpikeContext(lambda m: m.sum(), mask))
    per, _ = reference(tiny_gpt)
    total = math.sqrt(sum(v * v for v in per.values()))
    # fixed mode: ratio = ||g|| / (per_token_threshold / sqrt(n_tokens))
    assert det.metrics()["spike/ratio"] == pytest.approx(total * math.sqrt(18) / 1e6, rel=1e-5)
    assert stats.events == [] and stats.metrics["spike/detected"] == 0.0


def step_transfers(model, opt, mon, steps, spy, spike_context=None) -> list[int]:
    """Host reads of each whole step: after_backward + optimizer.step."""
    out = []
    for step in steps:
        backward(model, seed=step)
        spy.calls.clear()
        with spy:
            mon.after_backward(step, spike_context=spike_context)
            opt.step()
        out.append(len(spy.calls))
    return out


SKIP_CONFIGS = {  # optimizer, the guard mode auto picks, transfers on a non-logging / a logging step
    "fused AdamW (found_inf)": (lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True), "fused", 0, 1),
    "SGD momentum (one bool read)": (lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9), "sync", 1, 1),
}


@pytest.mark.parametrize("name", list(SKIP_CONFIGS))
def test_transfers_per_step_with_the_skip_guard(tiny_gpt, spy, name):
    """The documented table: fused optimizers skip with no transfer; others read one bool per step,
    which a logging step (or an armed detector's step) already has on the host."""
    make, mode, quiet, logging = SKIP_CONFIGS[name]
    opt = make(tiny_gpt.parameters())
    clipper = AdaGC(tiny_gpt, warmup_steps=1)
    mon = GradMonitor(tiny_gpt, tracker=MemoryTracker(), clipper=clipper, optimizer=opt, log_every=4)
    assert mon.skip_guard.mode == mode
    step_transfers(tiny_gpt, opt, mon, [1], spy)  # the first step creates the optimizer state
    assert step_transfers(tiny_gpt, opt, mon, [2, 3, 4, 5], spy) == [quiet, quiet, logging, quiet]
    # armed detector: one transfer every step, and the guard reads nothing more
    armed = GradMonitor(tiny_gpt, tracker=MemoryTracker(), clipper=clipper, optimizer=opt, log_every=4,
                        detector=SpikeDetector(warmup_steps=50))
    assert armed.skip_guard is mon.skip_guard  # one guard per clipper and optimizer
    ctx = SpikeContext(lambda m: tiny_gpt.wte.weight.sum() * m.sum(), torch.ones(2, 16))
    assert step_transfers(tiny_gpt, opt, armed, [6, 7], spy, spike_context=ctx) == [1, 1]


def test_slots_ride_in_the_same_transfer_and_never_come_back_as_metrics(spy):
    from gradloc_track.monitor.packing import HostPack

    pack = HostPack(torch.device("cpu"))
    pack.add(["grad_norm/global", "grad_norm/layer/h.0"], torch.tensor([3.0, 4.0]))
    pack.add_slot("lr", torch.tensor(1e-3))
    pack.add_slot_if_tensor("weight_decay", 0.1)  # a host number needs no ride
    pack.add_slot("grad_norm/global", torch.tensor(-1.0))  # a slot named like a metric stays a slot
    values = pack.to_host()
    assert spy.calls == ["tolist"]  # one transfer for metrics and slots together
    assert values.metrics == {"grad_norm/global": 3.0, "grad_norm/layer/h.0": 4.0}
    assert values.slots == {"lr": pytest.approx(1e-3), "grad_norm/global": -1.0}
