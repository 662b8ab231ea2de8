"""Lockstep probes across processes (DDP, FSDP2), and a snapshot that restores every rank.

A probe is a collective: DDP all-reduces gradients in backward and FSDP2 all-gathers parameters
in forward and reduce-scatters gradients in backward. So EVERY rank runs every probe, each with
its own share of the probed subset of loss terms; a rank that owns none of them runs the same
forward/backward with a zero mask (same graph, zero gradient), so the collectives match.
Terms are global: ``(rank, micro_batch, batch, position)``.

The gradient a probe returns is the one the optimizer would see: DDP and FSDP2 AVERAGE over the
data-parallel ranks, so a term's gradient is its own-loss gradient divided by the world size.
Norms are taken over the full gradient: sharded (DTensor) parts are summed over exactly the mesh
dims that shard them (``norms.reduce_over_shards``), so every rank computes the same numbers in
the same order and takes the same branch of the search.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from ..grouping import LayerGrouping
from ..norms import local_part, reduce_over_shards
from .probe import BudgetExhausted, Grads, Prober, restore_rng, save_rng

DistTerm = tuple[int, int, int, int]  # (rank, micro_batch, batch, position)


class DistProber(Prober):
    """The single-process ``Prober`` with global terms, K micro-batches and reduced norms."""

    def __init__(self, params: Sequence[torch.nn.Parameter], loss_fns: Sequence[Callable],
                 masks: Sequence[torch.Tensor], rng_state: dict, budget: int, grouping: LayerGrouping,
                 rank: int, group=None) -> None:
        super().__init__(params, loss_fns[0], masks[0], rng_state, budget, grouping)
        self.loss_fns, self.masks = list(loss_fns), list(masks)
        self.rank, self.group = rank, group
        self.checked = False  # the first probe agrees, across ranks, that every loss is usable

    def mask_of(self, terms: Sequence[DistTerm]) -> list[torch.Tensor]:  # type: ignore[override]
        """This rank's K masks for a global subset (zeros where it owns none of the terms)."""
        out = [torch.zeros_like(m) for m in self.masks]
        for k in range(len(self.masks)):
            mine = [(b, t) for r, kk, b, t in terms if r == self.rank and kk == k]
            if mine:
                idx = torch.as_tensor(mine, device=out[k].device)  # (n, 2)
                out[k][idx[:, 0], idx[:, 1]] = self.masks[k][idx[:, 0], idx[:, 1]]
        return out

    def probe(self, masks: Sequence[torch.Tensor], ghosts: Sequence | None = None) -> Grads:  # type: ignore[override]
        """The step's gradient for these per-micro-batch masks (every rank calls it in lockstep).

        ``ghosts``: one ``GhostMap`` per micro-batch, entered around that micro-batch's pass.
        """
        if self.count >= self.budget:  # the count is the same on every rank: all stop together
            raise BudgetExhausted
        self.count += 1
        for p in self.params:
            p.grad = None
        restore_rng(self.rng_state)
        for k, (fn, mask) in enumerate(zip(self.loss_fns, masks)):
            ghost = ghosts[k] if ghosts is not None else None
            if ghost is not None:
                ghost.__enter__()
            try:
                loss = fn(mask)
                if not self.checked:
                    self._agree_loss_is_usable(loss, k)
                loss.backward()
            finally:
                if ghost is not None:
                    ghost.__exit__(None, None, None)
        self.checked = True
        return [local_part(p.grad).detach().clone() if p.grad is not None else torch.zeros_like(local_part(p))
                for p in self.params]

    def _agree_loss_is_usable(self, loss, k: int) -> None:
        """Every rank learns whether any rank's loss cannot be back-propagated, BEFORE anyone
        enters backward's collectives: one rank raising alone would leave the others waiting."""
        bad = "" if isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.requires_grad else (
            "loss_fn(mask) must return a scalar tensor computed from the model's forward pass (one that "
            "requires grad), also for an all-zero mask")
        flags = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(flags, bad, group=self.group)
        errors = [f"rank {r}: {m}" for r, m in enumerate(flags) if m]
        if errors:
            raise ValueError(f"micro-batch {k}: " + "; ".join(errors))

    def probe_terms(self, terms: Sequence[DistTerm]) -> Grads:  # type: ignore[override]
        return self.probe(self.mask_of(terms))

    # -- full-gradient vector helpers: local parts, reduced over the ranks that shard them ------
    def sq_per_tensor(self, g: Grads) -> torch.Tensor:  # type: ignore[override]
        local = torch.stack(torch._foreach_norm(g, 2.0)).float().pow(2)
        return reduce_over_shards(local, self.params)

    def dot(self, a: Grads, b: Grads) -> float:  # type: ignore[override]
        local = torch.stack([(x.double() * y.double()).sum() for x, y in zip(a, b)])
        return float(reduce_over_shards(local, self.params).sum())


class DistSnapshot:
    """What localization touches, saved and restored on THIS rank, bitwise.

    Gradients are restored INTO the original tensor objects (DDP's ``gradient_as_bucket_view``
    grads are views of its buckets, which probes overwrite; FSDP2's grads are sharded DTensors),
    so the objects the optimizer and DDP hold stay the same. Also: buffers (DDP's broadcast
    overwrites them with rank 0's in each forward), RNG, train/eval modes, requires_grad.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = list(model.parameters())
        self.grads = [p.grad for p in self.params]
        self.saved = [None if g is None else local_part(g).detach().clone() for g in self.grads]
        self.requires_grad = [p.requires_grad for p in self.params]
        self.buffers = [(b, local_part(b).detach().clone()) for b in model.buffers()]
        self.modes = {m: m.training for m in model.modules()}
        self.rng = save_rng()

    @torch.no_grad()
    def restore(self) -> None:
        for p, g, saved, rg in zip(self.params, self.grads, self.saved, self.requires_grad):
            if g is not None:
                local_part(g).copy_(saved)
            p.grad = g
            p.requires_grad_(rg)
        for b, saved in self.buffers:
            local_part(b).copy_(saved)
        for m, training in self.modes.items():
            m.training = training
        restore_rng(self.rng)
