"""A model wrapped in DistributedDataParallel logs the bare model's metric keys and layer names (before:
``grad_norm/module.h.0`` under DDP, ``grad_norm/h.0`` under FSDP2 and in one process, so the runs
did not overlay in MLflow's compare view). On a real one-process gloo group."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import gradloc_track
from gradloc_track.localizer.ghost import GhostMap
from gradloc_track.monitor import weight_check
from gradloc_track.trackers import MemoryTracker


def tiny_gpt():
    from gradloc_track.demo.model import TinyGPT

    torch.manual_seed(0)
    return TinyGPT(vocab_size=64, n_layer=2, n_head=2, d_model=32, max_seq_len=32)


def keys(model, batch):
    tracker = MemoryTracker()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with gradloc_track.watch(model, opt, tracker=tracker, spikes=False, locate=False, console=False,
                             group_by="block"):
        logits = model(batch[:, :-1])
        F.cross_entropy(logits.reshape(-1, 64), batch[:, 1:].reshape(-1)).backward()
        opt.step()
    return sorted(tracker.metrics[0][1])


def ghost_layers(model, batch):
    with GhostMap(model) as ghost:
        F.cross_entropy(model(batch[:, :-1]).reshape(-1, 64), batch[:, 1:].reshape(-1)).backward()
    return sorted(ghost.sq)


def test_ddp_logs_the_bare_models_keys_and_layers(gloo):
    from torch.nn.parallel import DistributedDataParallel

    batch = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    plain = keys(tiny_gpt(), batch)
    wrapped = keys(DistributedDataParallel(tiny_gpt()), batch)
    assert wrapped == plain and any(k.startswith("grad_norm/h.0") for k in plain)
    assert not any("module." in k for k in wrapped)
    assert ghost_layers(DistributedDataParallel(tiny_gpt()), batch) == ghost_layers(tiny_gpt(), batch)
    model = DistributedDataParallel(tiny_gpt())
    with torch.no_grad():
        model.module.h[1].mlp.fc.weight[3, 4] = float("nan")  # a corrupt weight is named as the metrics name it
    found = weight_check.scan(model, 7)
    assert found.name == "h.1.mlp.fc.weight" and found.index == (3, 4)
    assert weight_check.still(model, found)


def test_compiled_ddp_and_a_ddp_subclass_drop_the_prefix_too(gloo):
    """torch.compile(DDP(model)) (the order torch recommends) names tensors _orig_mod.module.*; a DDP subclass
    module.* (reviewer: both kept module.)."""
    from torch.nn.parallel import DistributedDataParallel

    from gradloc_track.norms import trainable_params

    class MyDDP(DistributedDataParallel):
        pass

    bare = [n for n, _ in trainable_params(tiny_gpt())]
    for model in (torch.compile(DistributedDataParallel(tiny_gpt())), MyDDP(tiny_gpt()),
                  DistributedDataParallel(torch.compile(tiny_gpt()))):
        assert [n for n, _ in trainable_params(model)] == bare, type(model).__name__
    found = weight_check.scan(torch.compile(DistributedDataParallel(poisoned())), 3)
    assert found.name == "h.1.mlp.fc.weight"


def poisoned():
    model = tiny_gpt()
    with torch.no_grad():
        model.h[1].mlp.fc.weight[3, 4] = float("nan")
    return model


def test_fsdp1_and_checkpoint_wrapper_parts_are_dropped():
    from gradloc_track.grouping import own_name

    assert own_name("_fsdp_wrapped_module.h.0._checkpoint_wrapped_module.attn.qkv.weight") == "h.0.attn.qkv.weight"


def test_a_users_own_submodule_called_module_keeps_its_name():
    class Holder(torch.nn.Module):  # not a wrapper: its names are the user's
        def __init__(self):
            super().__init__()
            self.module = torch.nn.Linear(3, 3)

    from gradloc_track.norms import trainable_params

    assert [n for n, _ in trainable_params(Holder())] == ["module.weight", "module.bias"]


def test_a_peft_lora_model_logs_the_bare_models_layer_names(gloo):
    """Held-out tester, stop 57: a LoRA model (PEFT's ``get_peft_model``) logged ``grad_norm/base_model.model.h.0``
    where the full fine-tune of the same model logs ``grad_norm/h.0``: a LoRA run and a full one did not overlay.
    PEFT's ``base_model.model.`` is a wrapper's part like DDP's ``module.`` (and both under DDP). The logged layer
    norms are the adapters' own gradients (the frozen base has none), each against a plain per-parameter loop."""
    peft = pytest.importorskip("peft")
    from torch.nn.parallel import DistributedDataParallel

    from gradloc_track.grouping import layer_of

    batch = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    lora = peft.LoraConfig(r=4, target_modules=["qkv", "fc"], lora_dropout=0.0)
    model = peft.get_peft_model(tiny_gpt(), lora)
    assert next(n for n, _ in model.named_parameters()).startswith("base_model.model.")
    tracker = MemoryTracker()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    with gradloc_track.watch(model, opt, tracker=tracker, spikes=False, locate=False, console=False):
        F.cross_entropy(model(batch[:, :-1]).reshape(-1, 64), batch[:, 1:].reshape(-1)).backward()
        want: dict[str, float] = {}  # the plain loop, before the optimizer's step
        for name, p in model.named_parameters():
            if p.grad is not None:
                layer = layer_of(name[len("base_model.model."):])
                want[layer] = want.get(layer, 0.0) + float(p.grad.double().pow(2).sum())
        opt.step()
    logged = tracker.metrics[0][1]
    assert sorted(k for k in logged if k.startswith("grad_norm/") and k != "grad_norm/global"
                  and k != "grad_norm/nonfinite") == sorted(f"grad_norm/{layer}" for layer in want) == [
        "grad_norm/h.0", "grad_norm/h.1"]
    for layer, sq in want.items():
        assert logged[f"grad_norm/{layer}"] == pytest.approx(sq ** 0.5, rel=1e-5)
    assert not any("base_model" in k for k in logged)
    wrapped = DistributedDataParallel(peft.get_peft_model(tiny_gpt(), lora))
    assert ghost_layers(wrapped, batch) == ghost_layers(peft.get_peft_model(tiny_gpt(), lora), batch) == [
        "h.0", "h.1"]
