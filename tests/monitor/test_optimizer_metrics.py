"""Optimizer metrics: the learning rate and weight decay read from the optimizer, the AdamC ratio only with AdamC."""
from __future__ import annotations

import math

import pytest
import torch

from gradloc_track import GradMonitor, MemoryTracker

from .helpers import backward


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
    ratio = a["adamc/steady_state_ratio"]
    assert ratio == pytest.approx(b["adamc/steady_state_ratio"]) == pytest.approx(math.sqrt(200))
