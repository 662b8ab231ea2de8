"""Reference measurements of the zoo, written plainly (no cost limit): the update Adam is about to
make, ``g^2/v``, held-out loss, and the counterfactual step that gives each injection its harm.

The counterfactual runs on a deep copy of the model and a fresh optimizer loaded with the real
optimizer's state, so the training run (its optimizer, hooks and skip guard) is never touched.
"""
from __future__ import annotations

import copy
import inspect
import math
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from gradloc_track.grouping import layer_of


def inner_optimizer(opt):
    """The torch optimizer under a wrapper (Accelerate's ``AcceleratedOptimizer`` holds it as ``.optimizer``)."""
    while isinstance(getattr(opt, "optimizer", None), torch.optim.Optimizer):
        opt = opt.optimizer
    return opt


@torch.no_grad()
def adam_signals(model: torch.nn.Module, opt) -> dict:
    """The update an Adam(W) optimizer is about to make from the current ``.grad`` (exact, before
    weight decay), per layer and in total; max ``g^2 / v`` over elements and over tensors (``v`` the
    bias-corrected second moment before this step). Empty for other optimizers or a first step."""
    opt = inner_optimizer(opt)
    names = {p: n for n, p in model.named_parameters()}
    upd: dict[str, float] = {}
    gv_elem = gv_tensor = 0.0
    for group in opt.param_groups:
        if "betas" not in group:
            return {}
        (b1, b2), eps, lr = group["betas"], group["eps"], float(group["lr"])
        for p in group["params"]:
            if p.grad is None or p not in names:
                continue
            st = opt.state.get(p, {})
            t = int(float(st.get("step", 0))) + 1
            g = p.grad.float()
            m = st.get("exp_avg", torch.zeros_like(g)).float()
            v = st.get("exp_avg_sq", torch.zeros_like(g)).float()
            m2, v2 = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
            u = lr * (m2 / (1 - b1 ** t)) / ((v2 / (1 - b2 ** t)).sqrt() + eps)
            lay = layer_of(names[p])
            upd[lay] = upd.get(lay, 0.0) + float((u * u).sum())
            if t > 1:
                vh = v / (1 - b2 ** (t - 1))
                gv_elem = max(gv_elem, float((g * g / (vh + eps * eps)).max()))
                gv_tensor = max(gv_tensor, float((g * g).mean() / (vh.mean() + eps * eps)))
    if not upd:
        return {}
    return {"update": math.sqrt(sum(upd.values())), "update_layers": {k: math.sqrt(v) for k, v in upd.items()},
            "gv_elem": gv_elem or None, "gv_tensor": gv_tensor or None}


@torch.no_grad()
def weight_norm(model: torch.nn.Module) -> float:
    return math.sqrt(sum(float(p.detach().float().pow(2).sum()) for p in model.parameters()))


def grads_of(model: torch.nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def set_grads(model: torch.nn.Module, grads: Sequence[torch.Tensor | None]) -> None:
    for p, g in zip(model.parameters(), grads):
        p.grad = None if g is None else g.clone()


def _optimizer_copy(opt, model: torch.nn.Module, twin: torch.nn.Module, lr_factor: float):
    """A fresh optimizer of ``opt``'s class over ``twin``'s parameters, with ``opt``'s state."""
    opt = inner_optimizer(opt)
    index = {p: i for i, p in enumerate(model.parameters())}
    tparams = list(twin.parameters())
    groups = []
    for g in opt.param_groups:
        grp = {k: v for k, v in g.items() if k != "params"}
        grp["lr"] = float(grp["lr"]) * lr_factor
        grp["params"] = [tparams[index[p]] for p in g["params"]]
        groups.append(grp)
    accepted = inspect.signature(type(opt).__init__).parameters
    defaults = {k: v for k, v in opt.defaults.items() if k in accepted and k not in ("params", "lr")}
    new = type(opt)(groups, **defaults)
    for p, st in opt.state.items():
        if p in index:
            new.state[tparams[index[p]]] = {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()}
    return new


def _copy_without_hooks(model: torch.nn.Module) -> torch.nn.Module:
    """``deepcopy`` of the model with its forward hooks left behind (the library's batch capture holds
    the run's handle, which holds open files)."""
    kinds = ("_forward_pre_hooks", "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs")
    saved = {(m, k): getattr(m, k) for m in model.modules() for k in kinds if hasattr(m, k)}
    try:
        for (m, k), v in saved.items():
            setattr(m, k, type(v)())
        return copy.deepcopy(model)
    finally:
        for (m, k), v in saved.items():
            setattr(m, k, v)


def stepped(model: torch.nn.Module, opt, grads: Sequence[torch.Tensor | None], lr_factor: float = 1.0,
            clip: float | None = None) -> torch.nn.Module:
    """A copy of ``model`` after one optimizer step with ``grads`` from the current state (the run is
    not touched). ``clip``: global-norm clipping first, as the run's clipper would."""
    twin = _copy_without_hooks(model)
    for m in twin.modules():  # a forward wrapped per instance (Accelerate) would still call the original model
        m.__dict__.pop("forward", None)
    set_grads(twin, grads)
    if clip is not None:
        torch.nn.utils.clip_grad_norm_([p for p in twin.parameters() if p.grad is not None], clip)
    _optimizer_copy(opt, model, twin, lr_factor).step()
    return twin


def step_effect(model: torch.nn.Module, opt, grads: Sequence[torch.Tensor | None], heldout: Callable,
                lr_factor: float = 1.0, clip: float | None = None) -> float:
    """Held-out loss after one optimizer step with ``grads`` from the current state."""
    return heldout(stepped(model, opt, grads, lr_factor, clip))


class HeldOut:
    """Fixed held-out token rows: ``loss(model)`` is the mean next-token cross-entropy over them."""

    def __init__(self, rows: list[torch.Tensor], logits: Callable) -> None:
        self.rows, self.logits = rows, logits  # rows: (N, T+1) each; logits(model, x) -> (N, T, V)

    @torch.no_grad()
    def loss(self, model: torch.nn.Module) -> float:
        was = model.training
        model.eval()
        total = 0.0
        for b in self.rows:
            lg = self.logits(model, b[:, :-1]).float()
            total += float(F.cross_entropy(lg.flatten(0, 1), b[:, 1:].flatten()))
        model.train(was)
        return total / len(self.rows)


def flip_bit(model: torch.nn.Module, name_part: str, bit: int = 30) -> str:
    """Silent data corruption: flip one bit of the largest element of the first gradient whose name
    contains ``name_part`` (bit 30: the exponent's top bit, |g| x 2^128). Returns the tensor's name."""
    for name, p in model.named_parameters():
        if name_part in name and p.grad is not None:
            flat = p.grad.view(-1)
            i = int(flat.abs().argmax())
            as_int = flat.view(torch.int32)
            as_int[i] = as_int[i] ^ (1 << bit)
            return name
    raise ValueError(f"no gradient named like {name_part!r}")


SPAN_WIDTHS = (1, 8, 16, 32)


@torch.no_grad()
def span_maxima(per: torch.Tensor, valid: torch.Tensor, docs: torch.Tensor | None = None,
                widths: Sequence[int] = SPAN_WIDTHS) -> dict[str, float]:
    """The largest mean loss over ``w`` consecutive loss terms of one document, for each width ``w``
    (a garbled span inside an otherwise clean sample; ``w=1``: the worst single term), and (key
    ``c<w>``) the largest excess of such a span over the mean of the rest of its row: ``per`` (B, T)
    token losses, ``valid`` (B, T) bool, ``docs`` (B, T) document ids (packed rows) or None. Written
    plainly: the zoo's reference."""
    per = torch.where(valid, per.float(), 0.0)
    out = {}
    for w in widths:
        if per.shape[1] < w:
            continue
        sums = per.unfold(1, w, 1).sum(-1)  # (B, T-w+1)
        full = valid.float().unfold(1, w, 1).sum(-1) == w
        if docs is not None:
            d = docs.unfold(1, w, 1)
            full &= (d == d[..., :1]).all(-1)
        if bool(full.any()):
            out[str(w)] = float((sums / w)[full].max())
            # the span against the rest of its row: a garbled span in clean text, not a hard row
            rest_n = valid.float().sum(1, keepdim=True) - w  # (B, 1)
            rest = (per.sum(1, keepdim=True) - sums) / rest_n.clamp(min=1.0)
            ok = full & (rest_n >= w)
            if bool(ok.any()):
                out[f"c{w}"] = float((sums / w - rest)[ok].max())
    return out
