"""TRL trainers whose loss is not the one gradloc-track rebuilds are detection only, and say why on the
console: another TRL trainer (DPO, KTO...), a GRPOTrainer subclass with its own loss (TRL's GMPOTrainer,
a user's ``_compute_loss``), a trainer whose first micro-batch's loss is not the rebuild's (a patched
instance). Never rebuilt as GRPO (GMPO's loss is -0.067 as GRPO against its own 2.2e-8)."""
from __future__ import annotations

import warnings

import pytest

from .trl_setup import LETTERS, char_tokenizer, gpt2, vowel_reward

pytest.importorskip("trl")


def trl_class(name: str, module: str = "trl.trainer.dpo_trainer", bases: tuple = ()) -> type:
    return type(name, bases, {"__module__": module})


def test_another_trl_trainer_and_a_loss_overriding_subclass_are_detection_only():
    from trl import GRPOTrainer, SFTTrainer

    from gradloc_track.integrations.trl.adapters import make_adapter
    from gradloc_track.integrations.trl.trainer import own_loss, trl_kind

    dpo = object.__new__(trl_class("DPOTrainer"))
    with pytest.warns(UserWarning, match="DPOTrainer's loss is not rebuilt"):
        adapter = make_adapter(dpo, "trl", None, None)
    assert adapter.context() is None and adapter.why_not() == \
        "DPOTrainer's loss is not rebuilt (GRPOTrainer's and SFTTrainer's are)"

    class MyGRPO(GRPOTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch) * 2

    class Logging(GRPOTrainer):  # a subclass that leaves the loss alone is rebuilt as GRPO
        def log(self, logs, start_time=None):
            return super().log(logs, start_time)

    class MySFT(SFTTrainer):
        def compute_loss(self, *a, **k):
            return super().compute_loss(*a, **k)

    assert own_loss(object.__new__(MyGRPO), "grpo") == \
        "MyGRPO overrides GRPOTrainer.compute_loss: its loss is its own, and only GRPOTrainer's is rebuilt"
    assert own_loss(object.__new__(Logging), "grpo") is None and own_loss(object.__new__(GRPOTrainer), "grpo") is None
    assert own_loss(object.__new__(MySFT), "sft").startswith("MySFT overrides SFTTrainer.compute_loss")
    mine = object.__new__(MyGRPO)
    assert trl_kind(mine) == "grpo"
    with pytest.warns(UserWarning, match="MyGRPO overrides GRPOTrainer.compute_loss"):
        adapter = make_adapter(mine, "grpo", None, None)
    assert adapter.inner is None and "MyGRPO overrides" in adapter.why_not()
    try:
        from trl.experimental.gmpo import GMPOTrainer
    except ImportError:  # another TRL version: the user subclasses above stand for it
        return
    assert own_loss(object.__new__(GMPOTrainer), "grpo").startswith("GMPOTrainer overrides GRPOTrainer._compute_loss")


class Inflate:
    """A callback ahead of gradloc-track's that multiplies step ``at``'s gradient: a spike, on cue."""

    def __init__(self, at: int) -> None:
        from transformers import TrainerCallback

        self.at, self.cb = at, type("InflateCallback", (TrainerCallback,), {"on_pre_optimizer_step": self.hook})()

    def hook(self, args, state, control, model=None, **kwargs):
        if state.global_step + 1 == self.at:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(1e3)


def train_grpo(tmp_path, trainer_cls, config_cls, patch=None, steps: int = 3, **spikes):
    """``steps`` GRPO steps of a tiny model with the callback (``spikes``: more detector options), a spike
    forced at the last one; the callback and the warnings."""
    from datasets import Dataset

    from gradloc_track.integrations.trl import GradLocCallback

    bpe, tok = char_tokenizer(tmp_path / "tok")
    model = gpt2(bpe.vocab_size, tok.pad_token_id, dropout=0.0)
    cb = GradLocCallback(tracker="none", run_dir=tmp_path / "run", spikes={"warmup_steps": 1, "alpha": 0.5, **spikes})
    args = config_cls(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=4, max_steps=steps, learning_rate=1e-3, report_to=[], save_strategy="no",
                      use_cpu=True, disable_tqdm=True, bf16=False, seed=0, logging_steps=1)
    prompts = Dataset.from_dict({"prompt": [LETTERS[i:i + 3] for i in range(12)]})
    trainer = trainer_cls(model=model, reward_funcs=vowel_reward, args=args, train_dataset=prompts,
                          processing_class=tok, callbacks=[Inflate(steps).cb, cb])
    if patch is not None:
        patch(trainer)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        trainer.train()
    return cb, [str(w.message) for w in said]


def test_gmpo_is_monitored_and_its_spike_says_why_it_is_not_localized(tmp_path, capsys):
    gmpo = pytest.importorskip("trl.experimental.gmpo")
    cb, said = train_grpo(tmp_path, gmpo.GMPOTrainer, gmpo.GMPOConfig)
    assert any("GMPOTrainer overrides GRPOTrainer._compute_loss" in w for w in said)
    assert cb.handle.spikes[-1].step == 3 and all(s.locate is None for s in cb.handle.spikes)  # detected only
    err = capsys.readouterr().err
    assert "── spike at step 3" in err
    assert "culprits   not localized: GMPOTrainer overrides GRPOTrainer._compute_loss: its loss is its own" in err


def test_a_trainer_whose_loss_is_not_the_rebuilds_is_caught_on_its_first_micro_batch(tmp_path, capsys):
    """A patched instance (what no class check sees): its first micro-batch's loss is compared with the
    rebuild, found different, and the run goes on detection only, said on the console."""
    from trl import GRPOConfig, GRPOTrainer

    def halve(trainer):
        own = trainer._compute_loss
        trainer._compute_loss = lambda model, inputs: 0.5 * own(model, inputs)

    cb, said = train_grpo(tmp_path, GRPOTrainer, GRPOConfig, patch=halve)
    assert any("is not the rebuilt GRPO loss" in w for w in said), said
    assert cb.handle.spikes[-1].step == 3 and all(s.locate is None for s in cb.handle.spikes)
    assert "not localized: the loss GRPOTrainer returned on its first micro-batch is not the rebuilt" in \
        capsys.readouterr().err


def test_grpotrainers_own_loss_passes_the_check(tmp_path, capsys):
    """GRPOTrainer itself: the first micro-batch's gradients agree, the rebuild stays on (its spike goes to the
    localizer; whether it finds a culprit in a uniformly inflated step is not this test's business), and the
    block shows what surgery did."""
    from trl import GRPOConfig, GRPOTrainer

    cb, said = train_grpo(tmp_path, GRPOTrainer, GRPOConfig, response="surgery")
    assert cb.adapter is None  # removed at train end
    assert not any("not the rebuilt" in w or "spikes are detected but not localized" in w for w in said), said
    assert cb.handle.spikes[-1].step == 3
    err = capsys.readouterr().err
    assert "── spike at step 3" in err and "loss is not rebuilt" not in err and "not the rebuilt" not in err
    assert "  surgery    " in err  # spikes.response=surgery: what it removed, or why nothing
