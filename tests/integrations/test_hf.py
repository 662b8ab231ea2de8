"""A real ``transformers.Trainer`` run with ``GradLocCallback``: one run, Trainer's and ours."""
from __future__ import annotations

import json
from pathlib import Path
import warnings

import pytest

from .conftest import BATCH, CORRUPT, FAST, INJECT_AT, LOG_EVERY, LR, STEPS, corrupted_positions, micro_batches, mlflow_table

pytest.importorskip("transformers")
K = 2  # gradient_accumulation_steps


def hf_dataset(k: int) -> list[dict]:
    """The micro-batches of every step, flattened into samples in training order."""
    return [{key: v[b] for key, v in mb.items()}
            for step in range(STEPS) for mb in micro_batches(step, k) for b in range(mb["input_ids"].shape[0])]


def train(model, tmp_path, report_to, callback, k: int = K, max_grad_norm: float = 0.0):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=BATCH // k, gradient_accumulation_steps=k,
        max_steps=STEPS, learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0, logging_steps=LOG_EVERY,
        report_to=report_to, save_strategy="no", max_grad_norm=max_grad_norm, train_sampling_strategy="sequential",
        use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=hf_dataset(k), callbacks=[callback])
    trainer.train()
    return trainer


def check_rows(rows: list[dict]) -> None:
    """The corrupted sample's tokens, in its micro-batch, at Trainer's step of that update."""
    assert {r["step"] for r in rows} == {INJECT_AT + 1}  # Trainer logs update s at global_step s + 1
    assert {(r["micro_batch"], r["sample"], r["position"]) for r in rows} == {
        (K - 1, CORRUPT, p) for p in corrupted_positions()}


def test_trainer_mlflow_one_run_holds_trainers_metrics_and_ours(gpt2, tmp_path, mlflow_store, monkeypatch):
    from gradloc_track.integrations.hf import GradLocCallback

    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "hf")
    callback = GradLocCallback(**FAST, log_every=LOG_EVERY)
    train(gpt2, tmp_path, ["mlflow"], callback)

    client = mlflow_store.client
    runs = mlflow_store.new_runs()
    assert len(runs) == 1, [r.info.run_name for r in runs]
    (run,) = runs
    assert run.info.status == "FINISHED"  # ended by Trainer's MLflowCallback, the run's owner
    metrics = run.data.metrics
    assert "loss" in metrics and "grad_norm" in metrics  # Trainer's
    assert "grad_norm/global" in metrics and any(k.startswith("clip/threshold/") for k in metrics)  # ours
    ours = [m.step for m in client.get_metric_history(run.info.run_id, "grad_norm/global")]
    trainers = [m.step for m in client.get_metric_history(run.info.run_id, "loss")]
    logged = list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))
    assert sorted(trainers) == logged and sorted(ours) == sorted(logged + [INJECT_AT + 1])  # one step axis
    table = mlflow_table(client, run.info.run_id, tmp_path)
    check_rows([dict(zip(table["columns"], r)) for r in table["data"]])


def test_trainer_wandb_offline_run_holds_our_metrics_and_table(gpt2, tmp_path, monkeypatch):
    import wandb

    from gradloc_track.integrations.hf import GradLocCallback

    from ..wandb_reader import history

    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_PROJECT", "hf")
    train(gpt2, tmp_path, ["wandb"], GradLocCallback(**FAST, log_every=LOG_EVERY))
    run = wandb.run
    assert run is not None  # Trainer's run: we did not end it
    # the run's own folder: wandb keeps the WANDB_DIR of the process's first run (an earlier test's)
    run_dir = Path(run.dir).parent
    run.finish()
    rows = history(run_dir)
    ours = [r for r in rows if "grad_norm/global" in r]
    logged = list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))
    assert sorted(r["train/global_step"] for r in ours) == sorted(logged + [INJECT_AT + 1])
    assert any("train/loss" in r for r in rows)  # Trainer's own metrics in the same run
    tables = [json.loads(p.read_text()) for p in (run_dir / "files" / "media" / "table").rglob("*.table.json")]
    (table,) = [t for t in tables if t["data"]][:1]
    check_rows([dict(zip(table["columns"], r)) for r in table["data"]])


def test_trainer_clipping_too_is_said_once(gpt2, tmp_path):
    from gradloc_track.integrations.hf import GradLocCallback

    callback = GradLocCallback(clip="adagc", spikes=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from transformers import Trainer, TrainingArguments

        args = TrainingArguments(output_dir=str(tmp_path / "o"), per_device_train_batch_size=2, max_steps=2,
                                 report_to=[], save_strategy="no", max_grad_norm=1.0, use_cpu=True,
                                 disable_tqdm=True)
        trainer = Trainer(model=gpt2, args=args, train_dataset=hf_dataset(1)[:4], callbacks=[callback])
        trainer.train()
        trainer.train()  # a second train() does not say it again
    said = [w for w in caught if "max_grad_norm=0" in str(w.message)]
    assert len(said) == 1 and "max_grad_norm=1.0" in str(said[0].message)
    assert callback.handle.last.step == 2
