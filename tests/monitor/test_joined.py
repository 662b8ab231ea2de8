"""Tensors that start training mid-run (an unfreeze: ``requires_grad_(True)``, ``add_param_group``) are the
cause of the step they start at, ``schedule``, and the steps that fire after it are its aftermath (held-out
tester, stop 55: an unfreeze read ``optimizer``, "a second moment decayed", and each later firing step opened
an incident of its own). A tensor given its first gradient by routing (a mixture-of-experts expert) did not
join: it was in its group and required grad from the start."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import gradloc_track
from gradloc_track import MemoryTracker
from gradloc_track.demo.model import TinyGPT
from gradloc_track.monitor.joined import JoinedTensors

UNFREEZE = 70  # past the detector's warm-up (50 steps)


def _train(how: str) -> dict:
    """A 2-layer TinyGPT on licence-like text with its second block and head frozen until ``UNFREEZE``; the
    causes of the steps that fired, by step. ``how``: "group" (``requires_grad_`` + ``add_param_group``)
    or "flag" (the optimizer held every tensor from the start, ``requires_grad_`` alone)."""
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=256, n_layer=2, n_head=2, d_model=32, max_seq_len=32)
    late = [p for n, p in model.named_parameters() if n.startswith(("h.1.", "lm_head"))]
    for p in late:
        p.requires_grad_(False)
    held = [p for p in model.parameters() if p.requires_grad or how == "flag"]
    opt = torch.optim.AdamW(held, lr=3e-3)
    handle = gradloc_track.watch(model, opt, tracker=MemoryTracker())
    text = (b"Permission is granted to copy, distribute and/or modify this document under the terms of the "
            b"licence, provided that the above copyright notice and this permission notice appear in all copies. ")
    data = torch.tensor(list(text * 40), dtype=torch.long)
    gen = torch.Generator().manual_seed(0)
    for step in range(UNFREEZE + 25):
        if step == UNFREEZE:
            for p in late:
                p.requires_grad_(True)
            if how == "group":
                opt.add_param_group({"params": late})
        starts = torch.randint(0, len(data) - 33, (4,), generator=gen)
        batch = torch.stack([data[s:s + 33] for s in starts])
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(batch[:, :-1]).reshape(-1, 256), batch[:, 1:].reshape(-1)).backward()
        opt.step()
    views = {v.step: v.outcome.cause for v in handle.spikes}
    handle.close()
    return views


@pytest.mark.parametrize("how", ["group", "flag"])
def test_an_unfreeze_is_the_schedule_and_its_aftermath(how):
    views = _train(how)
    assert UNFREEZE in views, f"the unfreeze did not fire: {sorted(views)}"
    cause = views[UNFREEZE]
    assert cause.name == "schedule", cause.detail
    assert cause.detail.startswith("13 tensors started training at this step (h.1.ln1.weight, h.1.ln1.bias, "
                                   "h.1.attn.qkv.weight and 10 more: requires_grad turned on, or added with "
                                   "add_param_group)"), cause.detail
    later = {s: c for s, c in views.items() if s > UNFREEZE}
    # every step that fires in its window is the unfreeze's aftermath: no cause of its own
    assert all(c.aftermath_of == UNFREEZE and c.name == "schedule" for c in later.values()), \
        {s: (c.name, c.detail[:80]) for s, c in later.items()}
    assert not [s for s in views if s < UNFREEZE], "a clean step before the unfreeze fired"


def test_joined_names_what_an_added_group_or_a_rescan_brought_at_that_step_only():
    a, b, c = (torch.nn.Parameter(torch.ones(2)) for _ in range(3))
    named = [("a", a), ("b", b), ("c", c)]
    opt = torch.optim.AdamW([a], lr=1e-3)
    joined = JoinedTensors(opt)
    for p in (a, b, c):
        p.grad = torch.ones(2)
    joined.advance(0)
    assert joined.names(0, named) == ()
    opt.add_param_group({"params": [b]})
    joined.advance(1)
    assert joined.names(1, named) == ("b",)
    joined.advance(2)
    assert joined.names(2, named) == ()  # the step after: nothing new
    joined.adopted(3, ["c"])  # the monitored set took c in (requires_grad turned on)
    joined.advance(3)
    assert joined.names(3, named) == ("c",)
    c.grad = None  # adopted but without a gradient at this step: not training yet
    assert joined.names(3, named) == ()


def test_a_tensor_routed_to_for_the_first_time_did_not_join():
    """A mixture-of-experts expert: in the optimizer and requiring grad from the start, its first gradient
    at step 5 is routing, not a change the user made."""
    expert = torch.nn.Parameter(torch.ones(2))
    other = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([expert, other], lr=1e-3)
    joined = JoinedTensors(opt)
    for step in range(6):
        other.grad = torch.ones(2)
        expert.grad = torch.ones(2) if step == 5 else None
        joined.advance(step)
        assert joined.names(step, [("expert", expert), ("other", other)]) == ()
        opt.step()
    assert JoinedTensors(None).names(0, [("expert", expert)]) == ()  # no optimizer, nothing adopted
