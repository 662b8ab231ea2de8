"""GradLoc's own search, faithful to the official code (``method="gradloc"``).

Tencent Hunyuan, "Stabilizing RLVR via Token-level Gradient Diagnosis and Layerwise Clipping"
(2026); official code ``Tencent-Hunyuan/GradLoc`` ``patches/gradloc.patch`` (on verl). Rules,
in our sum convention (``loss_fn(mask)`` with a fixed normalizer, so a range's gradient is the
sum of its terms' gradients) with ``T`` the per-token threshold:

1. Micro-batch stage: every micro-batch is probed once with its full mask; micro-batch ``i``
   (``n_i`` terms of the step's ``N``, ``K`` micro-batches) is a candidate when
   ``||g_i|| / n_i > T * sqrt(K / N)`` (``||g_i|| > T * sqrt(n_i)`` for equal micro-batches), and
   the candidate with the largest ``||g_i|| / n_i`` is kept (ties: the first). None: no search.
2. Token stage, depth-first over the kept micro-batch's terms ``0..n-1`` (row-major mask order):
   a range ``[l, r]`` splits at ``mid = (l + r) // 2`` into ``[l, mid]`` and ``[mid + 1, r]`` (the
   left half takes the extra term of an odd range), each probed (2 probes per split). A half of
   ``s`` terms is kept when ``||g|| > T * sqrt(s)`` (pruned at the threshold itself); a kept
   single-term half is a hit; kept longer halves are pushed larger-last, so the larger is
   visited first, "larger" by ``||g|| / s`` (the official probes compare token-mean norms).
   The loop runs while at least 2 probes remain of ``budget`` (the micro-batch stage's probes
   are not counted, as in the official code).

The official probes hand the range's mask to verl's token-mean loss, which divides by the
range's own token count; ``T / sqrt(s)`` on that mean is the same test as ``T * sqrt(s)`` on
the sum. Converting the official knob: for a verl token-mean loss with ``K`` micro-batches and
a ``loss_fn`` normalised by ``n_norm`` tokens, ``threshold = T_official * K / n_norm``. The
rank stage and the ``/ world_size`` of the token threshold belong to distributed runs.
"""
from __future__ import annotations

import math

from .probe import BudgetExhausted, Grads, Prober
from .search import Hits


def micro_batch_stage(prober: Prober, terms: list[list], tau: float) -> tuple[Grads, list[float], int]:
    """(the step's total gradient, each micro-batch's norm, the kept micro-batch or -1)."""
    n_total = sum(len(t) for t in terms)
    k = prober.k
    total, norms, target, best = None, [], -1, 0.0
    for i in range(k):
        if not terms[i]:  # no loss terms: an additive loss gives it no gradient (no probe)
            norms.append(0.0)
            continue
        g = prober.probe(i, prober.masks[i])
        v = prober.norm(g)
        norms.append(v)
        total = g if total is None else prober.add_(total, g)
        del g
        mean = v / len(terms[i])  # the official value: the norm of the micro-batch's token-mean gradient
        if mean > tau * math.sqrt(k / n_total) and mean > best:
            best, target = mean, i
    return total, norms, target


def token_stage(prober: Prober, i: int, terms: list[tuple[int, int]], tau: float, budget: int,
                hits: Hits) -> bool:
    """GradLoc's bisection inside micro-batch ``i``; True when it stopped on the budget."""
    stack = [(0, len(terms) - 1)]
    used = 0
    while used + 2 <= budget:
        if not stack:
            return False
        left, right = stack.pop()
        mid = (left + right) // 2
        segments = []
        for lo, hi in ((left, mid), (mid + 1, right)):
            try:
                g = prober.probe_terms(i, terms[lo: hi + 1])
            except BudgetExhausted:  # only when a wrapper gave the prober a smaller budget
                return True
            n = prober.norm(g)
            keep = n > tau * math.sqrt(max(1, hi - lo + 1))
            if keep and lo == hi:
                hits.add(i, terms[lo], g, n)  # summarised now: the gradient is not kept
            del g
            segments.append((n / max(1, hi - lo + 1), lo, hi, keep))
        used += 2
        # larger pushed last = visited first; "larger" is the official probe value, the norm of
        # the range's token-MEAN gradient (sum norm / size), not of its sum
        for _, lo, hi, keep in sorted(segments, key=lambda s: s[0]):
            if keep and lo < hi:
                stack.append((lo, hi))
    return bool(stack)
