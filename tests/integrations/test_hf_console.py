"""HF Trainer with GradLocCallback: a run nobody named gets a name (model, seed, time) instead of MLflow's or
W&B's random words, and ``TrainingArguments.run_name`` reads unset again after ``train()``; a name the user
set is kept. (The spike block at Trainer's step numbers: tests/examples/test_integration_examples.py.)"""
from __future__ import annotations

import re

import pytest

from ..examples.load import load_example

pytest.importorskip("transformers")


def train(tmp_path, **args):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from gradloc_track.integrations.hf import GradLocCallback

    seen = {}

    class SeeName(TrainerCallback):  # what MLflow's and W&B's callbacks read when they open the run
        def on_train_begin(self, args, state, control, **kwargs):
            seen["name"] = args.run_name

    samples = load_example("hf_trainer").samples(2, 1, 2, 8, -1, 2, first_step=1)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=8, n_embd=16, n_layer=1, n_head=2,
                                       bos_token_id=None, eos_token_id=None))
    targs = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_steps=2,
                              report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, seed=7, **args)
    Trainer(model=model, args=targs, train_dataset=samples,
            callbacks=[SeeName(), GradLocCallback(tracker="none", run_dir=tmp_path / "run")]).train()
    return seen["name"], targs


def test_an_unnamed_trainer_run_is_named_by_model_seed_and_time_and_given_back_unnamed(tmp_path):
    name, targs = train(tmp_path)
    assert re.fullmatch(r"gpt2 seed=7 \d\d-\d\d \d\d:\d\d:\d\d", name) and targs.run_name is None


def test_a_run_name_the_user_set_is_kept(tmp_path):
    name, targs = train(tmp_path, run_name="mine")
    assert name == "mine" and targs.run_name == "mine"
