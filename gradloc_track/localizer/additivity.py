"""Subset probes mean something only when the loss is a SUM over the kept terms with a fixed
normaliser: this checks it once per micro-batch, forward only, before any probe."""
from __future__ import annotations

import math

import torch

from .probe import Prober, check_loss, restore_rng

FIX = ("multiply each per-term loss by mask before reducing, with a FIXED normalizer, e.g. "
       "(per_token_loss * mask).sum() / n_tokens_in_batch, where n_tokens_in_batch is computed from the "
       "full batch, never from mask")


def check_additive(prober: Prober, i: int, terms: list, rng: dict) -> None:
    """One forward-only comparison: ``loss(all) == loss(first half) + loss(second half)``.

    A mean over the kept terms (``/ mask.sum()``) or a term that ignores the mask breaks
    additivity, and the search would report nonsense.
    """
    vals = _three_losses(prober, i, terms, rng)
    full, a, b = (float(v.detach().double()) for v in vals)  # host sync: once per micro-batch
    where = "" if prober.k == 1 else f" (micro-batch {i})"
    if full != 0 and a == full and b == full:
        raise ValueError(f"loss_fn(mask) does not depend on the mask{where} (same loss with half the terms "
                         f"dropped): {FIX}")
    tol = 2e-2 if vals[0].dtype in (torch.float16, torch.bfloat16) else 1e-3
    if math.isfinite(full) and abs(full - (a + b)) <= tol * max(abs(full), abs(a) + abs(b)) + 1e-12:
        return
    if not (math.isfinite(full) and math.isfinite(a) and math.isfinite(b)):
        return  # non-finite losses are reported once the step's gradient is known
    raise ValueError(f"loss_fn(mask) is not additive over the mask{where}: loss(all terms)={full:.6g} but "
                     f"loss(first half)+loss(second half)={a + b:.6g}. A mean over the kept terms "
                     f"(dividing by mask.sum()) or a term that ignores the mask does this; {FIX}")


def _three_losses(prober: Prober, i: int, terms: list, rng: dict) -> list[torch.Tensor]:
    """The loss with all terms, the first half and the second half, under one RNG state."""
    mask, fn = prober.masks[i], prober.loss_fns[i]
    half = len(terms) // 2
    with torch.no_grad():
        try:
            vals = []
            for m in (mask, prober.mask_of(i, terms[:half]), prober.mask_of(i, terms[half:])):
                restore_rng(rng)  # same dropout masks for all three, so only the mask differs
                vals.append(fn(m))
        except Exception as exc:
            raise ValueError(f"loss_fn(mask) failed for a mask of shape {tuple(mask.shape)}: {exc!r}. "
                             "token_mask must have the shape loss_fn expects (one entry per loss term)") from exc
    for v in vals:
        check_loss(v)
    return vals
