"""The one handle (``integrations/handle.py``): every front door (``watch()``, HF Trainer, Lightning,
TRL) builds a ``WatchHandle`` through ``open_handle`` and gets its run from ``trackers.join``;
``close()`` / ``finish()`` take every hook off, so ``watch()`` -> ``finish()`` -> ``watch()`` trains;
each front door's run dir holds the joined MLflow run's record (``report`` and ``culprits`` following
it to the spike: ``test_watch.py``)."""
from __future__ import annotations

import json
import warnings

import pytest
import torch

import gradloc_track
from gradloc_track.integrations.handle import WatchHandle, hookable_optimizer
from gradloc_track.trackers.join import Run

from .conftest import BATCH, LR, plain_loop
from .test_hf import hf_dataset


def hooks(model: torch.nn.Module, optimizer) -> tuple[int, int, int, int]:
    """Step pre/post hooks on the optimizer, forward pre/post hooks on the model."""
    opt = hookable_optimizer(optimizer)
    return (len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks),
            len(model._forward_pre_hooks), len(model._forward_hooks))


def test_watch_finish_watch_trains_and_leaves_no_hook(gpt2):
    """Issue 28 item 10: the old optimizer hook raised "this watch() handle is finished" at the next step."""
    opt = torch.optim.AdamW(gpt2.parameters(), lr=LR)
    before = hooks(gpt2, opt)
    handles = []
    for _ in range(2):
        handle = gradloc_track.watch(gpt2, opt, clip="adagc", tracker="none", spikes=False)
        assert hooks(gpt2, opt) == (before[0] + 2, before[1] + 1, before[2] + 1, before[3] + 1)  # ours + the guard
        plain_loop(gpt2, opt, steps=2)
        handle.finish()
        assert hooks(gpt2, opt) == before and handle.monitor.clipper.skip_guard is None
        handles.append(handle)
    assert [h.steps for h in handles] == [2, 2]
    opt.step()  # no hook of a finished handle left to raise
    with pytest.raises(RuntimeError, match="call watch"):  # an explicit call still says what to do
        handles[0].step()


def _watch(gpt2, run_dir, mlflow_store):
    import mlflow

    mlflow.set_experiment("doors")
    opt = torch.optim.AdamW(gpt2.parameters(), lr=LR)
    with mlflow.start_run() as active:
        handle = gradloc_track.watch(gpt2, opt, run_dir=run_dir, spikes=False)
        plain_loop(gpt2, opt, steps=2)
        handle.finish()
    return handle, gpt2, opt, active.info.run_id


def _training_args(tmp_path, **kw):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=BATCH, max_steps=2,
                             learning_rate=LR, report_to=["mlflow"], save_strategy="no", use_cpu=True,
                             disable_tqdm=True, seed=0, **kw)


def _hf(gpt2, run_dir, mlflow_store):
    from transformers import Trainer

    from gradloc_track.integrations.hf import GradLocCallback

    callback = GradLocCallback(run_dir=run_dir, spikes=False)
    trainer = Trainer(model=gpt2, args=_training_args(run_dir.parent), train_dataset=hf_dataset(1)[: 2 * BATCH],
                      callbacks=[callback])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # taking over Trainer's clipping is said once: not this test's subject
        trainer.train()
    (run,) = mlflow_store.new_runs()
    return callback.handle, gpt2, trainer.optimizer, run.info.run_id


def _lightning(gpt2, run_dir, mlflow_store):
    import lightning.pytorch as L
    from lightning.pytorch.loggers import MLFlowLogger
    from torch.utils.data import DataLoader

    from gradloc_track.integrations.lightning import GradLocCallback

    from .test_lightning import CausalLM

    logger = MLFlowLogger(experiment_name="doors", tracking_uri=mlflow_store.uri)
    callback = GradLocCallback(run_dir=run_dir, spikes=False, clip="zclip")
    trainer = L.Trainer(max_steps=2, logger=logger, callbacks=[callback], accelerator="cpu", devices=1,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(run_dir.parent))
    trainer.fit(CausalLM(gpt2), DataLoader(hf_dataset(1)[: 2 * BATCH], batch_size=BATCH))
    return callback.handle, gpt2, trainer.optimizers[0], logger.run_id


def _trl(gpt2, run_dir, mlflow_store):
    from gradloc_track.integrations.trl import GradLocCallback

    from .trl_setup import char_tokenizer, gpt2 as trl_gpt2, sft_trainer

    bpe, tok = char_tokenizer(run_dir.parent / "tok")
    model = trl_gpt2(bpe.vocab_size, tok.pad_token_id, positions=48, dropout=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = sft_trainer(run_dir.parent, tok, model, ["abcdefgh", "ijklmnop", "qrstuv", "wxyzab"] * 2,
                              report_to=["mlflow"])
        callback = GradLocCallback(run_dir=run_dir, spikes=False)
        trainer.add_callback(callback)
        trainer.train()
    assert callback.adapter is None and callback.handle.capture is None  # TRL's batches, not forward hooks
    (run,) = mlflow_store.new_runs()
    return callback.handle, model, trainer.optimizer, run.info.run_id


DOORS = {"watch": _watch, "hf": _hf, "lightning": _lightning, "trl": _trl}


@pytest.mark.parametrize("door", list(DOORS))
def test_every_front_door_builds_the_one_handle_joins_the_run_and_leaves_no_hook(door, gpt2, tmp_path, mlflow_store,
                                                                                 monkeypatch, capsys):
    if door == "lightning":
        pytest.importorskip("lightning")
    if door == "trl":
        pytest.importorskip("trl")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "doors")
    run_dir = tmp_path / "run"
    handle, model, optimizer, run_id = DOORS[door](gpt2, run_dir, mlflow_store)
    assert type(handle) is WatchHandle and isinstance(handle.run, Run) and handle.finished
    assert handle.run.joined == ("mlflow",) and handle.run_dir == run_dir and handle.steps == 2
    record = json.loads((run_dir / "tracker" / "mlflow.json").read_text())
    assert record["spec"]["joined"] is True and record["view"]["run_id"] == run_id  # what report/culprits follow
    assert hooks(model, optimizer) == (0, 0, 0, 0)  # the pre-hook, the skip guard, the capture: all off
    said = capsys.readouterr().err
    assert "joined MLflow run" in said and run_id in said  # the run's link, said once it is joined


def test_a_door_can_wrap_the_runs_tracker_before_the_monitor_is_built():
    """``Door.wrap_tracker`` (verl's door holds the monitor's metrics for verl's own logger): the
    monitor logs through the wrapper, and closing the handle finishes the run through it."""
    from gradloc_track.integrations.handle import Door, open_handle
    from gradloc_track.integrations.options import resolve_options
    from gradloc_track.trackers.interface import Tracker
    from gradloc_track.trackers.memory_tracker import MemoryTracker

    class Held(Tracker):
        def __init__(self, wrapped):
            self.wrapped, self.metrics = wrapped, {}

        def log_metrics(self, metrics, step):
            self.metrics.update(metrics)

        def finish(self, status="success", timeout_s=None):
            self.wrapped.finish(status, timeout_s)

    model = torch.nn.Linear(4, 4)
    opts = resolve_options(tracker="memory", spikes=False)  # a run of ours: close() finishes it
    handle = open_handle(model, None, opts, Door("test", hook_optimizer=False, wrap_tracker=Held))
    model(torch.randn(2, 4)).square().sum().backward()
    handle.step()
    inner = handle.tracker.wrapped
    assert isinstance(handle.tracker, Held) and isinstance(inner, MemoryTracker)
    assert "grad_norm/global" in handle.tracker.metrics and not inner.keys()  # held by the wrapper
    handle.close()
    assert inner.finished == "success"


@pytest.mark.parametrize("tracker", ["memory", "none"])
def test_a_run_without_run_dir_leaves_no_rendered_heatmap_in_the_temp_dir(gpt2, tracker, temp_root):
    """A localized spike of a run with no run dir rendered its heatmap into /tmp/gradloc-spikes-XXXX (its
    tracker, memory or none, has no run dir of its own), never removed: one more dir a run. close() removes it."""
    from .conftest import FAST

    opt = torch.optim.AdamW(gpt2.parameters(), lr=LR)
    handle = gradloc_track.watch(gpt2, opt, tracker=tracker, console=False, **FAST)
    plain_loop(gpt2, opt)
    assert any(s.locate is not None for s in handle.spikes)  # the spike was localized (and, memory: drawn)
    if tracker == "memory":
        ((_, _, png),) = handle.tracker.images
        assert png.read_bytes()[:4] == b"\x89PNG"  # there while the run is open
    handle.close()
    assert not list(temp_root.iterdir())


def test_the_callers_own_tracker_keeps_its_heatmaps_after_close(gpt2, temp_root):
    """A caller's tracker is theirs to finish after ``close()`` (it may upload the files then): the scratch
    heatmaps it was given stay until the process exits (review of 997531a: close() removed them)."""
    from .conftest import FAST

    mine = gradloc_track.MemoryTracker()
    opt = torch.optim.AdamW(gpt2.parameters(), lr=LR)
    handle = gradloc_track.watch(gpt2, opt, tracker=mine, console=False, **FAST)
    plain_loop(gpt2, opt)
    handle.close()
    ((_, _, png),) = mine.images
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_two_optimizers_are_told_how_to_watch_them(gpt2):
    """A tester, stop 55: ``watch(model, [opt1, opt2])`` was a bare "cannot hook list.step()"; and watching the
    second of two optimizers let the first step on unclipped gradients while the run logged them clipped."""
    emb = [p for n, p in gpt2.named_parameters() if "wte" in n or "wpe" in n]
    rest = [p for n, p in gpt2.named_parameters() if not ("wte" in n or "wpe" in n)]
    opt1, opt2 = torch.optim.SGD(emb, lr=LR), torch.optim.AdamW(rest, lr=LR)
    with pytest.raises(TypeError, match=r"watch\(\) takes one torch optimizer, not a list of 2: with several, pass "
                                        r"none"):
        gradloc_track.watch(gpt2, [opt1, opt2], tracker="none", console=False)
    with pytest.raises(TypeError, match=r"not a dict of 1: with several"):  # (stop 56: "not 1")
        gradloc_track.watch(gpt2, {"a": opt1}, tracker="none", console=False)
    with pytest.warns(RuntimeWarning, match=r"holds none of 2 trainable parameter\(s\) of the model "
                                            r"\(transformer\.wte\.weight, transformer\.wpe\.weight\)"):
        h = gradloc_track.watch(gpt2, opt2, tracker="none", console=False)
    h.finish()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # one optimizer over every trainable parameter: nothing
        whole = gradloc_track.watch(gpt2, torch.optim.AdamW(gpt2.parameters(), lr=LR), tracker="none", console=False)
        whole.finish()
        # an optimizer over fp32 master copies holds none of the model's tensors: another space, not a part (review)
        master = torch.optim.AdamW([p.detach().float().clone().requires_grad_() for p in gpt2.parameters()], lr=LR)
        gradloc_track.watch(gpt2, master, tracker="none", console=False).finish()
