"""Fault scenarios for GradMonitor (issue 13): misuse and bad input, each on a real tiny model.

Unfrozen parameters, repeated or backwards steps, ``on_nonfinite="raise"``, localizations that
find nothing. Wrong constructor arguments are tested in tests/monitor/test_arguments.py.
"""
from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from gradloc_track import GradMonitor, MemoryTracker
from gradloc_track.clip import AdaGC, GlobalClip, LayerClip
from gradloc_track.config import LocateConfig
from gradloc_track.spikes import SpikeContext, SpikeDetector

from ..monitor.helpers import backward, reference

# -- parameters unfrozen after the monitor was built --------------------------------------------

def test_an_unfrozen_parameter_is_picked_up_on_the_next_logging_step(tiny_gpt):
    tiny_gpt.wpe.weight.requires_grad_(False)
    tracker = MemoryTracker()
    mon = GradMonitor(tiny_gpt, tracker=tracker, log_every=2)
    backward(tiny_gpt)
    assert "wpe.weight" not in mon.after_backward(0).grad_norms
    tiny_gpt.wpe.weight.requires_grad_(True)  # e.g. gradual unfreezing
    backward(tiny_gpt, seed=1)
    assert "wpe.weight" not in mon.after_backward(1).grad_norms  # non-logging step: no re-scan, no cost
    backward(tiny_gpt, seed=2)
    stats = mon.after_backward(2)
    per, layers = reference(tiny_gpt)  # every parameter now has a gradient
    assert stats.grad_norms["wpe.weight"] == pytest.approx(per["wpe.weight"], rel=1e-5)
    assert stats.global_norm == pytest.approx(math.sqrt(sum(v * v for v in per.values())), rel=1e-5)
    assert dict(tracker.metrics)[2]["grad_norm/wpe"] == pytest.approx(layers["wpe"], rel=1e-5)
    tiny_gpt.wpe.weight.requires_grad_(False)  # and frozen again: dropped
    backward(tiny_gpt, seed=3)
    assert "wpe.weight" not in mon.after_backward(4).grad_norms


def test_a_clipper_built_while_frozen_takes_in_the_unfrozen_tensors(tiny_gpt):
    """Gradual unfreezing under watch(clip=...): the clipper was built while wpe was frozen and never clipped it
    after ('build the clipper again', which watch() gives no way to do; held-out tester round 10). The rescan
    hands the clipper the new tensors: GlobalClip is clip_grad_norm_ over every trainable tensor again."""
    tiny_gpt.wpe.weight.requires_grad_(False)
    clipper = GlobalClip(tiny_gpt, max_norm=1e-3)
    mon = GradMonitor(tiny_gpt, tracker=MemoryTracker(), clipper=clipper)
    tiny_gpt.wpe.weight.requires_grad_(True)
    backward(tiny_gpt)
    per, _ = reference(tiny_gpt)
    twins = [torch.nn.Parameter(torch.zeros_like(p)) for p in tiny_gpt.parameters()]  # the reference, on copies
    for t, p in zip(twins, tiny_gpt.parameters()):
        t.grad = p.grad.clone()
    torch.nn.utils.clip_grad_norm_(twins, 1e-3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stats = mon.after_backward(0)
    assert not [w for w in caught if "not clipped" in str(w.message)]
    assert "wpe.weight" in clipper.names
    assert stats.clip.total_norm == pytest.approx(math.sqrt(sum(v * v for v in per.values())), rel=1e-5)
    for p, t in zip(tiny_gpt.parameters(), twins):
        torch.testing.assert_close(p.grad, t.grad, rtol=1e-5, atol=1e-12)


def test_adagc_keeps_its_running_norms_and_starts_the_unfrozen_tensors_fresh(tiny_gpt):
    tiny_gpt.wpe.weight.requires_grad_(False)
    clipper = AdaGC(tiny_gpt, warmup_steps=1)
    mon = GradMonitor(tiny_gpt, tracker=MemoryTracker(), clipper=clipper)
    for step in range(3):
        backward(tiny_gpt, seed=step)
        mon.after_backward(step)
    before = dict(zip(clipper.names, clipper.gamma.tolist()))
    tiny_gpt.wpe.weight.requires_grad_(True)
    assert clipper.adopt(tiny_gpt) and not clipper.adopt(tiny_gpt)
    after = dict(zip(clipper.names, clipper.gamma.tolist()))
    seen = dict(zip(clipper.names, clipper.seen.tolist()))
    assert {n: after[n] for n in before} == before and all(seen[n] for n in before)
    assert after["wpe.weight"] == 0.0 and not seen["wpe.weight"]
    assert clipper.names == [n for n, p in tiny_gpt.named_parameters() if p.requires_grad]


def test_layerclip_cannot_take_them_in_and_says_what_can(tiny_gpt):
    tiny_gpt.wpe.weight.requires_grad_(False)
    clipper = LayerClip(tiny_gpt)
    mon = GradMonitor(tiny_gpt, tracker=MemoryTracker(), clipper=clipper)
    tiny_gpt.wpe.weight.requires_grad_(True)
    backward(tiny_gpt)
    wpe_before = tiny_gpt.wpe.weight.grad.clone()
    with pytest.warns(UserWarning, match=r"wpe\.weight.*not clipped.*LayerClip.*clip='adagc', 'zclip' or 'global'"):
        stats = mon.after_backward(0)
    assert torch.equal(tiny_gpt.wpe.weight.grad, wpe_before)
    assert stats.grad_norms["wpe.weight"] > 0  # but monitored


# -- repeated and backwards steps ----------------------------------------------------------------

def test_a_repeated_step_warns_and_advances_no_state(tiny_gpt):
    tracker = MemoryTracker()
    clipper = AdaGC(tiny_gpt, warmup_steps=2)
    det = SpikeDetector(warmup_steps=1)
    mon = GradMonitor(tiny_gpt, tracker=tracker, clipper=clipper, detector=det)
    for step in range(3):
        backward(tiny_gpt, seed=step)
        mon.after_backward(step)
    clip_state, det_state = clipper.state_dict(), det.state_dict()
    grads = [p.grad.clone() for p in tiny_gpt.parameters()]
    with pytest.warns(UserWarning, match="called again for step 2"):
        stats = mon.after_backward(2)
    assert not stats.logged and stats.clip is None and stats.events == []
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, tiny_gpt.parameters()))  # not clipped twice
    assert repr(clipper.state_dict()) == repr(clip_state) and det.state_dict() == det_state
    assert [s for s, _ in tracker.metrics] == [0, 1, 2]  # step 2 logged once


def test_a_step_going_backwards_warns_and_is_processed_once(tiny_gpt):
    tracker = MemoryTracker()
    clipper = AdaGC(tiny_gpt, warmup_steps=2)
    mon = GradMonitor(tiny_gpt, tracker=tracker, clipper=clipper)
    for step in (10, 11):
        backward(tiny_gpt, seed=step)
        mon.after_backward(step)
    backward(tiny_gpt, seed=5)
    with pytest.warns(UserWarning, match=r"went backwards \(11 -> 5\)"):
        stats = mon.after_backward(5)
    assert stats.clip is not None and clipper.steps == 3
    assert [s for s, _ in tracker.metrics] == [10, 11, 5]


# -- on_nonfinite="raise" logs the step first ---------------------------------------------------

def test_raise_on_nonfinite_logs_and_flushes_the_step_before_raising(tiny_gpt, tmp_path):
    from gradloc_track.trackers.async_writer import AsyncTracker, WriterSettings
    from gradloc_track.trackers.local_tracker import LocalTracker

    # a real background writer with a long flush interval: only flush() gets the record out in time
    tracker = AsyncTracker(lambda: LocalTracker(tmp_path / "run"), "local", tmp_path,
                           WriterSettings(flush_interval_s=60.0))
    try:
        mon = GradMonitor(tiny_gpt, tracker=tracker, clipper=GlobalClip(tiny_gpt, on_nonfinite="raise"),
                          log_every=10)
        backward(tiny_gpt)
        tiny_gpt.h[1].mlp.fc.weight.grad[0, 0] = float("nan")
        with pytest.raises(FloatingPointError, match="non-finite"):
            mon.after_backward(7)  # not a logging step: the error makes it one
        rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    finally:
        tracker.finish("failed")
    (row,) = rows
    m = row["metrics"]
    assert row["step"] == 7 and m["clip/nonfinite"] == 1.0 and m["grad_norm/nonfinite"] == 1.0
    assert math.isnan(m["grad_norm/h.1"]) and math.isfinite(m["grad_norm/h.0"])  # where it broke


# -- localizations that find nothing do not use up locate.max_events ----------------------------

def test_empty_localizations_do_not_use_up_max_events(tiny_gpt):
    """Every step fires (fixed mode, tiny threshold); only steps 6 and 7 hold a culprit term."""
    B, T = 2, 8
    tracker = MemoryTracker()
    mon = GradMonitor(tiny_gpt, tracker=tracker, log_every=100,
                      detector=SpikeDetector(mode="fixed", per_token_threshold=1e-6),
                      locate_config=LocateConfig(method="bisect", budget=16, max_events=2))
    g = torch.Generator().manual_seed(0)
    located, said = {}, {}
    for step in range(1, 10):
        x, y = torch.randint(0, 64, (B, T), generator=g), torch.randint(0, 64, (B, T), generator=g)
        w = torch.ones(B, T)
        if step in (6, 7, 9):
            w[1, 3] = 500.0

        def loss_fn(mask, x=x, y=y, w=w):
            per = F.cross_entropy(tiny_gpt(x).reshape(-1, 64), y.reshape(-1), reduction="none").view(B, T)
            return (per * w * mask).sum() / (B * T)

        mask = torch.ones(B, T)
        tiny_gpt.zero_grad(set_to_none=True)
        loss_fn(mask).backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            stats = mon.after_backward(step, spike_context=SpikeContext(loss_fn, mask, input_ids=y))
        said[step] = [str(w.message) for w in caught if "no culprit" in str(w.message)]
        located[step] = None if stats.locate is None else len(stats.locate.tokens)
    # 1, 2: empty (free, up to max_events=2); then back-off: 3 tried (empty), 4 skipped, 5 tried
    # (empty), 6-8 skipped; the culprits at 6 and 7 fall in the back-off window. Step 9 is tried.
    assert located == {1: 0, 2: 0, 3: 0, 4: None, 5: 0, 6: None, 7: None, 8: None, 9: 1}
    assert (mon.events_localized, mon.events_unconfirmed) == (1, 4)
    assert [step for step, msgs in said.items() if msgs] == [2]  # warned once, when the free ones ran out
    assert "raise spikes.z_thresh" in said[2][0]


def test_culprits_use_up_max_events_and_empty_results_do_not(tiny_gpt):
    B, T = 2, 8
    mon = GradMonitor(tiny_gpt, tracker=MemoryTracker(), log_every=100,
                      detector=SpikeDetector(mode="fixed", per_token_threshold=1e-6),
                      locate_config=LocateConfig(method="bisect", budget=16, max_events=2))
    g = torch.Generator().manual_seed(1)
    located = []
    for step in range(1, 6):
        x, y = torch.randint(0, 64, (B, T), generator=g), torch.randint(0, 64, (B, T), generator=g)
        w = torch.ones(B, T)
        if step != 2:
            w[0, step] = 500.0

        def loss_fn(mask, x=x, y=y, w=w):
            per = F.cross_entropy(tiny_gpt(x).reshape(-1, 64), y.reshape(-1), reduction="none").view(B, T)
            return (per * w * mask).sum() / (B * T)

        mask = torch.ones(B, T)
        tiny_gpt.zero_grad(set_to_none=True)
        loss_fn(mask).backward()
        stats = mon.after_backward(step, spike_context=SpikeContext(loss_fn, mask, input_ids=y))
        located.append(None if stats.locate is None else len(stats.locate.tokens))
    assert located == [1, 0, 1, None, None]  # the empty step 2 left room for step 3


# -- micro-batches reach the fixed trigger -------------------------------------------------------

def test_fixed_trigger_counts_micro_batches_and_their_tokens(tiny_gpt):
    det = SpikeDetector(mode="fixed", per_token_threshold=1e6)
    mon = GradMonitor(tiny_gpt, tracker=MemoryTracker(), log_every=10, detector=det)
    masks = [torch.ones(2, 16), torch.ones(3, 8), torch.zeros(1, 4)]
    masks[2][0, :3] = 1.0  # 32 + 24 + 3 = 59 loss tokens in 3 micro-batches
    backward(tiny_gpt)
    ctx = SpikeContext(loss_fn=[lambda m: m.sum()] * 3, token_mask=masks)
    stats = mon.after_backward(1, spike_context=ctx)
    assert stats.events == []
    assert det.metrics()["spike/threshold"] == pytest.approx(1e6 / math.sqrt(59) * 3)


# -- constructor arguments -----------------------------------------------------------------------




def test_adagc_resumes_a_checkpoint_saved_after_the_unfreezing_before_it_happens_again(tiny_gpt):
    """A run resumed while the script has not unfrozen the layer yet: the checkpoint (saved after it was) holds
    one tensor more. Loaded by name (it was refused: 'names differ'), and the running norm of the tensor trainable
    again is the checkpoint's once the clipper takes it in."""
    clipper = AdaGC(tiny_gpt, warmup_steps=1)
    mon = GradMonitor(tiny_gpt, tracker=MemoryTracker(), clipper=clipper)
    for step in range(3):
        backward(tiny_gpt, seed=step)
        mon.after_backward(step)
    saved = clipper.state_dict()
    tiny_gpt.wpe.weight.requires_grad_(False)  # the resumed script, before its unfreezing step
    resumed = AdaGC(tiny_gpt, warmup_steps=1)
    resumed.load_state_dict(saved)
    want = dict(zip(saved["names"], saved["gamma"].tolist()))
    assert "wpe.weight" not in resumed.names
    assert dict(zip(resumed.names, resumed.gamma.tolist())) == {n: want[n] for n in resumed.names}
    tiny_gpt.wpe.weight.requires_grad_(True)
    assert resumed.adopt(tiny_gpt)
    assert dict(zip(resumed.names, resumed.gamma.tolist())) == want and bool(resumed.seen.all())


def test_adopt_takes_a_replaced_parameter_leaves_a_sub_module_clipper_alone_and_renews_a_global_norm(tiny_gpt):
    """Reviewer round 11: a parameter replaced under its name stayed unclipped; a clipper built on purpose over a
    sub-module was re-pointed at the whole model; AdaGC-global kept a running norm of a smaller gradient."""
    clipper = GlobalClip(tiny_gpt, max_norm=1e-3)
    old = tiny_gpt.wpe.weight
    tiny_gpt.wpe.weight = torch.nn.Parameter(old.detach().clone())
    assert clipper.adopt(tiny_gpt) and any(p is tiny_gpt.wpe.weight for p in clipper.params)
    assert not any(p is old for p in clipper.params)
    head = AdaGC(tiny_gpt.h[0], warmup_steps=1)  # over one block only: its own tensors
    names = list(head.names)
    assert not head.adopt(tiny_gpt) and head.names == names
    tiny_gpt.wpe.weight.requires_grad_(False)
    glob = AdaGC(tiny_gpt, warmup_steps=1, mode="global")
    glob.seen = torch.ones_like(glob.seen)
    tiny_gpt.wpe.weight.requires_grad_(True)
    assert glob.adopt(tiny_gpt) and not bool(glob.seen)  # re-initialised from the next total


def test_adagc_refuses_another_models_checkpoint_and_resumes_shard_mode_by_name(tiny_gpt):
    other = torch.nn.Sequential(torch.nn.Linear(6, 3))
    mine = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    with pytest.raises(ValueError, match="names differ"):
        AdaGC(other).load_state_dict(AdaGC(mine).state_dict())  # '0.weight' in both: not the same model
    saved = AdaGC(tiny_gpt, mode="shard").state_dict()
    tiny_gpt.wpe.weight.requires_grad_(False)
    resumed = AdaGC(tiny_gpt, mode="shard")
    resumed.load_state_dict(saved)
    assert "wpe.weight" not in resumed.names


def test_the_ghost_method_on_a_model_without_readable_layers_says_so():
    import gradloc_track

    class Raw(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Parameter(torch.randn(16, 8) * 0.1)

        def forward(self, ids):
            return self.emb[ids] @ self.emb.t()

    model, ids = Raw(), torch.randint(0, 16, (2, 5))

    def loss_fn(keep):
        per = F.cross_entropy(model(ids).reshape(-1, 16), ids.reshape(-1), reduction="none").view(2, 5)
        return (per * keep).sum() / 10

    loss_fn(torch.ones(2, 5)).backward()
    with pytest.raises(ValueError, match="method='ghost'.*no layer the ghost map reads.*'auto' or 'bisect'"):
        gradloc_track.locate(model, loss_fn, torch.ones(2, 5), method="ghost")
