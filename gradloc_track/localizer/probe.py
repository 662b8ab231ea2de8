"""Exact probes: one forward+backward of one micro-batch's loss restricted to a subset of its terms.

Every probe starts from the same state: gradients cleared and the RNG reset to the state saved
for that micro-batch, so dropout masks agree across probes and subset gradients add up.

``Prober`` is the only place where localization runs the model. Its interface, which wrappers
(e.g. a distributed prober that runs every probe in lockstep on all ranks) rely on:

- ``k`` micro-batches; ``masks[i]`` is micro-batch ``i``'s ``(B_i, T_i)`` loss-term mask;
- ``probe(i, mask) -> Grads``: the gradient of ``loss_fns[i](mask)``, one per trainable
  parameter (dense, zeros where no gradient); counts one probe against ``budget`` and raises
  ``BudgetExhausted`` when none is left. The returned tensors are owned by the caller (they
  are the fresh ``.grad`` buffers, not copies), so a probe costs ONE gradient-sized buffer;
- ``terms(i)``: micro-batch ``i``'s loss terms ``(b, t)`` in row-major order (computed once);
- ``mask_of(i, terms)``: micro-batch ``i``'s mask restricted to ``terms``;
- vector helpers (``norm``, ``layer_norms``, ``dot``, ``sub_``, ``add_``) that never keep
  a reference to their arguments.

``on_full[i]`` / ``on_subset[i]``: a check run once, with micro-batch ``i``'s next full-mask /
subset probe (``additivity.py``): that probe's mask is a leaf that requires grad, so its
backward also gives ``d loss / d mask`` (the value of every loss term, at the cost of one
elementwise product), and the check gets the loss, that derivative and the mask instead of
running forward passes of its own.

``reuse_forward``: a probe with no check pending replays the graph of its micro-batch's last fresh
forward instead of running one (``kept_forward.py``: exact, ~a third of a probe saved, the kept
activations added to the peak); ``forget()`` drops that graph (a ghost pass's hooks need
a forward of their own; the search's end frees it).
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from ..grouping import LayerGrouping
from ..norms import local_part
from .kept_forward import KeptForward

Grads = list[torch.Tensor]  # one tensor per trainable parameter (zeros where no gradient)
LossFn = Callable[[torch.Tensor], torch.Tensor]


class BudgetExhausted(Exception):
    pass


class Prober:
    def __init__(self, params: Sequence[torch.nn.Parameter], loss_fns: Sequence[LossFn],
                 masks: Sequence[torch.Tensor], rng_states: Sequence[dict], budget: int,
                 grouping: LayerGrouping, reuse_forward: bool = False) -> None:
        if not (len(loss_fns) == len(masks) == len(rng_states)):
            raise ValueError(f"one loss_fn, mask and RNG state per micro-batch; got {len(loss_fns)}, "
                             f"{len(masks)}, {len(rng_states)}")
        self.params = list(params)
        self.loss_fns = list(loss_fns)
        self.masks = list(masks)
        self.rng_states = list(rng_states)
        self.budget = budget
        self.grouping = grouping
        self.count = 0
        self.on_full: dict[int, Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor], None]] = {}
        self.on_subset: dict[int, Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor], None]] = {}
        self.full_losses: dict[int, float] = {}  # micro-batch -> its full-mask loss (set by the additivity check)
        self._terms: dict[int, list[tuple[int, int]]] = {}
        self.kept = KeptForward(reuse_forward)

    @property
    def k(self) -> int:
        return len(self.masks)

    def terms(self, i: int) -> list[tuple[int, int]]:
        if i not in self._terms:
            idx = (self.masks[i] != 0).nonzero()
            self._terms[i] = list(zip(idx[:, 0].tolist(), idx[:, 1].tolist()))  # host sync: once
        return self._terms[i]

    def mask_of(self, i: int, terms: Sequence[tuple[int, int]]) -> torch.Tensor:
        full = self.masks[i]
        m = torch.zeros_like(full)
        if terms:
            idx = torch.as_tensor(terms, device=m.device)  # (n, 2)
            m[idx[:, 0], idx[:, 1]] = full[idx[:, 0], idx[:, 1]]
        return m

    def probe(self, i: int, mask: torch.Tensor) -> Grads:
        """Gradient of ``loss_fns[i](mask)``; counts against the budget."""
        if self.count >= self.budget:
            raise BudgetExhausted
        self.count += 1
        for p in self.params:
            p.grad = None
        full = mask is self.masks[i]
        check = (self.on_full if full else self.on_subset).pop(i, None)
        replayed = check is None and self.kept.holds(i) and self._replay(mask)  # no check to run: the kept graph
        if not replayed:
            self.kept.forget()  # one graph alive at a time: the last one goes before this forward
            loss, leaf = self._forward(i, mask, check is not None or self.kept.enabled)
            check_loss(loss)
            if not loss.requires_grad:
                raise ValueError("loss_fn(mask) returned a loss that does not require grad: it must be computed "
                                 "from the model's forward pass inside loss_fn")
            if leaf is None:  # loss_fn cannot take a mask that requires grad: no graph to keep, ever
                self.kept.enabled = False
            loss.backward(retain_graph=self.kept.keep(i, loss, leaf, self.masks[i], full))
        out = [_dense(p.grad) if p.grad is not None else torch.zeros_like(local_part(p)) for p in self.params]
        for p in self.params:
            p.grad = None  # the caller owns the buffers now; nothing else keeps them alive
        if check is not None:
            check(loss.detach(), None if leaf is None else leaf.grad, mask)
        return out

    def forget(self) -> None:
        """Drop the kept forward's graph (``reuse_forward``): the next probe runs a forward."""
        self.kept.forget()

    def _replay(self, mask: torch.Tensor) -> bool:
        """The probe of ``mask`` from the kept graph; False (kept forwards off from here, ``.grad`` cleared)
        when its backward fails, e.g. a fused loss kernel that cannot be differentiated twice: the probe
        then runs its own forward, as without ``reuse_forward``."""
        try:
            self.kept.backward(mask)
            return True
        except RuntimeError:
            for p in self.params:
                p.grad = None
            self.kept.forget()
            self.kept.enabled = False
            return False

    def _forward(self, i: int, mask: torch.Tensor, with_terms: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The loss, and (``with_terms``) the mask as a leaf that requires grad, so backward gives
        ``d loss / d mask``; a ``loss_fn`` that cannot take such a mask (in-place ops on it) runs
        with the plain mask again."""
        restore_rng(self.rng_states[i])
        if not with_terms:
            return self.loss_fns[i](mask), None
        leaf = mask.detach().clone().requires_grad_(True)
        try:
            return self.loss_fns[i](leaf), leaf
        except RuntimeError:
            restore_rng(self.rng_states[i])
        try:  # the first call of micro-batch i's loss_fn: say what a failure most likely means
            return self.loss_fns[i](mask), None
        except Exception as exc:
            raise ValueError(f"loss_fn(mask) failed for a mask of shape {tuple(mask.shape)}: {exc!r}. token_mask "
                             "must have the shape loss_fn expects (one entry per loss term)") from exc

    def probe_terms(self, i: int, terms: Sequence[tuple[int, int]]) -> Grads:
        return self.probe(i, self.mask_of(i, terms))

    def term_losses(self, i: int) -> torch.Tensor | None:
        """Each loss term's value in micro-batch ``i``: ``d loss_fn(mask) / d mask`` times the mask
        ((B, T), float64), from one forward and a backward to the mask only (no parameter gradient);
        counts one probe. A sum loss ``sum(l * mask) / N`` gives ``l / N`` per term, an Inf/NaN
        term included (a masked-out Inf is 0 x Inf = NaN in the loss, never in this map). None when
        ``loss_fn`` gives the mask no gradient (it masks with ``torch.where`` or a boolean index)."""
        if self.count >= self.budget:
            raise BudgetExhausted
        self.count += 1
        self.kept.forget()  # one graph alive at a time: this forward keeps its own
        restore_rng(self.rng_states[i])
        mask = self.masks[i].detach().clone().requires_grad_(True)
        loss = self.loss_fns[i](mask)
        check_loss(loss)
        if not loss.requires_grad:
            return None
        (g,) = torch.autograd.grad(loss, [mask], allow_unused=True)
        if g is None:
            return None
        full = self.masks[i].double()
        return torch.where(full != 0, g.detach().double() * full, torch.zeros_like(full))  # outside the mask: 0

    # -- vector helpers ----------------------------------------------------------------
    @staticmethod
    def sq_per_tensor(g: Grads) -> torch.Tensor:
        """Float64 squared norm per tensor (low-precision gradients are upcast tensor by tensor)."""
        wide = (torch.float32, torch.float64)
        norms = torch._foreach_norm(g, 2.0)
        if all(t.dtype in wide for t in g):
            return torch.stack(norms).double().pow(2)
        return torch.stack([(n if t.dtype in wide else t.float().norm()).double() for t, n in zip(g, norms)]).pow(2)

    def norm(self, g: Grads) -> float:
        return math.sqrt(float(self.sq_per_tensor(g).sum()))  # host sync

    def summary(self, g: Grads, other: Grads) -> tuple[float, dict[str, float], float]:
        """(``norm(g)``, ``layer_norms(g)``, ``dot(g, other)``) with one pass over ``g`` and one
        host transfer: what a found culprit is summarised by."""
        # a wrapper's own inner product (sharded parts): its methods. (A classmethod is bound anew on
        # every access: compare the functions, or every prober takes this path.)
        if getattr(type(self).dot, "__func__", None) is not Prober.dot.__func__:
            return self.norm(g), self.layer_norms(g), self.dot(g, other)
        sq = self.sq_per_tensor(g)
        parts = [sq.sum()[None], self.grouping.sum_by_layer(sq).sqrt(), self._dots(g, other).sum()[None]]
        vals = torch.cat(parts).tolist()  # host sync: once per culprit found
        return math.sqrt(vals[0]), dict(zip(self.grouping.layers, vals[1:-1])), vals[-1]

    def layer_norms(self, g: Grads) -> dict[str, float]:
        vals = self.grouping.sum_by_layer(self.sq_per_tensor(g)).sqrt().tolist()  # host sync
        return dict(zip(self.grouping.layers, vals))

    @classmethod
    def dot(cls, a: Grads, b: Grads) -> float:
        """Inner product, one tensor at a time, summed in float64; float32/float64 pairs need no
        temporary copy (lower precisions are upcast one tensor at a time)."""
        return float(cls._dots(a, b).sum())  # host sync: once per dot, only on a spike

    @staticmethod
    def _dots(a: Grads, b: Grads) -> torch.Tensor:
        """Per-tensor inner products, float64, on the device."""
        wide = (torch.float32, torch.float64)
        parts = []
        for x, y in zip(a, b):
            if x.dtype == y.dtype and x.dtype in wide:
                parts.append(torch.dot(x.reshape(-1), y.reshape(-1)).double())
            else:
                parts.append(torch.dot(x.reshape(-1).float(), y.reshape(-1).float()).double())
        return torch.stack(parts) if parts else torch.zeros(1, dtype=torch.float64)

    @staticmethod
    def sub_(a: Grads, b: Grads) -> Grads:
        """``a -= b`` in place (no new gradient-sized buffer); returns ``a``."""
        torch._foreach_sub_(a, b)
        return a

    @staticmethod
    def add_(a: Grads, b: Grads) -> Grads:
        torch._foreach_add_(a, b)
        return a


def _dense(g: torch.Tensor) -> torch.Tensor:
    """Sparse gradients (``nn.Embedding(sparse=True)``) become dense: norms and sums need it. A
    DTensor (FSDP2 on one process: a 1-rank mesh) gives its local tensor, which is all of it."""
    g = local_part(g.detach())
    return g.to_dense() if g.is_sparse else g


def check_loss(loss) -> None:
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"loss_fn(mask) returned {type(loss).__name__}; it must return a scalar torch.Tensor "
                        "computed from the model (do not call .item() or float() on it)")
    if loss.dim() != 0:
        raise TypeError(f"loss_fn(mask) returned a tensor of shape {tuple(loss.shape)}; it must return a scalar: "
                        "reduce with (per_token_loss * mask).sum() / n_tokens_in_batch")


def save_rng() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
