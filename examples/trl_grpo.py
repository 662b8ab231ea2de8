"""GRPO with TRL's ``GRPOTrainer`` and gradloc-track's callback: CPU, offline, one stale log-prob.

    python examples/trl_grpo.py                          # TRL's MLflow run in ./mlflow.db
    python examples/trl_grpo.py --loss-type grpo         # any TRL loss_type: dapo (TRL's default), grpo, ...
    python examples/trl_grpo.py --report-to none         # local files under --out only

A tiny random-init GPT-2 (BPE tokenizer trained on the offline corpus) learns, by GRPO with a rule
reward (the share of letters and spaces in the completion: prose, not symbols), to continue
prompts taken from the corpus. ``num_iterations=2`` (each generation trains two steps, so TRL
keeps the sampling policy's log-probs). At step ``--inject-at`` one completion's old log-probs
are stale by 6 nats (a bug of the kind GradLoc was built to find): its importance ratio is ~e^6,
and since its advantage is negative PPO's clip does not bound it. The callback sees the spike,
names that completion's tokens with their advantage, ratio, log-probs and the completion's reward,
group and index, and writes the table, the highlight page (prompt and completion apart) and the
heatmap into TRL's own MLflow run, beside TRL's ``reward``, ``kl``, ``clip_ratio`` metrics;
the console block names it ``completion i of group g, reward r`` with its ratio, log-prob and old
log-prob. The only gradloc-track line is the callback. The console is the script's stdout; each run
writes to a new ``runs/trl_grpo/<date>_<time>``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

import torch

from gradloc_track.console import TrainConsole, closing_lines
from gradloc_track.demo.extras import need
from gradloc_track.demo.out_dir import run_dir_for
from gradloc_track.demo.threads import set_threads
from gradloc_track.trackers.quiet import quiet_backend_noise

STALE = 6.0  # nats: the injected completion's ratio is ~e^6 (~400)


def prose_reward(completions, **kwargs) -> list[float]:
    """Share of letters and spaces in each completion: a rule reward with spread in every group."""
    return [sum(ch.isalpha() or ch == " " for ch in c) / max(1, len(c)) for c in completions]


def prompts(n: int) -> list[str]:
    """The first words of the corpus's paragraphs that are prose."""
    from gradloc_track.demo.data import load_corpus

    out = []
    for para in load_corpus().split("\n\n"):
        words = para.split()
        if len(words) >= 8 and sum(w.isalpha() for w in words[:6]) >= 5:
            out.append(" ".join(words[:6]))
        if len(out) == n:
            break
    return out


def stale_logprob_trainer(base: type, inject_at: int, record: dict) -> type:
    """``base`` (GRPOTrainer) whose batch at step ``inject_at`` carries one stale old log-prob row."""

    class StaleLogprobGRPOTrainer(base):
        def _prepare_inputs(self, generation_batch):
            inputs = super()._prepare_inputs(generation_batch)
            # Trainer logs this update at global_step + 1 (as the callback does)
            if not self.model.training or self.state.global_step + 1 != inject_at or record:
                return inputs
            inputs = dict(inputs)  # the buffered batch is reused by the next iteration: do not edit it
            k = int(inputs["advantages"].argmin())  # a negative advantage: the clip leaves its ratio alone
            old = inputs["old_per_token_logps"].clone()
            old[k] -= STALE
            inputs["old_per_token_logps"] = old
            record.update(step=inject_at, sample=k, advantage=float(inputs["advantages"][k]),
                          tokens=inputs["completion_ids"][k][inputs["completion_mask"][k].bool()].tolist())
            return inputs

    return StaleLogprobGRPOTrainer


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--inject-at", type=int, default=30)
    ap.add_argument("--loss-type", default="dapo")
    ap.add_argument("--batch", type=int, default=16, help="per_device_train_batch_size (completions per step)")
    ap.add_argument("--generations", type=int, default=4, help="num_generations (completions per prompt)")
    ap.add_argument("--completion-len", type=int, default=12)
    ap.add_argument("--report-to", default="mlflow", choices=["mlflow", "wandb", "none"])
    ap.add_argument("--out", default=None, help="the run dir (default: a new runs/trl_grpo/<date>_<time>)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: half the cores, at most 4)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None):
    args = parse_args(argv)
    need("transformers", "trl", "datasets", "tokenizers")  # pip install 'gradloc-track[examples]'
    try:
        args.out = run_dir_for(args.out, "trl_grpo")
    except ValueError as exc:
        sys.exit(f"error: {exc}")
    set_threads(args.threads)
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")  # their deprecations
    from datasets import Dataset
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from gradloc_track.demo.data import load_corpus
    from gradloc_track.demo.tokenizer import BpeTokenizer
    from gradloc_track.integrations.trl import GradLocCallback

    bpe = BpeTokenizer.train_or_load(load_corpus(), 512)
    tok = bpe.to_transformers()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(
        vocab_size=bpe.vocab_size, n_positions=64, n_embd=64, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=tok.pad_token_id, eos_token_id=tok.pad_token_id, pad_token_id=tok.pad_token_id))
    os.environ.setdefault("MLFLOW_EXPERIMENT_NAME", "gradloc-track-trl")
    if args.report_to == "mlflow":
        os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{Path.cwd() / 'mlflow.db'}")
    callback = GradLocCallback(spikes={"warmup_steps": 15, "alpha": 0.9}, tokenizer=bpe,  # <- gradloc-track
                               run_dir=args.out)
    callback.console = TrainConsole(stream=sys.stdout, rich=False)  # the block goes with the summary, to stdout
    config = GRPOConfig(
        output_dir=str(args.out), per_device_train_batch_size=args.batch, num_generations=args.generations,
        max_completion_length=args.completion_len, num_iterations=2, loss_type=args.loss_type, max_steps=args.steps,
        learning_rate=1e-3, lr_scheduler_type="constant", logging_steps=1,
        report_to=[] if args.report_to == "none" else [args.report_to], save_strategy="no", use_cpu=True,
        disable_tqdm=True, bf16=False, seed=0,  # fp32 on CPU (TRL defaults to bf16 autocast)
        run_name=f"trl_grpo {args.loss_type} seed=0 {time.strftime('%m-%d %H:%M:%S')}")  # apart in the chart view
    injected: dict = {}
    trainer_cls = stale_logprob_trainer(GRPOTrainer, args.inject_at, injected)
    data = Dataset.from_dict({"prompt": prompts(4 * args.steps)})
    trainer = trainer_cls(model=model, reward_funcs=prose_reward, args=config, train_dataset=data,
                          processing_class=tok, callbacks=[callback])
    trainer.remove_callback(PrinterCallback)  # TRL's per-step dicts would bury the spike block
    t0 = time.perf_counter()
    trainer.train()
    if injected:
        print(f"injected: step {injected['step']}, sample {injected['sample']} (advantage "
              f"{injected['advantage']:.3f}): {bpe.decode(injected['tokens'])!r}", flush=True)
    TrainConsole().summary(closing_lines(f"done: {args.steps} steps in {time.perf_counter() - t0:.0f} s",
                                         callback.handle.spikes, args.out))
    return callback, injected

if __name__ == "__main__":
    quiet_backend_noise()  # our command: no MLflow store-creation lines or download bars
    main()
