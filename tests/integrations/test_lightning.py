"""A real Lightning Trainer with ``MLFlowLogger`` and ``GradLocCallback``: one run, the logger's; a
non-finite step skipped bitwise inside Lightning's closure."""
from __future__ import annotations

import pytest
import torch

from .conftest import BATCH, CORRUPT, FAST, INJECT_AT, LOG_EVERY, LR, STEPS, corrupted_positions, mlflow_table
from .nonfinite import BAD, QUIET, assert_same, poison, snapshot
from .test_hf import hf_dataset

L = pytest.importorskip("lightning.pytorch")
K = 2  # accumulate_grad_batches


class CausalLM(L.LightningModule):
    """The usual wrapper of an HF causal LM: forward returns logits, training_step the HF loss."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask=None):
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR)


def test_lightning_mlflow_logger_run_holds_its_metrics_and_ours(gpt2, tmp_path, mlflow_store, temp_root):
    from lightning.pytorch.loggers import MLFlowLogger
    from torch.utils.data import DataLoader

    from gradloc_track.integrations.lightning import GradLocCallback

    logger = MLFlowLogger(experiment_name="lightning", tracking_uri=mlflow_store.uri)
    trainer = L.Trainer(max_steps=STEPS, accumulate_grad_batches=K, logger=logger, log_every_n_steps=LOG_EVERY,
                        callbacks=[GradLocCallback(**FAST, log_every=LOG_EVERY)], accelerator="cpu", devices=1,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path))
    trainer.fit(CausalLM(gpt2), DataLoader(hf_dataset(K), batch_size=BATCH // K, shuffle=False))
    assert not list(temp_root.glob("gradloc-*"))  # the joined run's scratch dir went with on_fit_end

    client = mlflow_store.client
    (run,) = mlflow_store.new_runs()  # the logger's run, and no second one
    assert run.info.run_id == logger.run_id and run.info.status == "FINISHED"
    metrics = run.data.metrics
    assert "train_loss" in metrics  # the LightningModule's own
    # one step axis: Lightning logs update s at step s (every LOG_EVERY-th: s = 9, 19, ...), as we do
    theirs = [m.step for m in client.get_metric_history(run.info.run_id, "train_loss")]
    assert sorted(theirs) == list(range(LOG_EVERY - 1, STEPS, LOG_EVERY))
    assert "grad_norm/global" in metrics and any(k.startswith("clip/threshold/") for k in metrics)
    ours = sorted(m.step for m in client.get_metric_history(run.info.run_id, "grad_norm/global"))
    assert ours == sorted({*range(0, STEPS, LOG_EVERY), INJECT_AT})
    table = mlflow_table(client, run.info.run_id, tmp_path)
    rows = [dict(zip(table["columns"], r)) for r in table["data"]]
    assert {r["step"] for r in rows} == {INJECT_AT}
    assert {(r["micro_batch"], r["sample"], r["position"]) for r in rows} == {
        (K - 1, CORRUPT, p) for p in corrupted_positions()}


def test_lightning_wandb_logger_run_gets_our_metrics_and_stays_open(gpt2, tmp_path):
    import wandb
    from lightning.pytorch.loggers import WandbLogger
    from torch.utils.data import DataLoader

    from gradloc_track.integrations.lightning import GradLocCallback

    from ..wandb_reader import history

    logger = WandbLogger(project="lightning", save_dir=str(tmp_path), offline=True)
    steps = 3
    trainer = L.Trainer(max_steps=steps, logger=logger, log_every_n_steps=1, callbacks=[GradLocCallback(spikes=False)],
                        accelerator="cpu", devices=1, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.fit(CausalLM(gpt2), DataLoader(hf_dataset(1)[: steps * BATCH], batch_size=BATCH))
    run = logger.experiment
    assert wandb.run is run  # the logger's run: still open after fit
    run.finish()
    rows = history(next(tmp_path.rglob("offline-run-*")))
    ours = [r for r in rows if "grad_norm/global" in r]
    assert sorted(r["trainer/global_step"] for r in ours) == list(range(steps))  # the logger's step metric
    assert any("train_loss" in r for r in rows)


@pytest.mark.parametrize("fused", [False, True])
def test_lightning_skips_bitwise_inside_its_closure(gpt2, tmp_path, fused):
    from torch.utils.data import DataLoader

    from gradloc_track.integrations.lightning import GradLocCallback

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


def test_only_a_precision_holding_a_grad_scaler_makes_an_overflow_routine():
    """Reviewer round 12: "16-true" (HalfPrecision: no scaler, nothing skips a non-finite step) was taken for
    "16-mixed" by its name, and a real NaN read as routine skipped steps. Lightning's own plugins decide."""
    from types import SimpleNamespace

    from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision

    from gradloc_track.integrations.lightning import _has_loss_scaler

    mixed = MixedPrecision("16-mixed", device="cpu", scaler=torch.amp.GradScaler("cpu"))
    assert _has_loss_scaler(SimpleNamespace(precision_plugin=mixed))
    assert not _has_loss_scaler(SimpleNamespace(precision_plugin=HalfPrecision("16-true")))
    assert not _has_loss_scaler(SimpleNamespace(precision_plugin=MixedPrecision("bf16-mixed", device="cpu")))
    from lightning.pytorch.plugins.precision import DeepSpeedPrecision  # DeepSpeed scales float16 itself

    assert _has_loss_scaler(SimpleNamespace(precision_plugin=DeepSpeedPrecision("16-mixed")))
    assert not _has_loss_scaler(SimpleNamespace(precision_plugin=DeepSpeedPrecision("bf16-mixed")))


def test_the_loss_and_the_training_forwards_logits_feed_the_loss_sample_and_junk_signals(gpt2, tmp_path):
    """Held-out tester, stop 54: the Lightning door read gradient norms only (it sees no logits), so with the
    defaults a random-byte row the HF callback names at once went undetected (its step's norm 3.0x, under the
    threshold). Now the loss Lightning back-propagates (``on_before_backward``) feeds the loss signal, and the
    logits of ``training_step``'s forward (here the HF model inside the LightningModule: ``self.model(**batch)``)
    the sample and junk signals, measured once per micro-batch and never from the localizer's probes, on every
    step, as the other doors' do (the junk signal's runs of 16 terms do not fit these rows of 15; its case, a
    garbled 20-token span, named as span 27-50 of 30-50, was checked by hand)."""
    from torch.utils.data import DataLoader

    from gradloc_track import MemoryTracker
    from gradloc_track.integrations.lightning import GradLocCallback

    tracker = MemoryTracker()
    callback = GradLocCallback(**FAST, tracker=tracker, console=False)
    trainer = L.Trainer(max_steps=STEPS, accumulate_grad_batches=K, logger=False, callbacks=[callback],
                        accelerator="cpu", devices=1, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.fit(CausalLM(gpt2), DataLoader(hf_dataset(K), batch_size=BATCH // K, shuffle=False))
    for key in ("spike/zscore_loss", "spike/zscore_sample_loss"):
        z = dict(tracker.series(key))
        assert len(z) >= STEPS - FAST["spikes"]["warmup_steps"] - 1, (key, sorted(z))  # every step past the warm-up
        assert z[INJECT_AT] == max(z.values()) and z[INJECT_AT] > 4, (key, z[INJECT_AT])
    assert INJECT_AT in {s.step for s in callback.handle.spikes}


class EmbedBlockHead(L.LightningModule):
    """The minimal-GPT layout: an embedding, a block and a head as direct children, d < vocabulary."""

    def __init__(self, vocab: int = 64, d: int = 32):
        super().__init__()
        self.vocab, self.returned = vocab, []
        self.embed = torch.nn.Embedding(vocab, d)
        self.block = torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.GELU())
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, x):
        return self.head(self.block(self.embed(x)))

    def training_step(self, batch, batch_idx):
        (x,) = batch
        loss = torch.nn.functional.cross_entropy(self(x)[:, :-1].float().reshape(-1, self.vocab),
                                                 x[:, 1:].reshape(-1))
        self.returned.append(float(loss))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def test_the_logits_the_loss_is_computed_from_are_read_and_the_loss_as_training_step_returned_it(tmp_path):
    """Review, stop 54: the first child's output was taken for the logits (an nn.Embedding's (B, T, 32), and fit
    died on 'index 47 is out of bounds'); the loss fed was the GradScaler's scaled one (x1024, doubling at each
    growth: false spikes) and 1/K of it under accumulation. Now the output nearest the loss in its graph is
    read, and the loss is training_step's own."""
    from lightning.pytorch.plugins.precision import MixedPrecision
    from torch.utils.data import DataLoader, TensorDataset

    from gradloc_track import MemoryTracker
    from gradloc_track.integrations import batches as batches_mod
    from gradloc_track.integrations.lightning import GradLocCallback

    read, fed = [], []

    class Seen(GradLocCallback):
        def on_before_backward(self, trainer, pl_module, loss):
            super().on_before_backward(trainer, pl_module, loss)
            fed.append(float(self.handle.capture.batches[-1].loss))

    orig = batches_mod.BatchList.measure

    def spy(self, batch, output):
        read.append(tuple(batches_mod.logits_in(output).shape))
        return orig(self, batch, output)

    batches_mod.BatchList.measure = spy
    try:
        torch.manual_seed(0)
        model = EmbedBlockHead()
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        trainer = L.Trainer(max_steps=3, accumulate_grad_batches=2, logger=False, accelerator="cpu", devices=1,
                            callbacks=[Seen(tracker=MemoryTracker(), console=False)],
                            plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)], enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
        trainer.fit(model, DataLoader(TensorDataset(torch.randint(0, 64, (48, 16))), batch_size=4))
    finally:
        batches_mod.BatchList.measure = orig
    assert read and set(read) == {(4, 16, 64)}, read  # the head's logits, never the embedding's (4, 16, 32)
    assert len(fed) == len(model.returned) == 6
    assert fed == pytest.approx(model.returned, rel=1e-3), (fed, model.returned)


class ShiftedPairLM(L.LightningModule):
    """nanoGPT's convention in Lightning: the loader yields ``(x, y)`` with ``y`` already shifted, ``training_step``
    takes the cross-entropy of ``self.model(x)`` against ``y``; no ``forward`` (``WithForward`` has one)."""

    def __init__(self):
        super().__init__()
        from gradloc_track.demo.model import TinyGPT

        torch.manual_seed(0)
        self.model = TinyGPT(256, n_layer=2, n_head=2, d_model=32, max_seq_len=SHIFT_T)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.model(x).reshape(-1, 256), y.reshape(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


class WithForward(ShiftedPairLM):
    def forward(self, x):
        return self.model(x)


SHIFT_T, SHIFT_STEPS, SHIFT_AT = 32, 36, 30
SHIFT_TEXT = (b"Permission is granted to copy, distribute and/or modify this document under the terms of the licence, "
              b"provided that the above copyright notice and this permission notice appear in all copies. ") * 6


def _shifted_pairs() -> list:
    data = torch.tensor(list(SHIFT_TEXT), dtype=torch.long)
    out = []
    for s in range(SHIFT_STEPS):
        starts = torch.randint(0, len(data) - SHIFT_T - 1, (8,), generator=torch.Generator().manual_seed(s))
        xy = torch.stack([data[o:o + SHIFT_T + 1] for o in starts])
        if s == SHIFT_AT:
            xy[3] = torch.randint(128, 256, (SHIFT_T + 1,), generator=torch.Generator().manual_seed(7))
        out.append((xy[:, :-1], xy[:, 1:]))
    return out


def _fit_shifted(module, tmp_path):
    import warnings

    from gradloc_track import MemoryTracker
    from gradloc_track.integrations.lightning import GradLocCallback

    callback = GradLocCallback(spikes={"warmup_steps": 20}, tracker=MemoryTracker(), console=False)
    trainer = L.Trainer(max_steps=SHIFT_STEPS, logger=False, callbacks=[callback], accelerator="cpu", devices=1,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, torch.utils.data.DataLoader(_shifted_pairs(), batch_size=None, shuffle=False))
    return {s.step: s for s in callback.handle.spikes}, [str(w.message) for w in caught if "gradloc" in str(w.message)]


def test_a_shifted_x_y_pair_is_read_as_targets_and_its_garbage_row_named(tmp_path):
    """Held-out tester, stop 56: ``(x, y)`` with ``y`` already shifted was read as HF labels and shifted again, so
    the replay was another loss and the garbage row's step read ``irreproducible`` ("... or a hardware fault")."""
    spikes, said = _fit_shifted(WithForward(), tmp_path)
    assert SHIFT_AT in spikes, sorted(spikes)
    s = spikes[SHIFT_AT]
    assert s.cause == "data" and [(c.level, c.batch) for c in s.locate.culprits] == [("sample", 3)], s.cause_detail
    assert s.locate.step_check.replayed and not said, said


def test_a_lightning_module_without_forward_says_how_to_localize(tmp_path):
    """Its ``training_step`` calls ``self.model(x)``; the rebuild calls the module (stop 56: "localizing failed:
    NotImplementedError(... missing the required "forward" function)", the fix nowhere)."""
    spikes, said = _fit_shifted(ShiftedPairLM(), tmp_path)
    assert spikes[SHIFT_AT].cause == "data"  # detected on its losses, not localized
    assert len(said) == 1 and said[0].startswith("gradloc-track: the LightningModule defines no forward(), and its "
                                                 "per-term loss is rebuilt by calling it: define one that returns "
                                                 "the logits (def forward(self, x): return self.model(x))"), said


def test_an_ids_pair_is_told_labels_or_shifted_targets():
    from gradloc_track.integrations.batches import LMBatch

    x = torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4]])
    assert LMBatch.pair_is_shifted((x, x.clone())) is False  # HF labels: the ids themselves
    prompt = x.clone()
    prompt[:, :2] = -100
    assert LMBatch.pair_is_shifted((x, prompt)) is False  # a masked prompt
    y = torch.tensor([[6, 7, 8, 9], [2, 3, 4, -1]])  # the next token; nanoGPT's -1: no term
    assert LMBatch.pair_is_shifted((x, y)) is True
    assert LMBatch.pair_is_shifted((x, torch.tensor([[0, 0, 0, 0], [9, 9, 9, 9]]))) is None  # neither: labels
    same = torch.full((2, 4), 7)
    assert LMBatch.pair_is_shifted((same, same.clone())) is None  # rows of one token: both read alike, not told
    assert LMBatch.pair_is_shifted(x) is None and LMBatch.pair_is_shifted({"input_ids": x}) is None
    b = LMBatch.from_batch((x, y), shifted=True)
    assert b.labels is None and torch.equal(b.target_ids, y) and torch.equal(b.target_ids_only()[1], y[1].masked_fill(
        y[1] < 0, -100))


def test_a_first_batch_that_cannot_tell_leaves_the_convention_to_the_next():
    """A first batch of one repeated token reads as labels and as shifted targets alike: the next batch decides
    (review of 5b633b9: the first batch's answer was kept for the run, and shifted targets read as labels)."""
    from types import SimpleNamespace

    from gradloc_track.integrations.lightning import GradLocCallback

    class WithForward(L.LightningModule):
        def forward(self, x):
            return x

    fed = []
    callback = GradLocCallback(tracker="none", console=False)
    callback.handle = SimpleNamespace(capture=SimpleNamespace(add=fed.append, wanted=True))
    same = torch.full((2, 6), 7)
    x = torch.tensor([[1, 2, 3, 4, 5, 6], [3, 4, 5, 6, 7, 8]])
    for batch in ((same, same.clone()), (x, x + 1), (x, x + 1)):
        callback.on_train_batch_start(None, WithForward(), batch, 0)
    assert [b.target_ids is not None for b in fed] == [False, True, True] and callback._shifted is True
