"""One forward per micro-batch (``locate(reuse_forward=True)``): its later probes are backward
passes of the graph the first one kept.

Why it is exact: once ``additivity.py`` has checked the loss, ``loss_fn(m) = sum_t m_t v_t(theta)``,
and every probe of a micro-batch replays the same RNG state, so the forward is the same whatever
``m`` keeps; only the backward differs. The kept forward gives ``v = d loss / d mask`` WITH its
graph (one differentiation of the loss's last elementwise ops, ``create_graph``), and a probe of
``m`` is ``(v * m).sum().backward()``: the same backward through the model as
``loss_fn(m).backward()``, seeded with ``m`` times the loss's own factors, without the forward
(about a third of a probe on a transformer).

Kept only where a fresh forward would give the same values (else every probe runs its own
forward, as without it):

- one process (DDP and FSDP2 tie their collectives to each forward);
- ``loss_fn`` takes a mask that requires grad, and ``v`` depends on the model;
- the values are finite, and a forward at a SUBSET mask gives every term the value the full mask
  gave (a mask that reaches the model does not): a micro-batch's first subset probe always runs its
  own forward to show it, whether or not the additivity check runs on that probe.

What it costs: the kept graph's saved activations stay alive while each probe's backward runs, so
that backward's temporaries (the logits' gradient, attention's) and the probe's gradient come on top
of them, where a plain probe frees activations as its backward goes: 3.2-5.1 gradient sizes of
peak extra memory on ``bench_locate``'s model (rows of 256-512 terms, activations ~25 gradient
sizes) against 0.06-1.09 without. One graph is alive at a time (the last goes before any fresh
forward). So it is off by default: on a GPU, memory is what a spike must not run out of; the CPU
demo turns it on.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

SAME = 1e-6  # a subset forward's values may differ from the full mask's by this much (relative norm)


class KeptForward:
    """The graph of the last fresh forward of one micro-batch, while it may serve its probes."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and not (dist.is_available() and dist.is_initialized())
        self.micro_batch: int | None = None
        self.values: torch.Tensor | None = None  # (B, T) d loss / d mask, with its graph
        self.full: dict[int, torch.Tensor] = {}  # micro-batch -> the full mask's values (no graph)
        self.verified: set[int] = set()  # micro-batches whose subset forward gave the full mask's values

    def holds(self, i: int) -> bool:
        """Does the kept graph serve micro-batch ``i``'s probes? Only once a subset forward of ``i`` has given
        the full mask's values: exactness never rests on a check the search may not have armed."""
        return self.values is not None and self.micro_batch == i and i in self.verified

    def keep(self, i: int, loss: torch.Tensor, leaf: torch.Tensor | None, full_mask: torch.Tensor,
             is_full: bool) -> bool:
        """After a fresh forward of micro-batch ``i`` at the mask ``leaf``: keep its graph when it is
        exact (module doc). Call before the probe's own backward, which must then retain the graph
        (returns whether it was kept)."""
        self.forget()
        if not self.enabled or leaf is None or not loss.requires_grad:
            return False
        (v,) = torch.autograd.grad(loss, leaf, create_graph=True, retain_graph=True, allow_unused=True)
        if v is None or not v.requires_grad:
            return False
        d, on = v.detach(), full_mask != 0
        if is_full:
            ok = bool(torch.isfinite(d[on]).all())  # host sync: once per fresh forward, on a spike
            if ok:
                self.full[i] = d
        else:
            ref = self.full.get(i)
            ok = ref is not None and bool(torch.isfinite(d[on]).all() & (  # host sync: as above
                (d - ref)[on].norm() <= SAME * ref[on].norm()))
            if ok:
                self.verified.add(i)
        if ok:
            self.micro_batch, self.values = i, v
        return ok

    def backward(self, mask: torch.Tensor) -> None:
        """The probe of ``mask``: its gradient accumulates in ``.grad``, as ``loss_fn(mask).backward()``'s."""
        (self.values * mask).sum().backward(retain_graph=True)

    def forget(self) -> None:
        """Drop the kept graph (its activations go with it)."""
        self.micro_batch = self.values = None
