"""The example training loop behind ``examples/train_lm.py``: a small GPT on an offline corpus,
with the monitor, a clipper, the spike detector, the localizer and the artifact writer wired in.

Kept in the package (not in the example script) so tests can run it without a subprocess.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.nn.functional as F

from ..config import RootConfig
from .data import ByteTokenizer, TextBatches, load_corpus
from .inject import PAD_ID, inject
from .console import TrainConsole, view_commands
from .model import build_model


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mapping -> flat ``a.b.c`` keys (the form trackers show params in)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def make_tokenizer(tc, model_cfg, corpus: str):
    """The byte tokenizer, or a BPE of ``model.vocab_size`` tokens trained on (and cached for) the corpus."""
    if tc.tokenizer == "byte":
        if model_cfg.vocab_size < 256:
            raise ValueError(f"model.vocab_size={model_cfg.vocab_size} is too small for train.tokenizer=byte: use 256 or more")
        return ByteTokenizer()
    from .tokenizer import BpeTokenizer

    tok = BpeTokenizer.train_or_load(corpus, model_cfg.vocab_size, tc.cache_dir)
    if tok.vocab_size > model_cfg.vocab_size:  # pragma: no cover - BPE never exceeds its target
        raise ValueError(f"model.vocab_size={model_cfg.vocab_size} < the BPE's {tok.vocab_size} tokens")
    return tok


def make_optimizer(model: torch.nn.Module, cfg) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only (norm gains, biases and embeddings' 1-D params none).
    With ``optim.adamc`` the matrices are split into AdamC-corrected groups and embeddings/head."""
    if cfg.adamc:
        from ..adamc import adamc_param_groups

        return torch.optim.AdamW(adamc_param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=tuple(cfg.betas))
    decay = [p for _, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for _, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas))


def make_schedule(opt: torch.optim.Optimizer, cfg, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up, then cosine decay to ``lr * min_lr_ratio``."""
    def factor(s: int) -> float:
        warm = min(1.0, (s + 1) / max(1, cfg.warmup_steps))
        progress = min(1.0, s / max(1, steps))
        return warm * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


def masked_lm_loss(model, x, y, mask, loss_norm: str):
    """A ``loss_fn(keep)`` for the batch with a FIXED normalizer (computed from the full mask).

    token: sum of kept terms / number of loss tokens in the batch.
    sample: mean over samples of (sum of kept terms / that sample's loss-token count).
    """
    B, T = x.shape
    if loss_norm == "token":
        weights = mask / mask.sum().clamp(min=1.0)  # (B, T)
    else:
        weights = mask / mask.sum(dim=1, keepdim=True).clamp(min=1.0) / B  # (B, T)

    def loss_fn(keep: torch.Tensor) -> torch.Tensor:
        logits = model(x)  # (B, T, V)
        per_tok = F.cross_entropy(logits.reshape(B * T, -1), y.reshape(-1), reduction="none").view(B, T)
        return (per_tok * weights * keep).sum()

    return loss_fn


def init_distributed(device: torch.device) -> tuple[int, int, bool]:
    """(rank, world size, whether we started the group) under torchrun (``WORLD_SIZE`` > 1)."""
    import os

    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0, 1, False
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size(), started


def train_lm(cfg: RootConfig, run_dir: str | Path, resolved_yaml: str | None = None,
             console: TrainConsole | None = None) -> dict[str, float]:
    """Train, monitor and log one run. Returns a summary (final loss, spikes, spike score...).

    ``console`` shows progress, spikes and the closing summary (default: a ``TrainConsole`` on
    stderr: a progress bar on a terminal, a plain line every tenth of the run otherwise).
    """
    from .. import GradMonitor
    from ..artifacts import SpikeArtifactWriter
    from ..clip import build_clipper
    from ..spikes import SpikeDetector, spike_score
    from ..spikes.context import SpikeContext
    from ..trackers import make_tracker

    console = console or TrainConsole()
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    tc = cfg.train
    if tc.num_threads:
        torch.set_num_threads(tc.num_threads)
    torch.manual_seed(tc.seed)
    device = torch.device(tc.device)

    if tc.seq_len > cfg.model.max_seq_len:
        raise ValueError(f"train.seq_len={tc.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}: "
                         "lower train.seq_len or raise model.max_seq_len")
    corpus = load_corpus(tc.corpus)
    tokenizer = make_tokenizer(tc, cfg.model, corpus)
    rank, world, started = init_distributed(device)
    if rank != 0:  # one console: rank 0 speaks for the run (it also gathers every culprit's text)
        console = TrainConsole(stream=open(os.devnull, "w"), rich=False)
    model = build_model(cfg.model).to(device)
    net = model  # what the loss runs: DDP under torchrun (each rank its own batches)
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel

        net = DistributedDataParallel(model)
    opt = make_optimizer(model, cfg.optim)
    sched = make_schedule(opt, cfg.optim, tc.steps)
    adamc = None
    if cfg.optim.adamc:
        from ..adamc import AdamCWeightDecay

        adamc = AdamCWeightDecay.from_config(opt, cfg.optim, scheduler=sched, model=model)
    data = TextBatches(corpus, tc.seq_len, tc.batch_size, tc.seed + 7919 * rank, tokenizer)
    junk_ids = tokenizer.encode(tc.inject.text) if tc.inject.kind == "garbled_span" else None

    from ..trackers.base import NullTracker

    # one run per training run: rank 0 logs; the monitor gathers culprits from every rank to it
    tracker = make_tracker(cfg.tracker, run_dir=run_dir, run_name=cfg.run_name) if rank == 0 else NullTracker()
    status = "failed"
    try:
        params = {k: v for k, v in flatten(asdict(cfg)).items() if v is not None}  # None is noise in a params table
        params["model.n_params"] = sum(p.numel() for p in model.parameters())
        tracker.log_params(params)
        if resolved_yaml is not None:
            cfg_path = run_dir / "config.yaml"
            cfg_path.write_text(resolved_yaml)
            tracker.log_artifact(cfg_path)

        clipper = build_clipper(cfg.clip, model)
        detector = SpikeDetector(cfg.spikes) if cfg.spikes.enabled else None
        writer = SpikeArtifactWriter(tracker, run_dir=run_dir)
        monitor = GradMonitor(model, tracker=tracker, clipper=clipper, config=cfg.monitor, optimizer=opt,
                              detector=detector, locate_config=cfg.locate, artifact_writer=writer)

        losses: list[float] = []
        norms: list[float] = []
        post_norms: list[float] = []  # what the optimizer saw (after clipping)
        settled = max(cfg.spikes.warmup_steps, cfg.optim.warmup_steps)  # skip the start-up transient
        events_at: list[int] = []
        culprit_text: dict[int, list[str]] = {}
        t0 = time.perf_counter()
        console.start(tc.steps)
        for step in range(tc.steps):
            batch = data.batch(step).to(device)  # (B, T+1)
            x, y = batch[:, :-1].clone(), batch[:, 1:].clone()  # (B, T)
            mask = torch.ones_like(x, dtype=torch.float32)
            if tc.inject.at(step) and rank == tc.inject.rank % world:
                positions = inject(tc.inject.kind, x, y, mask, tc.inject.sample, tc.inject.span, seed=1234 + step,
                                   junk_ids=junk_ids, pad_id=getattr(tokenizer, "pad_id", PAD_ID))
                console.print(f"step {step}: injected {tc.inject.kind} into sample {tc.inject.sample} "
                              f"(loss positions {positions[0]}-{positions[-1]}: "
                              f"{tokenizer.decode(y[tc.inject.sample, positions].tolist())!r})")
            loss_fn = masked_lm_loss(net, x, y, mask, tc.loss_norm)
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(mask)
            loss.backward()
            ctx = SpikeContext(loss_fn=loss_fn, token_mask=mask, input_ids=y, tokenizer=tokenizer)
            stats = monitor.after_backward(step, spike_context=ctx)
            opt.step()
            sched.step()
            if adamc is not None:
                adamc.step()
            loss_val = None
            # host sync: the loss is printed/logged on logging steps only
            if stats.logged:
                loss_val = loss.item()
                losses.append(loss_val)
                norms.append(stats.global_norm)
                post_norms.append(stats.metrics.get("clip/total_norm_post", stats.global_norm))
                extra = {"train/loss": loss_val}
                if clipper is None:  # so a clip=none run overlays the clipped runs' curves
                    extra["clip/total_norm_pre"] = extra["clip/total_norm_post"] = stats.global_norm
                tracker.log_metrics(extra, step)
            console.step(step, loss_val, stats.global_norm if stats.logged else None)
            if stats.events:
                events_at.append(step)
                # the artifacts' view: under DDP rank 0 holds every culprit's sample (gathered ids)
                shown, shown_ctx = stats.locate_view or (stats.locate, None)
                ids = shown_ctx.input_ids if shown_ctx is not None and shown_ctx.input_ids is not None else y
                console.spike(step, stats.events, shown, tokenizer, ids, run_dir)
                if shown is not None:
                    culprit_text[step] = [tokenizer.decode([int(ids[c.batch, c.position])]) for c in
                                          sorted(shown.tokens, key=lambda c: (c.batch, c.position))]
        elapsed = time.perf_counter() - t0
        summary = {
            "final_loss": float(sum(losses[-10:]) / max(1, len(losses[-10:]))),
            "spike_events": float(len(events_at)),
            "loss_spike_score": float(spike_score(losses)),
            "grad_spike_score": float(spike_score(norms)),
            "post_clip_grad_spike_score": float(spike_score(post_norms)),
            "max_post_clip_grad_norm": float(max(post_norms[settled // cfg.monitor.log_every:], default=0.0)),
            "seconds": elapsed,
        }
        # at the last training step: a metric at step N+1 would stretch every chart's x axis
        tracker.log_metrics({f"summary/{k}": v for k, v in summary.items()}, tc.steps - 1)
        if rank == 0:
            (run_dir / "summary.json").write_text(json.dumps({**summary, "events_at": events_at}, indent=2))
        status = "success"
    finally:
        console.close()
        tracker.finish(status)
        if started:
            import torch.distributed as dist

            if status == "success":
                dist.barrier()  # nobody tears gloo down while a peer still talks to it
            dist.destroy_process_group()
    console.summary(summary_lines(cfg, summary, events_at, culprit_text, run_dir))
    return summary


def summary_lines(cfg: RootConfig, summary: dict[str, float], events_at: list[int],
                  culprit_text: dict[int, list[str]], run_dir: Path) -> list[str]:
    """The few lines a person reads at the end: what happened, and how to look at it."""
    lines = [f"done: {cfg.train.steps} steps in {summary['seconds']:.0f} s, final loss {summary['final_loss']:.3f}"]
    if not events_at:
        lines.append("no gradient spike detected")
    else:
        shown = ", ".join(map(str, events_at[:10])) + (" ..." if len(events_at) > 10 else "")
        lines.append(f"{len(events_at)} gradient spike(s) detected, at step {shown}")
        for step, toks in list(culprit_text.items())[:3]:
            text = "".join(toks[:16]) + ("…" if len(toks) > 16 else "")
            lines.append(f"  step {step}: {len(toks)} culprit token(s) {text!r}")
    if cfg.clip.kind != "none":
        lines.append(f"clip={cfg.clip.kind}: largest grad norm the optimizer saw after warm-up "
                     f"{summary['max_post_clip_grad_norm']:.3g}")
    lines.append(f"run dir: {run_dir}")
    lines.append("look at the results:")
    lines += view_commands(run_dir)
    return lines
