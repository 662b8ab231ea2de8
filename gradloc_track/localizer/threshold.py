"""Thresholds the culprits cannot hide behind: a statistic of the ORDINARY values only.

``factor`` x the 90th percentile of a batch's term scores (the rule since 0.1) is set by the
culprits themselves once they are more than 10% of the terms: 32 heavy terms among 256 put the
percentile on a culprit and nothing is above 10x of it. ``outlier_split`` asks instead which
values are outliers of the REST: sorted largest first, ``k`` top values are outliers when the
``k``-th is above ``factor`` x the ``quantile`` of the values below it and the ``k+1``-th is not
(a gap). The smallest such ``k >= 1`` (for terms at most a quarter of them) wins, else ``k = 0``
(the old rule). With a few outliers this is the old rule's split; with many it is the rule applied
to the ordinary values alone. A smooth heavy tail has no such gap, so it flags what the old rule
flagged; the smallest gap is taken so that the ordinary values' own tail, in a small and
heavy-tailed batch (RL terms), is not cut off below the outliers.
"""
from __future__ import annotations

import math

import torch


def outlier_split(values: torch.Tensor, factor: float, quantile: float, most: float = 0.25) -> tuple[int, float]:
    """``(k, threshold)``: the ``k`` largest values are above ``threshold`` = ``factor`` x the
    ``quantile`` of the others (linear interpolation, as ``torch.quantile``); ``k`` is at most
    ``most`` of the values. ``values`` > 0."""
    desc = values.double().sort(descending=True).values  # (N,)
    n = desc.numel()
    if n == 0:
        return 0, math.inf
    asc = desc.flip(0)
    ks = torch.arange(0, int(n * most) + 1)  # candidate numbers of outliers
    rest = n - ks  # ordinary values left for each k (the lowest ``rest`` values)
    pos = quantile * (rest - 1).double()
    lo = pos.floor().long()
    hi = torch.minimum(lo + 1, rest - 1)
    q = asc[lo] + (asc[hi] - asc[lo]) * (pos - lo.double())  # quantile of the lowest ``rest`` values
    limit = factor * q  # (n // 2 + 1,)
    above = torch.ones_like(ks, dtype=torch.bool)
    above[1:] = desc[ks[1:] - 1] > limit[1:]  # the k-th largest is an outlier of the rest
    below = desc[torch.clamp(ks, max=n - 1)] <= limit  # ...and the (k+1)-th is not
    below[ks >= n] = True
    ok = (above & below)[1:].nonzero().flatten() + 1  # gaps below the k-th value, k >= 1
    k = int(ok.min()) if ok.numel() else 0  # host sync: only on a spike
    return k, float(limit[k])


def adaptive_threshold(scores: torch.Tensor, factor: float = 10.0, quantile: float = 0.9) -> float:
    """Per-term threshold: ``factor`` x the 90th percentile of the ORDINARY terms' scores.

    A culprit is a term an order of magnitude above what 90% of the ordinary terms stay under.
    Zero scores are left out (terms with no gradient, e.g. RL groups with equal rewards).
    Percentiles, unlike a mean/std or a log-space MAD, stay put when many terms carry ~zero
    gradient and when a few carry huge ones; the split (``outlier_split``) keeps the culprits
    out of the percentile, so up to a quarter of the terms may be culprits.
    """
    s = scores[scores > 0].double()
    if s.numel() == 0:
        return math.inf
    return outlier_split(s, factor, quantile)[1]
