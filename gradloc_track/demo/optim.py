"""The demo's optimizer and schedule: AdamW with decay on matrices only, warm-up then cosine."""
from __future__ import annotations

import math

import torch


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
