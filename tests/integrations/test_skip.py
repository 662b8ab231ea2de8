"""Skip means skip wherever we know the optimizer (issue 17): ``watch()``, the HF Trainer and the
Lightning callbacks make ``on_nonfinite="skip"`` leave parameters and optimizer state bitwise
unchanged on a non-finite step, with the optimizers those frameworks use by default."""
from __future__ import annotations

import copy

import pytest
import torch

import gradloc_track
from gradloc_track import MemoryTracker

from .conftest import BATCH, LR, micro_batches

BAD = 3  # the step whose gradient gets a NaN
QUIET = {"tracker": "none", "clip": "global", "spikes": False, "locate": False}


def snapshot(params, opt):
    state = opt.state_dict()["state"]
    return ([p.detach().clone() for p in params],
            {k: {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in s.items()} for k, s in state.items()})


def assert_same(a, b):
    (pa, sa), (pb, sb) = a, b
    assert all(torch.equal(x, y) for x, y in zip(pa, pb))
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].keys() == sb[k].keys()
        for n, v in sa[k].items():
            assert torch.equal(v, sb[k][n]) if isinstance(v, torch.Tensor) else v == sb[k][n], (k, n)


def poison(model) -> None:
    next(p for p in model.parameters() if p.grad is not None).grad.view(-1)[0] = float("nan")


@pytest.mark.parametrize("fused", [False, True])
def test_watch_skips_a_non_finite_step_bitwise(gpt2, fused):
    opt = torch.optim.AdamW(gpt2.parameters(), lr=LR, weight_decay=0.1, fused=fused)
    clean = copy.deepcopy(gpt2)
    clean_opt = torch.optim.AdamW(clean.parameters(), lr=LR, weight_decay=0.1, fused=fused)
    handle = gradloc_track.watch(gpt2, opt, **QUIET)
    clean_handle = gradloc_track.watch(clean, clean_opt, **QUIET)
    assert handle.monitor.skip_guard.mode == ("fused" if fused else "sync")
    for step in range(6):
        (mb,) = micro_batches(step, 1)
        gpt2(**mb).loss.backward()
        if step == BAD:
            poison(gpt2)
            before = snapshot(list(gpt2.parameters()), opt)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step == BAD:
            assert_same(snapshot(list(gpt2.parameters()), opt), before)
            continue
        clean(**mb).loss.backward()  # the twin never sees the bad step
        clean_opt.step()
        clean_opt.zero_grad(set_to_none=True)
    assert_same(snapshot(list(gpt2.parameters()), opt), snapshot(list(clean.parameters()), clean_opt))
    handle.remove()
    assert handle.monitor.skip_guard.clipper.skip_guard is None  # the guard's hooks went with the rest
    clean_handle.remove()


def test_hf_trainer_default_optimizer_skips_bitwise(gpt2, tmp_path):
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from gradloc_track.integrations.hf import GradLocCallback

    from .test_hf import hf_dataset

    seen = {}

    class Poison(TrainerCallback):  # runs before GradLocCallback's on_pre_optimizer_step
        def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kw):
            if state.global_step == BAD:
                poison(model)
                seen["before"] = snapshot(list(model.parameters()), optimizer)

        def on_optimizer_step(self, args, state, control, model=None, optimizer=None, **kw):
            if state.global_step == BAD:
                seen["after"] = snapshot(list(model.parameters()), optimizer)

    gradloc = GradLocCallback(**QUIET)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=BATCH, max_steps=6,
                             learning_rate=LR, report_to=[], save_strategy="no", max_grad_norm=0.0, use_cpu=True,
                             disable_tqdm=True, dataloader_num_workers=0, seed=0)
    Trainer(model=gpt2, args=args, train_dataset=hf_dataset(1), callbacks=[Poison(), gradloc]).train()
    assert gradloc.handle.monitor.skip_guard.mode == "fused"  # Trainer's default: adamw_torch_fused
    assert_same(seen["after"], seen["before"])
    assert all(torch.isfinite(p).all() for p in gpt2.parameters())


@pytest.mark.parametrize("fused", [False, True])
def test_lightning_skips_bitwise_inside_its_closure(gpt2, tmp_path, fused):
    L = pytest.importorskip("lightning.pytorch")
    from torch.utils.data import DataLoader

    from gradloc_track.integrations.lightning import GradLocCallback

    from .test_hf import hf_dataset
    from .test_lightning import CausalLM

    class Module(CausalLM):
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.1, fused=fused)

    seen = {}

    class Poison(L.Callback):  # inside Lightning's closure, before GradLocCallback's hook
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if trainer.global_step == BAD:
                poison(pl_module)
                seen["before"] = snapshot(list(pl_module.parameters()), optimizer)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == BAD:
                seen["after"] = snapshot(list(pl_module.parameters()), trainer.optimizers[0])

    gradloc = GradLocCallback(**QUIET)
    trainer = L.Trainer(max_steps=6, logger=False, callbacks=[Poison(), gradloc], accelerator="cpu", devices=1,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path))
    trainer.fit(Module(gpt2), DataLoader(hf_dataset(1), batch_size=BATCH, shuffle=False))
    assert gradloc.handle.monitor.skip_guard.mode == ("fused" if fused else "sync")
    assert_same(seen["after"], seen["before"])
    assert all(torch.isfinite(p).all() for p in gpt2.parameters())


def test_unknown_optimizer_warns_once_naming_the_guard(gpt2):
    handle = gradloc_track.watch(gpt2, None, tracker=MemoryTracker(), clip="global", spikes=False, locate=False)
    (mb,) = micro_batches(0, 1)
    gpt2(**mb).loss.backward()
    with pytest.warns(UserWarning, match="SkipStepGuard"):
        handle.step()
    assert handle.monitor.skip_guard is None
