"""The answer at the level the cause lives: samples (rows, or packed documents), spans, micro-batches.

Top-down, after the micro-batch stage, whose ghost passes gave every sample's exact gradient
norm over the hooked layers at no extra backward (``segments.py``):

1. candidate samples: a sample's per-term intensity ``||g_s|| / sqrt(n_s)`` is an outlier of
   the other samples' (``outlier_split``: above ``SAMPLE_FACTOR`` x their median; at most half
   the samples can be candidates) and its squared norm above ``MIN_PART`` of a fair part (1/n);
2. a candidate whose terms above the token threshold hold ``CARRY`` of its ghost mass and are a
   few (at most ``FEW`` of its terms, or ``FEW_MIN``), or whose mass sits in one term, is left to
   the token search: its tokens are culprits themselves, the finer answer; no probe is spent on
   the sample. A document whose terms are each below the threshold is a culprit SAMPLE;
3. any other candidate is probed (1 probe: its terms' mask) and confirmed when its exact
   intensity is still above the limit and it carries that part of the step's squared norm.
   The shortest contiguous window holding ``SPAN_MASS`` of its ghost mass (grown over equally
   hot neighbours), if at most ``SPAN_MAX`` of its terms, is probed too (1 probe) and reported
   as a SPAN when it carries ``SPAN_SHARE`` of the sample's share; else the SAMPLE is reported.
   Either way the sample's terms leave the token search (its gradient leaves the remainder);
4. after the token search, a micro-batch whose intensity is an outlier of the others', that
   carries that part (of 1/K) of the step's squared norm and holds no culprit is reported as a
   MICRO-BATCH (1 probe, for its share);
5. nothing found at any level: each sample's exact share (1 probe each, largest ghost norm
   first, at most ``MAX_SHARE_PROBES`` and what the budget leaves) goes to ``sample_shares``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from .probe import BudgetExhausted, Grads, Prober
from .result import Culprit
from .search import Hits
from .segments import Segment, Segments
from .threshold import outlier_split

SAMPLE_FACTOR = 4.0  # a sample's per-term gradient this many times the other samples' median
FEW, FEW_MIN, CARRY = 0.25, 8, 0.5  # tokens carry a sample: a quarter of its terms (or 8), half its mass
SPAN_MASS, SPAN_MAX, SPAN_SHARE = 0.8, 0.5, 0.6
MIN_PART = 0.1  # a culprit sample (micro-batch) carries at least a tenth of a fair part (1/n) of the step
MAX_SHARE_PROBES = 32
Key = tuple[int, int, int]  # (micro_batch, b, t)


@dataclass
class Units:
    """Samples and spans reported, the terms they take out of the token search, and the sum of
    their samples' gradients (one buffer)."""

    culprits: list[Culprit] = field(default_factory=list)
    excluded: set[Key] = field(default_factory=set)
    grad: Grads | None = None
    exhausted: bool = False


def candidates(segments: list[Segments | None]) -> tuple[list[tuple[Segment, float]], float, int]:
    """(candidate samples with their ghost norm, strongest first; the intensity limit; the number
    of samples with loss terms)."""
    rows = []
    for segs in segments:
        norms = segs.norms() if segs is not None else None
        if norms is not None:
            rows += [(s, n, len(s.terms)) for s, n in zip(segs.items, norms) if s.terms]
    picked, limit = outliers(rows)
    return [(s, n) for s, n, _ in picked], limit, len(rows)


def outliers(rows: list[tuple[Any, float, int]]) -> tuple[list[tuple[Any, float, int]], float]:
    """``rows`` of (sample, ghost norm, loss terms) whose intensity ``norm / sqrt(terms)`` is an
    outlier of the others' and whose squared norm is more than ``MIN_PART`` of a fair part (1/n)
    of the samples' (strongest first), and the intensity limit. Shared with the distributed
    localizer, whose rows are every rank's samples. The part keeps out samples that stand out
    only because most others carry ~no gradient (RL groups whose rewards are all equal)."""
    rows = [r for r in rows if r[2] > 0]
    if len(rows) < 2:
        return [], math.inf
    rows.sort(key=lambda r: -r[1] / math.sqrt(r[2]))
    k, limit = outlier_split(torch.tensor([n / math.sqrt(m) for _, n, m in rows]), SAMPLE_FACTOR, 0.5, most=0.5)
    part = MIN_PART * sum(n * n for _, n, _ in rows) / len(rows)
    return [r for r in rows[:k] if r[1] ** 2 > part], limit


def ordinary(term_score: dict, inside: set) -> dict:
    """The terms a token threshold is taken from: all but ``inside`` (the terms of candidate
    samples) when those are a minority, so a bad document's many terms do not set it."""
    if not inside or 2 * len(inside) >= len(term_score):
        return term_score
    return {k: v for k, v in term_score.items() if k not in inside}


def carried_by_tokens(seg: Segment, scores: dict[Key, float], tau: float) -> bool:
    """The sample's terms above the token threshold hold ``CARRY`` of its ghost mass and are a
    few (at most ``FEW`` of its terms, or ``FEW_MIN``): then they are culprits themselves."""
    vals = [scores.get((seg.micro_batch, b, t), 0.0) for b, t in seg.terms]
    above = [v for v in vals if v > tau]
    return 0 < len(above) <= max(FEW_MIN, FEW * len(vals)) and \
        sum(v * v for v in above) >= CARRY * sum(v * v for v in vals)


def find_units(prober: Prober, hits: Hits, cands: list[tuple[Segment, float]], limit: float,
               scores: dict[Key, float], tau: float, labelled: bool, n_samples: int = 1) -> Units:
    """Steps 2-3 of the module doc, strongest candidate first; a sample must also carry more than
    ``MIN_PART`` of a fair part (``1 / n_samples``) of the step's squared gradient norm."""
    units = Units()
    for seg, ghost in cands:
        window = _window(seg, scores)
        if carried_by_tokens(seg, scores, tau) or (window is not None and len(window) == 1):
            continue  # one term is a token: the token search names it
        try:
            unit, g = _confirm(prober, hits, seg, ghost, (limit, MIN_PART * hits.total_sq / max(1, n_samples)),
                               window, labelled)
        except BudgetExhausted:
            units.exhausted = True
            break
        if unit is None:
            continue
        units.culprits.append(unit)
        units.excluded |= {(seg.micro_batch, b, t) for b, t in seg.terms}
        units.grad = g if units.grad is None else prober.add_(units.grad, g)
        del g
    return units


def _confirm(prober: Prober, hits: Hits, seg: Segment, ghost: float, limits: tuple[float, float],
             window: list[tuple[int, int]] | None, labelled: bool) -> tuple[Culprit | None, Grads | None]:
    i = seg.micro_batch
    g = prober.probe_terms(i, seg.terms)
    n = prober.norm(g)
    if n / math.sqrt(len(seg.terms)) <= limits[0] or n * n <= limits[1]:
        return None, None
    share = hits.share(g)
    where = {"micro_batch": i if labelled else None, "batch": seg.batch, "document": seg.document}
    unit = Culprit("sample", n, share, start=seg.start, end=seg.end, n_terms=len(seg.terms),
                   layer_norms=prober.layer_norms(g), score=ghost, **where)
    if window is not None and share is not None and share > 0:
        try:
            g_w = prober.probe_terms(i, window)
        except BudgetExhausted:  # the sample stands: a span would only have been finer
            return unit, g
        share_w = hits.share(g_w)
        if share_w is not None and share_w >= SPAN_SHARE * share:
            unit = Culprit("span", prober.norm(g_w), share_w, start=window[0][1], end=window[-1][1] + 1,
                           n_terms=len(window), layer_norms=prober.layer_norms(g_w), **where)
        del g_w
    return unit, g


def _window(seg: Segment, scores: dict[Key, float]) -> list[tuple[int, int]] | None:
    """The shortest run of the sample's terms (in position order) holding ``SPAN_MASS`` of its
    ghost mass, grown over neighbours as hot as a quarter of its median term; when that is at
    most ``SPAN_MAX`` of the sample's terms, else None."""
    terms = sorted(seg.terms, key=lambda bt: bt[1])
    s = [scores.get((seg.micro_batch, b, t), 0.0) for b, t in terms]
    w = [v * v for v in s]
    need = SPAN_MASS * sum(w)
    if need <= 0:
        return None
    best, lo, acc = (0, len(w)), 0, 0.0
    for hi, v in enumerate(w):  # two pointers: for each end, the latest start still holding enough
        acc += v
        while acc - w[lo] >= need:
            acc -= w[lo]
            lo += 1
        if acc >= need and hi + 1 - lo < best[1] - best[0]:
            best = (lo, hi + 1)
    a, b = best
    hot = 0.25 * sorted(s[a:b])[(b - a) // 2]
    while a > 0 and s[a - 1] >= hot:
        a -= 1
    while b < len(s) and s[b] >= hot:
        b += 1
    return terms[a:b] if b - a <= SPAN_MAX * len(terms) else None


def micro_batch_units(prober: Prober, hits: Hits, norms: list[float], terms: list[list], holding: set,
                      labelled: bool) -> list[Culprit]:
    """Step 4: outlier micro-batches that hold no culprit (a probe each, for the share)."""
    idx = [i for i in range(prober.k) if terms[i]]
    if len(idx) < 2:
        return []
    vals = [norms[i] / math.sqrt(len(terms[i])) for i in idx]
    k, _ = outlier_split(torch.tensor(vals), SAMPLE_FACTOR, 0.5, most=0.5)
    out = []
    for i in sorted(idx, key=lambda j: -vals[idx.index(j)])[:k]:
        if i in holding or norms[i] ** 2 <= MIN_PART * hits.total_sq / len(idx):  # a part of the step
            continue
        try:
            g = prober.probe(i, prober.masks[i])
        except BudgetExhausted:
            break
        out.append(Culprit("micro_batch", prober.norm(g), hits.share(g), micro_batch=i if labelled else None,
                           n_terms=len(terms[i]), layer_norms=prober.layer_norms(g)))
        del g
    return out


def sample_shares(prober: Prober, hits: Hits, segments: list[Segments | None],
                  labelled: bool) -> list[dict[str, Any]]:
    """Step 5: exact per-sample shares, largest ghost norm first, as far as the budget allows."""
    rows = []
    for i, segs in enumerate(segments):
        segs = segs if segs is not None else Segments(i, prober.masks[i])
        norms = segs.norms() or [0.0] * len(segs)
        rows += [(n, s) for n, s in zip(norms, segs.items) if s.terms]
    rows.sort(key=lambda r: -r[0])
    out = []
    for _, seg in rows[:MAX_SHARE_PROBES]:
        try:
            g = prober.probe_terms(seg.micro_batch, seg.terms)
        except BudgetExhausted:
            break
        out.append({"micro_batch": seg.micro_batch if labelled else None, "sample": seg.batch,
                    "document": seg.document, "share": hits.share(g), "grad_norm": prober.norm(g)})
        del g
    return sorted(out, key=lambda r: -(r["share"] or 0.0))


def no_culprit_note(shares: list[dict[str, Any]], n_samples: int) -> str:
    top = ", ".join(f"{_where(r)} {r['share']:.2f}" for r in shares[:5] if r["share"] is not None)
    probed = "" if len(shares) >= n_samples else f" ({len(shares)} of {n_samples} samples probed)"
    return ("no sample, span or token carries the spike: no sample's gradient per term stands out of the others' "
            f"({SAMPLE_FACTOR:g}x their median) and no term is above the threshold; the largest per-sample shares "
            f"of the step's squared gradient norm{probed}: {top or 'n/a'}")


def _where(r: dict[str, Any]) -> str:
    mb = "" if r["micro_batch"] is None else f"micro-batch {r['micro_batch']} "
    doc = "" if r["document"] is None else f" document {r['document']}"
    return f"{mb}sample {r['sample']}{doc}"
