"""AdamC's corrected weight decay for an existing optimizer and LR schedule (Defazio, arXiv 2506.02285).

With decoupled weight decay, a normalized layer's steady state is ``||g||/||w|| = sqrt(2*wd/lr_t)``:
as the schedule takes ``lr_t -> 0`` gradient norms rise at the end of training, which looks like
instability but is not. AdamC scales the decay with the schedule, ``wd_t = wd * lr_t / lr_max``,
which keeps the ratio at ``sqrt(2*wd/lr_max)``. With AdamW (decay ``lr_t * wd_t``) a corrected
group decays by ``wd * lr_t**2 / lr_max`` per step.

    opt = torch.optim.AdamW(adamc_param_groups(model, weight_decay=0.1), lr=3e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-4, total_steps=steps)
    adamc = AdamCWeightDecay(opt, scheduler=sched)
    for step in ...:
        ...; opt.step(); sched.step(); adamc.step()

Which groups are corrected (the paper's derivation holds for layers followed by normalization):
1. groups the user marks: a param group with ``"adamc": True`` is corrected, ``False`` is not;
   once any group carries the key, unmarked groups are left alone;
2. otherwise, with ``model=``: every decayed group made only of 2-D+ weights that are neither
   embeddings nor the output head (a group mixing them is an error: split it, e.g. with
   ``adamc_param_groups``);
3. otherwise every decayed group of 2-D+ weights, with a warning that embeddings and the head
   cannot be told apart without ``model=``.
Groups without weight decay (norm gains, biases) are never touched.

``lr_max`` is the schedule's PEAK learning rate. Given explicitly it wins; else ``OneCycleLR``'s
per-group ``max_lr`` and ``CyclicLR``'s ``max_lrs`` are used (their ``initial_lr`` is the start,
``max_lr/25`` for OneCycleLR); else ``initial_lr`` (the base lr of torch schedulers whose factor
never exceeds 1: cosine, step, exponential, linear decay, LambdaLR with a factor <= 1); else the
group's current lr. If a group's lr ever exceeds its ``lr_max`` (a LambdaLR warm-up above 1, a
custom scheduler), a warning names the fix: pass ``lr_max=``.
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Iterable

import torch

# output heads by name, when the model does not say (HF models have get_output_embeddings())
_HEAD_NAMES = ("lm_head", "head", "output", "output_layer", "classifier", "embed_out")


def embedding_and_head_params(model: torch.nn.Module) -> set[int]:
    """ids of the parameters of embeddings and of the output head (tied or not)."""
    out: set[int] = set()
    for m in model.modules():
        if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)):
            out.add(id(m.weight))
    head = None
    get = getattr(model, "get_output_embeddings", None)
    if callable(get):
        try:
            head = get()
        except (NotImplementedError, AttributeError):
            head = None
    if head is None:
        for name, m in model.named_modules():
            if name.split(".")[-1] in _HEAD_NAMES and isinstance(m, torch.nn.Linear):
                head = m
    if head is not None:
        out.update(id(p) for p in head.parameters())
    return out


def adamc_param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW parameter groups marked for AdamC: corrected 2-D+ weights, decayed embeddings/head
    (not corrected), and no decay for 1-D parameters (norm gains, biases). Empty groups are dropped."""
    special = embedding_and_head_params(model)
    seen: set[int] = set()
    corrected, other, no_decay = [], [], []
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if p.dim() < 2:
            no_decay.append(p)
        elif id(p) in special:
            other.append(p)
        else:
            corrected.append(p)
    groups = [{"params": corrected, "weight_decay": weight_decay, "adamc": True},
              {"params": other, "weight_decay": weight_decay, "adamc": False},
              {"params": no_decay, "weight_decay": 0.0, "adamc": False}]
    return [g for g in groups if g["params"]]


def _peak_lrs(optimizer: torch.optim.Optimizer, scheduler: Any) -> list[float]:
    cyclic = getattr(scheduler, "max_lrs", None) if scheduler is not None else None
    out = []
    for i, g in enumerate(optimizer.param_groups):
        if "max_lr" in g:  # OneCycleLR: its initial_lr is max_lr / div_factor
            out.append(float(g["max_lr"]))
        elif cyclic is not None:  # CyclicLR: its initial_lr is base_lr, the bottom of the cycle
            out.append(float(cyclic[i]))
        else:
            out.append(float(g.get("initial_lr", g["lr"])))
    return out


class AdamCWeightDecay:
    def __init__(self, optimizer: torch.optim.Optimizer, lr_max: float | Iterable[float] | None = None,
                 scheduler: Any = None, model: torch.nn.Module | None = None) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError("AdamCWeightDecay(optimizer=...) needs a torch.optim.Optimizer, "
                            f"got {type(optimizer).__name__}")
        n = len(optimizer.param_groups)
        if lr_max is None:
            peaks = _peak_lrs(optimizer, scheduler)
        else:
            peaks = list(lr_max) if isinstance(lr_max, (list, tuple)) else [lr_max] * n
            if len(peaks) != n:
                raise ValueError(f"lr_max has {len(peaks)} values for {n} param groups: pass one number or one "
                                 "per group")
        for v in peaks:  # inf would silently turn the decay off (wd * lr / inf = 0)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
                raise ValueError(f"lr_max={v!r} is invalid: use the schedule's positive, finite peak learning rate "
                                 "(None = read it from the scheduler / the groups' initial_lr)")
        self.optimizer = optimizer
        corrected = self._select(optimizer, model)
        self.base = [(float(g.get("weight_decay", 0.0)), float(peak), bool(c))
                     for g, peak, c in zip(optimizer.param_groups, peaks, corrected)]
        self._warned = False
        optimizer.adamc_weight_decay = self  # GradMonitor logs adamc/steady_state_ratio for this optimizer
        self.step()

    @classmethod
    def from_config(cls, optimizer: torch.optim.Optimizer, optim_cfg: Any, scheduler: Any = None,
                    model: torch.nn.Module | None = None) -> "AdamCWeightDecay":
        """From the example app's ``OptimConfig`` (``optim.adamc_lr_max``) or an ``AdamCConfig`` (``adamc.lr_max``;
        its ``enabled``, like ``optim.adamc``, is the caller's switch and must be true here); None = read the peak
        from ``scheduler``."""
        if hasattr(optim_cfg, "adamc_lr_max"):
            if not getattr(optim_cfg, "adamc", True):
                raise ValueError("AdamCWeightDecay.from_config: optim.adamc is false; build AdamCWeightDecay only "
                                 "when it is true (or set optim=adamc)")
            return cls(optimizer, lr_max=optim_cfg.adamc_lr_max, scheduler=scheduler, model=model)
        if not hasattr(optim_cfg, "lr_max"):
            raise TypeError(f"AdamCWeightDecay.from_config: {type(optim_cfg).__name__} is neither an OptimConfig "
                            "(optim.adamc_lr_max) nor an AdamCConfig (adamc.lr_max)")
        if not getattr(optim_cfg, "enabled", True):
            raise ValueError("AdamCWeightDecay.from_config: adamc.enabled is false; build AdamCWeightDecay only "
                             "when it is true (or set adamc.enabled=true)")
        return cls(optimizer, lr_max=optim_cfg.lr_max, scheduler=scheduler, model=model)

    @staticmethod
    def _select(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None) -> list[bool]:
        groups = optimizer.param_groups
        decayed = [g.get("weight_decay", 0.0) > 0 for g in groups]
        if any("adamc" in g for g in groups):  # 1. the user's marks
            return [bool(g.get("adamc", False)) and d for g, d in zip(groups, decayed)]
        matrices = [all(p.dim() >= 2 for p in g["params"]) for g in groups]
        if model is None:  # 3. no way to tell embeddings and the head apart
            if any(d and m for d, m in zip(decayed, matrices)):
                warnings.warn("AdamCWeightDecay: no model= and no group marked 'adamc': correcting every decayed "
                              "group of 2-D weights, embeddings and output head included. Pass model= or build "
                              "the groups with gradloc_track.adamc.adamc_param_groups(model, weight_decay)",
                              UserWarning, stacklevel=3)
            return [d and m for d, m in zip(decayed, matrices)]
        special = embedding_and_head_params(model)  # 2. 2-D weights except embeddings and head
        out = []
        for i, (g, d, m) in enumerate(zip(groups, decayed, matrices)):
            kinds = {id(p) in special for p in g["params"]}
            if d and m and kinds == {True, False}:
                raise ValueError(f"AdamCWeightDecay: param group {i} mixes embedding/output-head weights with other "
                                 "2-D weights, and weight decay is set per group: build the groups with "
                                 "gradloc_track.adamc.adamc_param_groups(model, weight_decay), or mark each "
                                 "group with 'adamc': True/False")
            out.append(d and m and kinds == {False})
        return out

    @property
    def corrected_groups(self) -> list[int]:
        """Indices of the param groups whose weight decay follows the schedule."""
        return [i for i, (_, _, c) in enumerate(self.base) if c]

    def step(self) -> None:
        """Set every corrected group's weight_decay from its current lr (python floats: no sync)."""
        for i, (group, (wd, lr_max, corrected)) in enumerate(zip(self.optimizer.param_groups, self.base)):
            if not corrected or wd <= 0:
                continue
            lr = float(group["lr"])
            if lr > lr_max * (1 + 1e-6) and not self._warned:
                self._warned = True
                warnings.warn(f"AdamCWeightDecay: param group {i} has lr={lr:g} above lr_max={lr_max:g} "
                              "(the peak read from the scheduler): weight decay exceeds its base value; pass "
                              "lr_max=<the schedule's peak lr>", UserWarning, stacklevel=2)
            group["weight_decay"] = wd * lr / lr_max

    def state_dict(self) -> dict:
        return {"base": [list(b) for b in self.base]}

    def load_state_dict(self, state: dict) -> None:
        self.base = [(float(b[0]), float(b[1]), bool(b[2]) if len(b) > 2 else True) for b in state["base"]]
        self.step()
