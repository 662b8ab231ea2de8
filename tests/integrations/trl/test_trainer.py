"""trainer: finding the Trainer a callback belongs to from the caller frames, telling TRL's trainers
apart by their MRO (without importing trl), and method patches that leave the class untouched."""
from __future__ import annotations

from types import SimpleNamespace

from gradloc_track.integrations.trl.trainer import MethodPatch, find_trainer, is_trl, own_loss, trl_kind


class Loop:
    """Stands where Trainer._inner_training_loop stands: a `self` with a callback_handler."""

    def __init__(self, *callbacks) -> None:
        self.callback_handler = SimpleNamespace(callbacks=list(callbacks))

    def begin(self, callback):
        return find_trainer(callback)


def test_find_trainer_returns_the_loop_that_holds_this_very_callback():
    mine, other = object(), object()
    outer = Loop(other)
    inner = Loop(mine)
    assert inner.begin(mine) is inner
    assert outer.begin(mine) is None  # a handler holding another callback is not ours
    nested = Loop(mine)
    assert Loop(other).begin.__func__(nested, mine) is nested  # identity, not equality of handlers
    assert find_trainer(mine) is None  # no trainer in the frames at all


def trl_class(name: str, module: str, bases: tuple = (), **attrs) -> type:
    return type(name, bases, {"__module__": module, **attrs})


def test_kinds_by_class_name_and_module_along_the_mro():
    GRPO = trl_class("GRPOTrainer", "trl.trainer.grpo_trainer")
    SFT = trl_class("SFTTrainer", "trl.trainer.sft_trainer")
    DPO = trl_class("DPOTrainer", "trl.trainer.dpo_trainer")
    Fake = trl_class("GRPOTrainer", "mylib.trainers")  # same name, not TRL's
    Sub = trl_class("MyGRPO", "user", (GRPO,))
    assert trl_kind(object.__new__(GRPO)) == "grpo" and trl_kind(object.__new__(Sub)) == "grpo"
    assert trl_kind(object.__new__(SFT)) == "sft"
    assert trl_kind(object.__new__(DPO)) is None and is_trl(object.__new__(DPO))
    assert trl_kind(object.__new__(Fake)) is None and not is_trl(object.__new__(Fake))


def test_own_loss_names_the_first_class_below_trls_that_overrides_a_loss_method():
    GRPO = trl_class("GRPOTrainer", "trl.trainer.grpo_trainer", _compute_loss=lambda self: 0)
    Gmpo = trl_class("GMPOTrainer", "trl.experimental.gmpo", (GRPO,), _compute_loss=lambda self: 1)
    Logs = trl_class("Logs", "user", (GRPO,), log=lambda self: None)
    Deeper = trl_class("Deeper", "user", (Gmpo,))
    assert own_loss(object.__new__(GRPO), "grpo") is None
    assert own_loss(object.__new__(Logs), "grpo") is None
    why = own_loss(object.__new__(Deeper), "grpo")
    assert why == ("GMPOTrainer overrides GRPOTrainer._compute_loss: its loss is its own, and only "
                   "GRPOTrainer's is rebuilt")
    SFT = trl_class("SFTTrainer", "trl.trainer.sft_trainer")
    Mine = trl_class("MySFT", "user", (SFT,), compute_loss=lambda self: 0, log=lambda self: 0)
    assert own_loss(object.__new__(Mine), "sft").startswith("MySFT overrides SFTTrainer.compute_loss:")


class Counter:
    def step(self) -> str:
        return "class"


def test_method_patch_wraps_the_bound_method_and_restores_what_was_there():
    c = Counter()
    patch = MethodPatch(c, "step", lambda original: lambda: "patched " + original())
    assert c.step() == "patched class" and Counter().step() == "class"
    patch.remove()
    assert c.step() == "class" and "step" not in vars(c)
    patch.remove()  # twice is harmless

    c.step = lambda: "someone else's"  # an instance attribute set before us comes back
    patch = MethodPatch(c, "step", lambda original: lambda: "patched " + original())
    assert c.step() == "patched someone else's"
    patch.remove()
    assert c.step() == "someone else's"
