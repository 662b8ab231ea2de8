"""A step that overflows float16 under autocast is ``precision``, not a hardware fault (issue 37).

A nanoGPT-style loop under ``torch.autocast("cpu", float16)`` scales its loss (as a loss scaler does) so
that one sample's gradient goes beyond float16's range in the backward; the unscaled ``.grad`` holds Inf
while the localizer's float32 replay is finite. 0.4 called that "irreproducible: suspect a hardware fault"
and named no sample. ``watch()`` sees the autocast at the forward: the cause is precision, with the
layers whose gradient overflowed and the sample that carries the finite replay."""
from __future__ import annotations

import copy

import torch

import gradloc_track
from gradloc_track import MemoryTracker

from .nanogpt import GPT, GPTConfig

FP16_MAX = 65504.0


def test_a_float16_overflow_under_autocast_is_precision_with_its_sample_and_layers():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    handle = gradloc_track.watch(model, opt, tracker=MemoryTracker(), spikes={"warmup_steps": 3})
    g = torch.Generator().manual_seed(1)
    stats = None
    for step in range(6):
        x = torch.randint(0, 32, (8, 16), generator=g)
        y = torch.roll(x, -1, 1)
        scale = 1.0
        if step == 5:  # sample 3: one token repeated, its gradient coherent; a loss scale it overflows at
            x[3] = 40
            y[3] = 41
            twin = copy.deepcopy(model)  # its float32 gradient, outside watch()'s capture
            twin(x, y)[1].backward()
            scale = 4 * FP16_MAX / max(float(p.grad.abs().max()) for p in twin.parameters())
        with torch.autocast("cpu", dtype=torch.float16):
            _, loss = model(x, y)
        (loss * scale).backward()
        for p in model.parameters():  # unscale, as GradScaler.unscale_ does (Inf stays Inf)
            p.grad.div_(scale)
        stats = handle.step()
        if step < 5:
            opt.step()
        opt.zero_grad()
    handle.finish()
    assert stats.events and stats.cause == "precision", (stats.cause, stats.cause_detail)
    assert "float16 autocast" in stats.cause_detail and "overflowed in " in stats.cause_detail
    assert "irreproducible" not in stats.cause_detail and "hardware" not in stats.cause_detail
    assert "sample 3 carries" in stats.cause_detail  # named from the exact shares of the finite replay
    # the block's non-finite line says the same (held-out tester, stop 52: the cause read precision and the next
    # line "a corrupted gradient, a hardware fault, or a loss_fn that is not the training loss")
    said = stats.locate.nonfinite.detail
    assert "beyond float16 autocast's range" in said and "hardware" not in said


def test_a_data_spike_under_bfloat16_autocast_is_data_not_irreproducible():
    """The probes replay in float32 while the step ran under bfloat16 autocast: .grad differs from the replay by
    bfloat16's rounding (0.5% of its norm for the held-out tester's loop). That is no failure to reproduce: the
    step check allows the precision's rounding, the culprit is named and the cause is data (before: irreproducible,
    "a hardware fault or silent data corruption", on the most common LLM setting)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    handle = gradloc_track.watch(model, opt, tracker=MemoryTracker(), console=False, spikes={"warmup_steps": 10})
    g = torch.Generator().manual_seed(1)
    for step in range(31):
        x = torch.arange(16).repeat(8, 1) + torch.randint(0, 8, (8, 1), generator=g)
        x = x % 32
        y = torch.roll(x, -1, 1)
        if step == 30:  # sample 3: random junk tokens the model never saw
            x[3] = torch.randint(32, 64, (16,), generator=g)
            y[3] = torch.randint(32, 64, (16,), generator=g)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(x, y)
        loss.backward()
        stats = handle.step()
        opt.step()
        opt.zero_grad()
    handle.finish()
    assert stats.events and stats.locate is not None
    check = stats.locate.step_check
    assert check is not None and check.replayed, check  # within bfloat16's rounding
    assert stats.cause == "data", (stats.cause, stats.cause_detail)
    assert any(c.batch == 3 for c in stats.locate.culprits)
