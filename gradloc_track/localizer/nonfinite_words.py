"""The non-finite search's findings in words (``nonfinite.NonfiniteFinding.detail``): one sentence
per finding, with its numbers, for the console block, the highlight page's notes and the report.

Pure functions of numbers and names (no torch, no probe): ``nonfinite.py`` measures, this says it,
so the sentences can be read and tested apart from the search.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from ..units import unit_label

ALL_BAD_NAMED = ("every probe is non-finite, even one that keeps no loss term: the non-finite loss terms reach "
                 "the gradient through the mask (the backward of 0 x Inf is NaN), so the samples are named by "
                 "their loss, and the others could not be searched")
ALL_BAD = ("the gradient is non-finite whatever the mask keeps, even with no loss term: a non-finite value in the "
           "forward pass (an activation overflow, a NaN input) that loss_fn's mask cannot remove")


def value(x: float | None) -> str:
    """``"Inf"``, ``"-Inf"``, ``"NaN"``, ``"0.221"``, or ``"unknown"`` for None."""
    if x is None:
        return "unknown"
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "Inf" if x > 0 else "-Inf"
    return f"{x:.4g}"


def names(items: Sequence[str], most: int = 3) -> str:
    """``"a, b, c, ..."``: the first ``most`` names."""
    return ", ".join(items[:most]) + (", ..." if len(items) > most else "")


def label(batch: int, micro_batch: int | None = None, document: int | None = None, rank: int | None = None) -> str:
    """``"micro-batch 1, sample 3"``, ``"document 2 (sample 0)"``, ``"rank 1, micro-batch 0, sample 3"``: a
    unit named as everywhere else (``units.unit_label``)."""
    return unit_label(batch, micro_batch, document, rank)


def sample_sentence(u: Any) -> str:
    """A named sample (a ``NonfiniteSample``): ``"sample 3's loss is Inf (token 17): its gradient is
    NaN"``, or ``"sample 4's gradient is NaN (token 2); its loss is 0.221"`` when its loss is finite."""
    where = ""
    if u.terms:
        shown = ", ".join(map(str, u.terms[:5])) + (f", +{len(u.terms) - 5}" if len(u.terms) > 5 else "")
        where = f" (token{'s' if len(u.terms) > 1 else ''} {shown})"
    grad = {"?": "not probed (budget)"}.get(u.grad, u.grad)
    who = label(u.batch, u.micro_batch, u.document, u.rank)
    if u.loss is None or math.isfinite(u.loss):
        return f"{who}'s gradient is {grad}{where}; its loss is {value(u.loss)}"
    return f"{who}'s loss is {value(u.loss)}{where}: its gradient is {grad}"


def forward_loss(rank: int, micro_batch: int | None, loss: float) -> str:
    """A rank whose own forward of a micro-batch gives a non-finite loss (torch.distributed)."""
    where = f"rank {rank}" + ("" if micro_batch is None else f", micro-batch {micro_batch}")
    return f"{where}: its own forward's loss is {value(loss)}, so the non-finite value enters there"


def bad_weights(tensors: Sequence[str]) -> str:
    return (f"the weights hold NaN/Inf ({names(tensors)}): every probe is non-finite whatever the mask keeps; an "
            "earlier step (or a load) broke them")


def sum_overflow(n: int, dtype: str, top: float, tensors: str, sizes: Sequence[int], alone: str = "") -> str:
    """``n`` samples each finite (the halving ended in sets of ``sizes`` whose halves are finite) add up
    past ``dtype``'s max ``top`` in ``tensors``; ``alone``: ``largest_alone``'s clause."""
    return (f"the sum overflows, not one sample: {n} samples' gradients add up past {dtype}'s max {top:.5g} in "
            f"{tensors} (the step's gradient is Inf) while none is NaN or Inf (the halving ends in sets of "
            f"{'/'.join(map(str, sizes))} samples whose halves are each finite{alone})")


def largest_alone(seen: int, who: str, norm: float, amax: float) -> str:
    return f"; the largest of {seen} probed alone: {who}, norm {norm:.3g}, largest element {amax:.3g}"


def micro_batch_sum(norms: Sequence[float], dtype: str, top: float, tensors: str) -> str:
    shown = ", ".join(f"{v:.3g}" for v in norms)
    return (f"each micro-batch's gradient is finite (norms {shown}) but their sum overflows {dtype} (max {top:.5g}) "
            f"in {tensors}: the step's gradient is Inf")


def norm_overflow(top: float, dtype: str) -> str:
    return (f"every element of the gradient is finite (the largest {top:.3g}) but its norm overflows {dtype} (a sum "
            "of squares above its max), so the step's gradient norm reads Inf; no sample's gradient is NaN or Inf")


def budget_ran_out(budget: int) -> str:
    return f"the probe budget ran out ({budget} probes) before the search ended: raise locate.budget"


def replay(tensors: Sequence[str], norm: float, precision: str | None = None) -> str:
    # under autocast the replay runs in the parameters' precision: an overflow of the training's range is the
    # first reading, not a fault (held-out tester, stop 52: the block's cause said precision, this line hardware)
    # (bfloat16 has float32's range: there the fault readings stand)
    why = (f"a value beyond {precision}'s range in the training forward, which the replay in the parameters' "
           "precision does not reach" if precision and precision.startswith("float16") else
           "a corrupted gradient, a hardware fault, or a loss_fn that is not the training loss")
    return (f"the step's .grad holds NaN/Inf ({names(tensors)}) but the replayed probes' gradient is finite (norm "
            f"{norm:.3g}): the non-finite value does not come from the batch as loss_fn replays it ({why}); the "
            "rows describe the replayed step")
