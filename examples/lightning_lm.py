"""A tiny GPT-2 in a LightningModule with gradloc-track's callback: CPU, offline.

    python examples/lightning_lm.py                       # MLFlowLogger run in ./mlflow.db
    python examples/lightning_lm.py --logger wandb        # WandbLogger (WANDB_MODE=offline works)
    python examples/lightning_lm.py --logger none         # local files under --out only

The same corrupted document as examples/hf_trainer.py lands in the second micro-batch of step
``--inject-at`` (Lightning's step numbers: its first update is step 0); the callback localizes it,
prints the spike block and writes the token table, highlighted text and layer heatmap into the
logger's run. The only gradloc-track line is the callback. The console is the script's stdout; each
run writes to a new ``runs/lightning_lm/<date>_<time>``.
"""
from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_trainer import samples  # noqa: E402  (the same data and injected document)

from gradloc_track.console import TrainConsole, closing_lines  # noqa: E402
from gradloc_track.demo.extras import need  # noqa: E402
from gradloc_track.demo.out_dir import run_dir_for  # noqa: E402
from gradloc_track.demo.threads import set_threads  # noqa: E402
from gradloc_track.trackers.quiet import quiet_backend_noise  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--inject-at", type=int, default=60, help="the step (as Lightning numbers it) of the garbage")
    ap.add_argument("--span", type=int, default=8, help="loss tokens (bytes) of the garbage document")
    ap.add_argument("--accum", type=int, default=2, help="accumulate_grad_batches")
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--logger", default="mlflow", choices=["mlflow", "wandb", "none"])
    ap.add_argument("--out", default=None, help="the run dir (default: a new runs/lightning_lm/<date>_<time>)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: half the cores, at most 4)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None):
    args = parse_args(argv)
    need("lightning", "transformers")  # pip install 'gradloc-track[examples]'
    try:
        args.out = run_dir_for(args.out, "lightning_lm")
    except ValueError as exc:
        sys.exit(f"error: {exc}")
    set_threads(args.threads)
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")  # their deprecations
    import lightning.pytorch as L
    from torch.utils.data import DataLoader
    from transformers import GPT2Config, GPT2LMHeadModel

    from gradloc_track.demo.data import ByteTokenizer
    from gradloc_track.integrations.lightning import GradLocCallback

    class CausalLM(L.LightningModule):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask=None):  # logits: what the callback re-runs on a spike
            return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

        def training_step(self, batch, batch_idx):
            loss = self.model(**batch).loss
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=args.seq, n_embd=32, n_layer=2, n_head=2,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None,
                                       eos_token_id=None))
    name = f"lightning_lm seed=0 {time.strftime('%m-%d %H:%M:%S')}"  # tells runs apart in the chart view
    if args.logger == "mlflow":
        from lightning.pytorch.loggers import MLFlowLogger

        logger = MLFlowLogger(experiment_name="gradloc-track-lightning", run_name=name,
                              tracking_uri=f"sqlite:///{Path.cwd() / 'mlflow.db'}")
    elif args.logger == "wandb":
        from lightning.pytorch.loggers import WandbLogger

        logger = WandbLogger(project="gradloc-track-lightning", name=name, save_dir=str(args.out))
    else:
        logger = False
    callback = GradLocCallback(                          # <- gradloc-track
        clip={"kind": "adagc", "warmup_steps": 10}, spikes={"warmup_steps": 20, "alpha": 0.9},
        tokenizer=ByteTokenizer(), run_dir=args.out)
    callback.console = TrainConsole(stream=sys.stdout, rich=False)  # the block goes with the summary, to stdout
    trainer = L.Trainer(max_steps=args.steps, accumulate_grad_batches=args.accum, logger=logger,
                        callbacks=[callback], accelerator="cpu", devices=1, log_every_n_steps=1,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(args.out))
    data = samples(args.steps, args.accum, args.micro, args.seq, args.inject_at, args.span)
    print(f"step {args.inject_at}: a garbage document ({args.span} bytes of mojibake) goes into sample 1 of "
          f"micro-batch {args.accum - 1}", flush=True)
    t0 = time.perf_counter()
    trainer.fit(CausalLM(model), DataLoader(data, batch_size=args.micro, shuffle=False))
    TrainConsole().summary(closing_lines(f"done: {args.steps} steps in {time.perf_counter() - t0:.0f} s",
                                         callback.handle.spikes, args.out))
    return callback

if __name__ == "__main__":
    quiet_backend_noise()  # our command: no MLflow store-creation lines or download bars
    main()
