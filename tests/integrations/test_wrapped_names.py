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


def test_a_lora_runs_detector_state_saved_with_the_peft_prefix_loads_under_the_bare_names():
    """Review, stop 57: a LoRA run's detector state saved before PEFT's prefix was dropped (layer signals under
    ``base_model.model.h.0``, ``names_as_read`` True) kept those keys, and the layers warmed up again from 0."""
    peft = pytest.importorskip("peft")

    model = peft.get_peft_model(tiny_gpt(), peft.LoraConfig(r=4, target_modules=["qkv", "fc"], lora_dropout=0.0))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

    def steps(n):
        for step in range(n):
            b = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(step))
            F.cross_entropy(model(b[:, :-1]).reshape(-1, 64), b[:, 1:].reshape(-1)).backward()
            opt.step()  # watch()'s optimizer hook monitors the step
            opt.zero_grad()

    with gradloc_track.watch(model, opt, tracker=MemoryTracker(), console=False, locate=False) as handle:
        steps(6)
        state = handle.state_dict()
    old = state["detector"]  # as a state saved before: the prefix in every layer key, names "as read"
    old["signals"] = {(k if k == "global" or k.startswith("@") else "base_model.model." + k): v
                      for k, v in old["signals"].items()}
    old["names_as_read"] = True
    with gradloc_track.watch(model, opt, tracker=MemoryTracker(), console=False, locate=False) as handle:
        handle.load_state_dict(state)
        layers = {k: int(s.n) for k, s in handle.monitor.detector.signals.items() if "h." in k}
    assert layers == {"h.0": 6, "h.1": 6}


def test_a_models_own_base_model_names_keep_their_adagc_state_after_freezing():
    """Review, stop 57: a (non-PEFT) model whose tensors are all named ``base_model.model.*`` had its saved AdaGC
    names stripped of that as PEFT's prefix when they differed from the model's (a tensor frozen since), and the
    state no longer loaded. A prefix the model's own names carry is the model's."""
    from gradloc_track.clip.adagc import AdaGC

    class Inner(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))

    class Mine(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.base_model = Inner()

    torch.manual_seed(0)
    model = Mine()
    clip = AdaGC(model)
    for _ in range(3):
        model.zero_grad()
        model.base_model.model(torch.randn(2, 4)).sum().backward()
        clip.clip()
    state = clip.state_dict()
    for p in model.base_model.model[0].parameters():
        p.requires_grad_(False)
    again = AdaGC(model)
    again.load_state_dict(state)
    assert again.names == ["base_model.model.1.weight", "base_model.model.1.bias"]
    assert again.state_dict()["steps"] == state["steps"] == 3  # its state, not a new one


def test_prompt_tuning_keeps_the_models_own_names():
    """Review, stop 57: prompt learning (prompt/prefix tuning) holds the model itself as ``base_model``, not a tuner
    holding it as ``.model``: stripping ``base_model.model.`` there cut the model's own ``model.`` off
    (``layers.0...`` beside ``base_model.lm_head``). Only a tuner's prefix is dropped."""
    peft = pytest.importorskip("peft")
    from transformers import LlamaConfig, LlamaForCausalLM

    from gradloc_track.grouping import own_named_parameters, wrapper_prefix

    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    model = peft.get_peft_model(llama, peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    assert wrapper_prefix(model) == ""
    names = [n for n, _ in own_named_parameters(model)]
    assert "base_model.model.layers.0.self_attn.q_proj.weight" in names and "base_model.lm_head.weight" in names
