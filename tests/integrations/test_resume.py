"""A run resumed from a framework checkpoint goes on as the uninterrupted one: the callbacks save the
clipper's thresholds and the detector's statistics with Trainer's / Lightning's checkpoint and read them
back on resume (before: AdaGC and the detector started their warm-up anew after every resume)."""
from __future__ import annotations

import warnings

import pytest
import torch

from .conftest import BATCH, LR, tiny_gpt2
from .test_hf import hf_dataset

STEPS, SAVE_AT = 12, 6
OPTS = {"tracker": "none", "clip": {"kind": "adagc", "warmup_steps": 3}, "locate": False, "console": False,
        "spikes": {"warmup_steps": 3}}


def hf_args(tmp_path, steps=STEPS):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=BATCH, max_steps=steps, learning_rate=LR,
        lr_scheduler_type="constant", weight_decay=0.0, report_to="none", save_strategy="steps", save_steps=SAVE_AT,
        max_grad_norm=0.0, train_sampling_strategy="sequential", use_cpu=True, disable_tqdm=True,
        dataloader_num_workers=0, seed=0)


def hf_train(tmp_path, resume=None, steps=STEPS):
    from transformers import Trainer

    from gradloc_track.integrations.hf import GradLocCallback

    callback = GradLocCallback(**OPTS)
    Trainer(model=tiny_gpt2(), args=hf_args(tmp_path, steps), train_dataset=hf_dataset(1), callbacks=[callback]).train(
        resume_from_checkpoint=resume)
    return callback.handle


def held(handle):
    """The clipper's thresholds and the detector's statistics (what a warm-up anew would reset)."""
    clip, spikes = handle.monitor.clipper.state_dict(), handle.monitor.detector.state_dict()
    return clip["steps"], clip["gamma"], spikes["count"], spikes["signals"]


def test_trainer_resume_from_checkpoint_keeps_the_clipper_and_the_detector(tmp_path):
    straight = held(hf_train(tmp_path / "straight"))
    hf_train(tmp_path / "resumed")  # writes checkpoint-6 (and -12) with gradloc_track.pt beside them
    folder = tmp_path / "resumed" / "out" / f"checkpoint-{SAVE_AT}"
    assert (folder / "gradloc_track.pt").is_file()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "starts its warm-up anew"
        resumed = held(hf_train(tmp_path / "resumed", resume=str(folder)))
    assert resumed[0] == straight[0] == STEPS and resumed[2] == straight[2]
    torch.testing.assert_close(resumed[1], straight[1], rtol=1e-5, atol=0)
    same_signals(resumed[3], straight[3])


def same_signals(resumed: dict, straight: dict) -> None:
    """Every signal's running statistics as in the uninterrupted run; the update signal's one lag (it is
    measured after the optimizer's step and read at the next one: the step before the checkpoint's update
    is not in it) costs it one reading, no more (a warm-up anew would leave it at STEPS - SAVE_AT)."""
    assert resumed.keys() == straight.keys()
    for name in straight:
        if name == "@update":
            assert resumed[name][0] == straight[name][0] - 1
        else:
            assert resumed[name] == pytest.approx(straight[name], rel=1e-4, abs=1e-9), name


def test_a_checkpoint_without_our_state_is_said_and_training_goes_on(tmp_path):
    hf_train(tmp_path)
    folder = tmp_path / "out" / f"checkpoint-{SAVE_AT}"
    (folder / "gradloc_track.pt").unlink()
    with pytest.warns(UserWarning, match=rf"resumes at step {SAVE_AT} but .*checkpoint-{SAVE_AT}/gradloc_track.pt "
                                         r"is not there .*start their warm-up anew"):
        handle = hf_train(tmp_path, resume=str(folder))
    assert handle.monitor.clipper.state_dict()["steps"] == STEPS - SAVE_AT  # counted from the resume


def test_the_state_comes_from_the_checkpoint_resumed_not_from_output_dir(tmp_path):
    """A checkpoint kept elsewhere, resumed by a job with its own output_dir that holds another run's
    checkpoint-6: the resumed folder's state is loaded (reviewer: output_dir's was, silently)."""
    import shutil

    hf_train(tmp_path / "first")
    keep = tmp_path / "keep" / f"checkpoint-{SAVE_AT}"
    shutil.copytree(tmp_path / "first" / "out" / f"checkpoint-{SAVE_AT}", keep)
    stale = tmp_path / "second" / "out" / f"checkpoint-{SAVE_AT}"
    stale.mkdir(parents=True)
    state = torch.load(keep / "gradloc_track.pt", weights_only=True)
    state["clipper"]["steps"] = 1000  # another run's
    torch.save(state, stale / "gradloc_track.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        handle = hf_train(tmp_path / "second", resume=str(keep))
    assert handle.monitor.clipper.state_dict()["steps"] == STEPS


def test_a_train_that_raised_and_is_called_again_loads_the_checkpoint(tmp_path):
    """train(resume_from_checkpoint=...) again on the same Trainer after a crash: the handle the crash left open
    takes the checkpoint's state (reviewer: it went on from the crashed steps, 14 instead of 12)."""
    from transformers import Trainer, TrainerCallback

    from gradloc_track.integrations.hf import GradLocCallback

    class Crash(TrainerCallback):
        fired = False

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 8 and not Crash.fired:
                Crash.fired = True
                raise RuntimeError("node failure")

    callback = GradLocCallback(**OPTS)
    trainer = Trainer(model=tiny_gpt2(), args=hf_args(tmp_path), train_dataset=hf_dataset(1),
                      callbacks=[callback, Crash()])
    with pytest.raises(RuntimeError, match="node failure"):
        trainer.train()
    assert not callback.handle.finished and callback.handle.monitor.clipper.state_dict()["steps"] == 8
    trainer.train(resume_from_checkpoint=str(tmp_path / "out" / f"checkpoint-{SAVE_AT}"))
    assert callback.handle.monitor.clipper.state_dict()["steps"] == STEPS


def test_another_runs_state_with_more_steps_than_the_resume_is_not_loaded(tmp_path):
    hf_train(tmp_path)
    path = tmp_path / "out" / f"checkpoint-{SAVE_AT}" / "gradloc_track.pt"
    state = torch.load(path, weights_only=True)
    state["steps"] = 500
    torch.save(state, path)
    with pytest.warns(UserWarning, match=rf"holds the state after 500 steps, but training resumes at step {SAVE_AT}"):
        handle = hf_train(tmp_path, resume=str(path.parent))
    assert handle.monitor.clipper.state_dict()["steps"] == STEPS - SAVE_AT


def test_a_resume_with_another_clipper_kind_warms_it_up_and_keeps_the_rest(tmp_path):
    """The HF callback has no option to skip its state: another clipper kind than the saved one raised in
    ``train()``, and the way out it named (deleting the state file) lost the detector's too (held-out tester, stop
    63). Now the clipper warms up anew, said, and the detector's state is loaded."""
    import torch
    from transformers import Trainer

    from gradloc_track.integrations.hf import GradLocCallback

    hf_train(tmp_path)
    folder = tmp_path / "out" / f"checkpoint-{SAVE_AT}"
    saved = torch.load(folder / "gradloc_track.pt", weights_only=True)
    callback = GradLocCallback(**{**OPTS, "clip": {"kind": "zclip", "warmup_steps": 3}})
    trainer = Trainer(model=tiny_gpt2(), args=hf_args(tmp_path), train_dataset=hf_dataset(1), callbacks=[callback])
    with pytest.warns(UserWarning, match=r"the saved clipper state is a clip=adagc clipper's, not used by this "
                                         r"clip=zclip one: the clipper starts its warm-up anew; the rest"):
        trainer.train(resume_from_checkpoint=str(folder))
    assert callback.handle.steps == STEPS  # the step count went on from the saved one
    assert callback.handle.monitor.detector.state_dict()["count"] >= saved["detector"]["count"]


def test_lightning_fit_from_ckpt_path_keeps_the_clipper_and_the_detector(tmp_path):
    """Lightning's own resume is not bit-exact here (without our callback too), so the check is on what the
    callback carries: the handle starts from the checkpoint's state exactly, and goes on counting from it."""
    L = pytest.importorskip("lightning.pytorch")
    from torch.utils.data import DataLoader

    from gradloc_track.integrations.lightning import GradLocCallback

    from .test_lightning import CausalLM

    at_start, current = {}, {}

    class Peek(L.Callback):  # after GradLocCallback's on_fit_start: the handle as the first step finds it
        def on_train_start(self, trainer, pl_module):
            at_start["state"] = current["callback"].handle.state_dict()

    def fit(steps, ckpt_path=None):
        torch.manual_seed(0)
        gradloc = current["callback"] = GradLocCallback(**OPTS)
        trainer = L.Trainer(max_steps=steps, logger=False, callbacks=[gradloc, Peek()], accelerator="cpu",
                            devices=1, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, default_root_dir=str(tmp_path))
        trainer.fit(CausalLM(tiny_gpt2()), DataLoader(hf_dataset(1), batch_size=BATCH, shuffle=False),
                    ckpt_path=ckpt_path)
        return trainer, gradloc.handle

    trainer, first = fit(SAVE_AT)
    trainer.save_checkpoint(tmp_path / "half.ckpt")
    saved = torch.load(tmp_path / "half.ckpt", weights_only=False)["callbacks"]
    (state,) = [v for k, v in saved.items() if "GradLocCallback" in k]
    assert state["clipper"]["steps"] == SAVE_AT and state["detector"]["signals"]["global"][0] == SAVE_AT
    _, resumed = fit(STEPS, ckpt_path=str(tmp_path / "half.ckpt"))
    torch.testing.assert_close(at_start["state"]["clipper"]["gamma"], state["clipper"]["gamma"], rtol=0, atol=0)
    assert at_start["state"]["detector"] == state["detector"]  # the checkpoint's statistics, not a warm-up anew
    assert resumed.monitor.clipper.steps == STEPS  # went on counting from it
    assert resumed.monitor.detector.state_dict()["signals"]["global"][0] == STEPS

    trainer = L.Trainer(max_steps=SAVE_AT, logger=False, accelerator="cpu", devices=1, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.fit(CausalLM(tiny_gpt2()), DataLoader(hf_dataset(1), batch_size=BATCH, shuffle=False))
    trainer.save_checkpoint(tmp_path / "without.ckpt")  # no GradLocCallback in that run: said on resume
    with pytest.warns(UserWarning, match=r"fit resumes from .*without.ckpt, which holds no GradLocCallback state"):
        fit(STEPS, ckpt_path=str(tmp_path / "without.ckpt"))


def test_two_lightning_callbacks_of_other_clippers_fit_in_one_trainer(tmp_path):
    """The callback is stateful now; its state key names its clipper, so a second one (another clip kind) is not
    refused as a duplicate (reviewer: RuntimeError 'more than one stateful callback of type GradLocCallback')."""
    L = pytest.importorskip("lightning.pytorch")
    from gradloc_track.integrations.lightning import GradLocCallback

    a, b = GradLocCallback(tracker="none"), GradLocCallback(tracker="none", clip="adagc")
    assert a.state_key != b.state_key
    L.Trainer(callbacks=[a, b], accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, default_root_dir=str(tmp_path))


def test_lightning_strategies_that_restore_after_setup_and_a_validate_before_a_fresh_fit(tmp_path):
    """FSDP, DeepSpeed and ModelParallel restore the checkpoint after ``on_fit_start`` (the handle exists by
    then): the state goes into it, no warning (before: the state was kept and never applied, silently). And
    ``validate(ckpt_path=)`` restores callbacks too: a later fresh ``fit()`` does not start from that state
    (before: another run's clipper, detector and step count) (reviewer round 8)."""
    L = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.strategies import SingleDeviceStrategy
    from torch.utils.data import DataLoader

    from gradloc_track.integrations.lightning import GradLocCallback

    from .test_lightning import CausalLM

    class LateRestore(SingleDeviceStrategy):  # the one property those strategies set
        @property
        def restore_checkpoint_after_setup(self):
            return True

    class LM(CausalLM):
        def validation_step(self, batch, batch_idx):
            return self.training_step(batch, batch_idx)

    at_start, current = {}, {}

    class Peek(L.Callback):
        def on_train_start(self, trainer, pl_module):
            at_start["steps"] = current["callback"].handle.monitor.clipper.steps

    def trainer(steps, strategy="auto"):
        torch.manual_seed(0)
        current["callback"] = GradLocCallback(**OPTS)
        return L.Trainer(max_steps=steps, logger=False, callbacks=[current["callback"], Peek()], strategy=strategy,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(tmp_path), limit_val_batches=1)

    def data():
        return DataLoader(hf_dataset(1), batch_size=BATCH, shuffle=False)

    first = trainer(SAVE_AT)
    first.fit(LM(tiny_gpt2()), data())
    first.save_checkpoint(tmp_path / "half.ckpt")
    late = trainer(STEPS, LateRestore(device=torch.device("cpu")))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="gradloc-track")
        late.fit(LM(tiny_gpt2()), data(), ckpt_path=str(tmp_path / "half.ckpt"))
    assert at_start["steps"] == SAVE_AT and current["callback"].handle.monitor.clipper.steps == STEPS

    again = trainer(4)
    model = LM(tiny_gpt2())
    again.validate(model, data(), ckpt_path=str(tmp_path / "half.ckpt"))
    again.fit(model, data())  # a fresh fit, no ckpt_path
    assert at_start["steps"] == 0 and current["callback"].handle.monitor.clipper.steps == 4


def test_a_hyperparameter_search_trial_saves_the_state_in_its_own_checkpoint(tmp_path):
    """Under ``hyperparameter_search`` Trainer saves to ``output_dir/run-<trial>/checkpoint-N``; the state went to
    ``output_dir/checkpoint-N`` (a folder nobody resumes from), so a trial's resume started the clipper anew
    (reviewer round 8). A trial as Trainer's Optuna backend hands it (``trial.number``), no Optuna needed."""
    from transformers import Trainer
    from transformers.trainer_utils import HPSearchBackend

    from gradloc_track.integrations.hf import GradLocCallback

    callback = GradLocCallback(**OPTS)
    trainer = Trainer(model=tiny_gpt2(), args=hf_args(tmp_path, steps=SAVE_AT), train_dataset=hf_dataset(1),
                      callbacks=[callback])
    trainer.hp_search_backend, trainer.hp_space = HPSearchBackend.OPTUNA, lambda trial: {}
    class Trial(dict):  # what Trainer reads of a trial: its number (Optuna), its params; a dict for hp_params
        number, params = 3, {}

    trainer.train(trial=Trial())
    folder = tmp_path / "out" / "run-3" / f"checkpoint-{SAVE_AT}"
    assert (folder / "model.safetensors").is_file() or any(folder.iterdir())  # Trainer's own checkpoint
    saved = torch.load(folder / "gradloc_track.pt", weights_only=True)
    assert saved["clipper"]["steps"] == SAVE_AT
    assert not (tmp_path / "out" / f"checkpoint-{SAVE_AT}").exists()


def test_watch_on_an_optimizer_that_stepped_says_once_to_load_the_handle_state(tmp_path):
    """Held-out tester, stop 55: watch() after a resume that loaded the model and the optimizer but not the
    handle's state numbered steps from 0 and missed a junk batch in the detector's new warm-up, silently."""
    import gradloc_track

    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))

    def steps(handle, n):
        for _ in range(n):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()

    first = gradloc_track.watch(model, opt, tracker="none", locate=False, console=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a fresh optimizer: nothing to say
        steps(first, 3)
    saved = first.state_dict()
    first.finish()
    with pytest.warns(RuntimeWarning, match=r"the optimizer has taken 3 step\(s\) before this watch\(\) handle's "
                                            r"first .* no handle state was loaded") as said:
        bare = gradloc_track.watch(model, opt, tracker="none", locate=False, console=False)
        steps(bare, 2)
    assert len([w for w in said if "handle state" in str(w.message)]) == 1 and "spikes.warmup_steps=" in \
        str(said[0].message)
    bare.finish()
    loaded = gradloc_track.watch(model, opt, tracker="none", locate=False, console=False)
    loaded.load_state_dict(saved)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        steps(loaded, 1)
    assert loaded.steps == 4
    loaded.finish()


def test_the_quarantines_blamed_samples_ride_in_the_handle_state():
    """Held-out tester, stop 55: docs/integrations.md says the handle's state is what a resumed run needs, but
    a resumed spikes.quarantine run forgot the samples it had blamed and trained on them again."""
    import gradloc_track

    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    h = gradloc_track.watch(model, opt, tracker="none", locate=False, console=False, spikes={"quarantine": True})
    h.quarantine.blamed["a" * 16] = 250
    h.quarantine.skipped = 2
    saved = h.state_dict()
    h.finish()
    again = gradloc_track.watch(model, opt, tracker="none", locate=False, console=False, spikes={"quarantine": True})
    again.load_state_dict(saved)
    assert again.quarantine.blamed == {"a" * 16: 250} and again.quarantine.skipped == 2
    with pytest.warns(RuntimeWarning, match="blamed for the spike at step 250"):
        assert not again.quarantine.admit("a" * 16, 300)
    again.finish()
    off = gradloc_track.watch(model, opt, tracker="none", locate=False, console=False)
    off.load_state_dict(saved)  # a resumed run without quarantine: the part is not its business
    assert off.quarantine is None
    off.finish()
