"""Spike surgery: take the localized culprits' exact contribution out of the step's gradient.

Clipping scales the whole step and skip-step throws it away; the localizer already knows which
loss terms carry a spike, so the step can keep everything else:

    .grad  <-  .grad - s * g_c

``g_c`` is the gradient of the culprits' loss terms (every culprit row: tokens, spans, samples,
micro-batches; ``LocateResult.culprit_masks``) from ONE probe of their mask: one forward+backward
of each micro-batch that holds a culprit, replaying that micro-batch's RNG state, summed, as the
localizer's probes are. No probe at all when the search already summed exactly those terms'
gradients (``cut.CulpritCut``, passed to ``locate`` and here: the culprit tokens ``auto``
confirmed one probe each); loss terms add up, so that sum is the same gradient to float rounding.
``s`` puts it in ``.grad``'s units: the localizer's step check found
``.grad = s * (the probes' sum)`` (``StepCheck.scale``; 1 when ``loss_fn`` is the training loss,
``1/K`` when the loop divided by K and ``loss_fn`` does not). It runs on the gradient as backward
left it, before any clipper scales ``.grad`` (the monitor orders it so); when the step says what
already scaled ``.grad`` (``LocateStep.grad_scale``, a clipper's per-tensor coefficients), each
tensor's cut is scaled by it too: ``.grad_j <- .grad_j - s * c_j * g_c_j``. A gradient the probes
do not reproduce, or one rescaled per tensor by a factor nobody gave, is left alone and the result
says why. ``operate(model, step, result)`` takes the step object ``locate`` took
(``step.LocateStep``); ``remove_culprits`` its arguments one by one.

Under ``torch.distributed`` it is a collective, like ``locate``: every rank runs the same probe
through the wrapped model (the micro-batches holding any culprit, known to every rank since the
result is identical everywhere), each with a mask of its OWN culprits (zeros elsewhere), so DDP
averages the probe's gradient over ranks exactly as it averaged the step's, and every rank
subtracts the same gradient (FSDP2: its own shard of it).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..norms import local_part, reduce_over_shards, trainable_params
from ..norms import is_distributed
from .cut import CulpritCut
from .dist_probe import DistSnapshot
from .eager import eager_models
from .probe import check_loss, restore_rng
from .result import LocateResult
from .snapshot import Snapshot
from .step import LocateStep

SCALE_SNAP = 1e-6  # a scale this close to 1 is 1: loss_fn is the training loss (float64 rounding)


@dataclass
class SurgeryResult:
    """What ``remove_culprits`` did to the step's gradient (norms in ``.grad``'s units)."""

    applied: bool
    reason: str = ""  # why nothing was removed (when ``applied`` is False)
    removed_share: float = 0.0  # <s g_c, g> / ||g||^2: the share of the step's squared norm taken out
    grad_norm_pre: float = 0.0  # ||g||, the step's gradient
    grad_norm_post: float = 0.0  # ||g - s g_c||, what the clipper (or the optimizer) gets
    culprit_norm: float = 0.0  # ||s g_c||
    scale: float = 1.0  # s
    culprits: int = 0  # culprit rows removed (every level)
    probes: int = 0  # forward+backward passes: one probe (a backward per micro-batch holding a culprit), or 0
    # when the search's own sum of the culprits' probes served (``cut.CulpritCut``)
    wall_time_s: float = 0.0
    clipped_after: bool = True  # a clipper of ours gets the operated gradient (else it goes on to the step)

    def metrics(self) -> dict[str, float]:
        """``surgery/applied`` always; the share removed and the norm after surgery when applied."""
        if not self.applied:
            return {"surgery/applied": 0.0}
        return {"surgery/applied": 1.0, "surgery/removed_share": self.removed_share,
                "surgery/grad_norm_post": self.grad_norm_post}


def remove_culprits(model: torch.nn.Module, loss_fn: Callable | Sequence[Callable],
                    token_mask: torch.Tensor | Sequence[torch.Tensor], result: LocateResult, *,
                    rng_state: Any = None, document_ids: Any = None) -> SurgeryResult:
    """Subtract the culprits' gradient from ``.grad`` in place (see the module doc).

    ``loss_fn``/``token_mask``/``rng_state``/``document_ids``: exactly as given to ``locate``
    for this step (this rank's own under torch.distributed), ``result`` its result. Call it
    right after ``locate``, before the gradient is clipped or stepped on.
    """
    return operate(model, LocateStep(loss_fn, token_mask, rng_state=rng_state, document_ids=document_ids), result)


def operate(model: torch.nn.Module, step: LocateStep, result: LocateResult,
            cut: CulpritCut | None = None) -> SurgeryResult:
    """``remove_culprits`` for the step object ``locate`` took (its micro-batches, RNG states,
    documents and ``grad_scale``); ``cut``: the ``CulpritCut`` ``locate`` filled, used in place of the
    probe when it covers exactly the culprits' terms."""
    if not result.culprits:
        return SurgeryResult(False, "no culprit found at any level (token, span, sample, micro-batch)")
    if result.nonfinite is not None and result.step_check is None:  # a NaN/Inf gradient: no subtraction helps
        return SurgeryResult(False, "the step's gradient is non-finite: it is skipped, not operated on",
                             culprits=len(result.culprits))
    scale, why = units(result.step_check)
    if scale is None:
        return SurgeryResult(False, why, culprits=len(result.culprits))
    t0 = time.perf_counter()
    fns, masks, _ = step.micro_batches()
    distributed = is_distributed()
    masks_cut = result.culprit_masks(masks, step.document_ids, rank=dist.get_rank() if distributed else None)
    params = [p for _, p in trainable_params(model)]
    if any(p.grad is not None and p.grad.is_sparse for p in params):
        return SurgeryResult(False, "sparse gradients (nn.Embedding(sparse=True)) are not operated on",
                             culprits=len(result.culprits))
    coefs = step.scale_for(len(params))
    probes = 0
    if not distributed and cut is not None and cut.covers(masks_cut, result.culprits):
        g_c = cut.grads  # the search's own sum of exactly these terms' probes
    else:
        with eager_models():  # a compiled model's probe: no recompile for the cut mask (localizer/eager.py)
            g_c, probes = _probe_once(model, params, fns, masks_cut, step, result, distributed), 1
    out = _subtract(params, g_c, scale, coefs)
    out.culprits, out.wall_time_s = len(result.culprits), time.perf_counter() - t0
    out.probes = probes if out.applied else 0
    return out


def _probe_once(model: torch.nn.Module, params: list[torch.nn.Parameter], fns: list[Callable],
                masks: list[torch.Tensor], step: LocateStep, result: LocateResult,
                distributed: bool) -> list[torch.Tensor | None]:
    """``_probe`` of the culprits' masks with what it touches saved and restored."""
    snap = DistSnapshot(model) if distributed else Snapshot(model)
    try:
        with torch.enable_grad():
            return _probe(params, fns, masks, step.rng_states(len(fns), snap.rng),
                          sorted({c.micro_batch or 0 for c in result.culprits}), copy=distributed)
    finally:
        snap.restore()


def units(check: Any) -> tuple[float | None, str]:
    """(the factor from the probes' units to ``.grad``'s, '') or (None, why surgery cannot act)."""
    if check is None:
        return None, "the step left no gradient in .grad to operate on"
    if not check.replayed:
        return None, (f"the localizer's probes do not reproduce the step ({check.reason}): the culprits' gradient "
                      "is not known in the step's own terms")
    if check.scale is None:
        return None, ("the step's gradient is the probes' sum rescaled tensor by tensor (clipped before the "
                      "localizer ran?): surgery needs the gradient as backward left it")
    return (1.0 if abs(check.scale - 1.0) <= SCALE_SNAP else check.scale), ""


def _probe(params: list[torch.nn.Parameter], fns: list[Callable], masks: list[torch.Tensor], rngs: list[dict],
           ks: list[int], copy: bool) -> list[torch.Tensor | None]:
    """ONE probe of the culprits' masks: the micro-batches ``ks`` (the same on every rank), their
    gradients summed by backward itself. ``copy``: DDP's bucket-view grads share storage with the
    step's, which the snapshot writes back."""
    for p in params:
        p.grad = None
    for k in ks:
        restore_rng(rngs[k])
        loss = fns[k](masks[k])
        check_loss(loss)
        loss.backward()
    out = [None if p.grad is None else (local_part(p.grad).detach().clone() if copy else local_part(p.grad).detach())
           for p in params]
    for p in params:
        p.grad = None
    return out


def _per_tensor(coefs: torch.Tensor | float | None, n: int) -> list:
    """``grad_scale`` as one factor per tensor: None (nothing scaled ``.grad``), or 0-d tensors/numbers."""
    if isinstance(coefs, torch.Tensor) and coefs.dim() == 1:
        return list(coefs.unbind())
    return [coefs] * n


@torch.no_grad()
def _subtract(params: list[torch.nn.Parameter], g_c: list[torch.Tensor | None], scale: float,
              coefs: torch.Tensor | float | None = None) -> SurgeryResult:
    """``.grad -= scale * coef * g_c`` in place (the objects the optimizer and DDP hold), with the
    numbers the monitor logs: float64 per tensor, summed over shards, ONE host transfer.
    ``coefs``: what already scaled ``.grad`` (``LocateStep.grad_scale``; None: nothing)."""
    rows, owners = [], []
    for p, c, f in zip(params, g_c, _per_tensor(coefs, len(params))):
        if p.grad is None:  # no gradient in the step: the culprits (a subset of its terms) gave none either
            continue
        g = local_part(p.grad)
        pre = g.double().square().sum()
        dot = cut = torch.zeros((), dtype=torch.float64, device=g.device)
        if c is not None:
            if f is not None:  # the clipper's coefficient of this tensor (a device scalar: no host sync)
                c = c * (f.to(c.device, c.dtype) if isinstance(f, torch.Tensor) else f)
            c64 = c.double() * scale
            dot, cut = (c64 * g.double()).sum(), c64.square().sum()
            g.sub_(c.to(g.dtype), alpha=scale)
        rows.append(torch.stack([pre, dot, cut, g.double().square().sum()]))
        owners.append(p)
    if not rows:
        return SurgeryResult(False, "the step left no gradient in .grad to operate on")
    per = reduce_over_shards(torch.stack(rows), owners)  # (n, 4)
    pre, dot, cut, post = per.sum(0).tolist()  # host sync: once per operated spike
    return SurgeryResult(True, removed_share=dot / pre if pre > 0 else 0.0, grad_norm_pre=math.sqrt(pre),
                         grad_norm_post=math.sqrt(post), culprit_norm=math.sqrt(cut), scale=scale)
