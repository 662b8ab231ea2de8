"""AdamC's corrected weight decay for an existing optimizer and LR schedule (Defazio, arXiv 2506.02285).

With decoupled weight decay, a normalized layer's steady state is ``||g||/||w|| = sqrt(2*wd/lr_t)``:
as the schedule takes ``lr_t -> 0`` gradient norms rise at the end of training, which looks like
instability but is not. AdamC scales the decay with the schedule, ``wd_t = wd * lr_t / lr_max``,
which keeps the ratio at ``sqrt(2*wd/lr_max)``.

    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    adamc = AdamCWeightDecay(opt)
    for step in ...:
        ...; opt.step(); sched.step(); adamc.step()

Only groups that have weight decay are touched (norm gains and biases usually have none).
"""
from __future__ import annotations

import torch


class AdamCWeightDecay:
    def __init__(self, optimizer: torch.optim.Optimizer, lr_max: float | None = None) -> None:
        if lr_max is not None and not lr_max > 0:
            raise ValueError(f"lr_max={lr_max!r} must be positive (None = each group's lr right now)")
        self.optimizer = optimizer
        optimizer.adamc_weight_decay = self  # GradMonitor logs adamc/steady_state_ratio for this optimizer
        # initial_lr is what torch schedulers record as the group's peak; fall back to lr
        self.base = [(g.get("weight_decay", 0.0), lr_max or g.get("initial_lr", g["lr"])) for g in optimizer.param_groups]
        self.step()

    def step(self) -> None:
        """Set every decaying group's weight_decay from its current lr."""
        for group, (wd, lr_max) in zip(self.optimizer.param_groups, self.base):
            if wd > 0:
                group["weight_decay"] = wd * group["lr"] / lr_max

    def state_dict(self) -> dict:
        return {"base": list(self.base)}

    def load_state_dict(self, state: dict) -> None:
        self.base = [tuple(b) for b in state["base"]]
        self.step()
