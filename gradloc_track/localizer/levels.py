"""The answer at the level the cause lives: samples (rows, or packed documents), spans, micro-batches.

Top-down, after the micro-batch stage, whose ghost passes gave every sample's exact gradient
norm over the hooked layers at no extra backward (``segments.py``):

1. candidate samples: a sample's per-term intensity ``||g_s|| / sqrt(n_s)`` is an outlier of
   the other samples' (``outlier_split``: above ``SAMPLE_FACTOR`` x their median; at most half
   the samples can be candidates) and its squared norm above ``MIN_PART`` of a fair part (1/n);
2. the rule is decided on COHERENT norms, never on per-term mass: a sample's terms add up as
   vectors, so 63 terms of norm ~1 pointing the same way make a sample of norm ~60 that none of
   them explains. A candidate's terms above the token threshold can carry it only when they are
   few (at most ``FEW`` of its terms, or ``FEW_MIN``) and their summed scores (the most their
   gradients reach if they line up, by the triangle inequality) reach ``sqrt(CARRY)`` of the
   sample's exact norm. Such a candidate is deferred to the method's own token search
   (``Units.deferred``); ``reconsider`` then keeps the tokens found inside it when their summed
   exact norms reach that part, and otherwise, including when the search found nothing there,
   decides the sample by its own probe (before ``auto``'s remainder check, so a coherent sample
   the ranking missed costs one probe, not a bisection);
3. any other candidate, and a deferred one whose tokens fell short, is decided by its OWN probe:
   it is a culprit when its exact intensity is still above the limit and it carries that part of
   the step's squared norm; tokens found inside it are folded into it (rows never overlap). Then
   the answer descends as GradLoc's does (``_descend``): its hot terms (above the token
   threshold, fewer than all and at most ``FEW``/``FEW_MIN`` of them), probed together, that hold
   ``SPAN_SHARE`` of its share are named as TOKENS instead (a probe each but the last, which is
   what is left). This is decided on exact shares, so it does not hang on the ranking's estimates
   reaching the sample's norm (step 2), which they miss by 2x on one CPU and not another. The
   shortest contiguous window holding ``SPAN_MASS`` of its terms' LINEAR excess over the batch's
   median term score (coherent terms add linearly; a few very hot terms do not shrink the window
   onto themselves), if 2 to ``SPAN_MAX`` of its terms, is probed too and reported as a SPAN when
   it carries ``SPAN_SHARE`` of the sample's share. Either way the sample's terms leave the token
   search and its gradient joins ``Units.grad``;
4. after the token search, a micro-batch whose intensity is an outlier of the others', that
   carries that part (of 1/K) of the step's squared norm and holds no culprit is reported as a
   MICRO-BATCH (1 probe, for its share);
5. nothing found at any level: each sample's exact share (1 probe each, largest ghost norm
   first, at most ``MAX_SHARE_PROBES`` and what the budget leaves) goes to ``sample_shares``; the
   samples whose exact share stands out of the others' (``share_culprits``: ``SHARE_FACTOR`` x the
   median of the rest, up to half the batch) are named as SAMPLES from those probes, so "no single
   culprit" is said only when the shares are flat. When the culprits found carry less than
   ``SCAN_BELOW`` of the step, the unnamed samples whose ghost norm^2 stands out are probed too
   (``more_samples``: two bad samples, the first named by its intensity, the second a little under
   the rule).

Memory: a probe's gradient is summarised when taken and added to ONE running sum
(``Units.grad``: everything explained so far), so the stage holds one gradient-sized buffer
besides the probe in flight.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from .probe import BudgetExhausted, Grads, Prober
from .result import Culprit, CulpritToken
from .search import Hits
from .segments import Segment, Segments
from .threshold import outlier_split
from ..units import share_list

SAMPLE_FACTOR = 4.0  # a sample's per-term gradient this many times the other samples' median
FEW, FEW_MIN, CARRY = 0.25, 8, 0.5  # tokens carry a sample: a quarter of its terms (or 8), half its squared norm
SPAN_MASS, SPAN_MAX, SPAN_SHARE = 0.8, 0.5, 0.6
MIN_PART = 0.1  # a culprit sample (micro-batch) carries at least a tenth of a fair part (1/n) of the step
MAX_SHARE_PROBES = 32
SCAN_BELOW = 0.8  # culprits found carry less than this: a fifth of the step or more is left for another culprit
SHARE_FACTOR = 4.0  # an exact share this many times the median of the other samples' singles its sample out
DESCENDED = object()  # ``_confirm_sample``: the sample's hot tokens were named instead of it
Key = tuple[int, int, int]  # (micro_batch, b, t)


@dataclass
class Units:
    """Samples and spans reported, the terms they take out of the token search, the sum of the
    gradients of what they explain (ONE buffer, the token search's running sum starts from it;
    ``track=False``: not kept, for searches that need no remainder), and the candidates deferred
    to the token search (``reconsider``)."""

    culprits: list[Culprit] = field(default_factory=list)
    excluded: set[Key] = field(default_factory=set)
    grad: Grads | None = None
    exhausted: bool = False
    deferred: list[tuple[Segment, float]] = field(default_factory=list)
    track: bool = True
    stage: "_Stage | None" = None


@dataclass
class _Stage:
    """What every candidate is judged with."""

    prober: Prober
    hits: Hits
    units: Units
    scores: dict[Key, float]
    tau: float
    limit: float  # per-term intensity a culprit sample stays above
    part: float  # squared norm a culprit sample carries at least
    labelled: bool
    background: float  # the batch's median term score (windows measure the excess over it)

    def explain(self, g: Grads) -> None:
        """Add ``g`` to the running sum of what is explained (the first becomes the buffer)."""
        u = self.units
        if u.track:
            u.grad = g if u.grad is None else self.prober.add_(u.grad, g)


def candidates(segments: list[Segments | None]) -> tuple[list[tuple[Segment, float]], float, int]:
    """(candidate samples with their ghost norm, strongest first; the intensity limit; the number
    of samples with loss terms)."""
    rows, owner = [], {}
    for segs in segments:
        norms = segs.norms() if segs is not None else None
        if norms is not None:
            rows += [(s, n, len(s.terms)) for s, n in zip(segs.items, norms) if s.terms]
            owner.update({id(s): segs for s in segs.items})
    picked, limit = outliers(rows)
    for s, _, _ in picked:
        owner[id(s)].attach_head(s)
    for segs in segments:
        if segs is not None:
            segs.release()
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


def hot_terms(seg: Segment, scores: dict[Key, float], tau: float, ghost: float) -> list[Key]:
    """The sample's terms above the token threshold, strongest first, when they could carry it
    (step 2 of the module doc: few, and reaching ``sqrt(CARRY)`` of ``ghost``, the sample's
    exact norm, if they line up); [] when they cannot."""
    keys = [(seg.micro_batch, b, t) for b, t in seg.terms]
    above = sorted((k for k in keys if scores.get(k, 0.0) > tau), key=lambda k: -scores[k])
    if not above or len(above) > max(FEW_MIN, FEW * len(keys)):
        return []
    reach = sum(scores[k] for k in above)  # what they add up to if their gradients line up
    return above if reach * reach >= CARRY * ghost * ghost else []


def find_units(prober: Prober, hits: Hits, cands: list[tuple[Segment, float]], limit: float,
               scores: dict[Key, float], tau: float, labelled: bool, n_samples: int = 1) -> Units:
    """Steps 2-3 of the module doc, strongest candidate first: candidates a few hot terms could
    carry are deferred (``Units.deferred``, for ``reconsider`` after the token search), the
    others decided by their own probe; a sample must also carry more than ``MIN_PART`` of a fair
    part (``1 / n_samples``) of the step's squared gradient norm."""
    units = Units()
    if not cands:
        return units
    background = float(torch.tensor(list(scores.values())).median()) if scores else 0.0
    units.stage = _Stage(prober, hits, units, scores, tau, limit, MIN_PART * hits.total_sq / max(1, n_samples),
                         labelled, background)
    for seg, ghost in cands:
        if hot_terms(seg, scores, tau, ghost):
            units.deferred.append((seg, ghost))
            continue
        try:
            _settle(units.stage, seg, ghost, [])
        except BudgetExhausted:
            units.exhausted = True
            break
    return units


def reconsider(units: Units) -> None:
    """After the token search: each deferred candidate keeps the tokens found inside it when
    their summed exact norms reach ``sqrt(CARRY)`` of its norm; otherwise its own probe decides
    (step 3). The terms of a sample reported here join ``hits.terms`` (the search's "explained")."""
    st = units.stage
    for seg, ghost in list(units.deferred):
        units.deferred.remove((seg, ghost))
        found = st.hits.inside({(seg.micro_batch, b, t) for b, t in seg.terms})
        if found and sum(c.grad_norm for c in found) ** 2 >= CARRY * ghost * ghost:
            continue  # a few tokens carry the sample: they are the finer answer
        try:
            _settle(st, seg, ghost, found)
        except BudgetExhausted:
            units.exhausted = True
            return


def after_tokens(units: Units):
    """The token search's ``then``: with the gradient of what it found (None: nothing), settle the
    deferred candidates (``reconsider``); returns (budget exhausted, the gradient the units explain)."""
    def then(found_sum):
        units.grad = found_sum
        if units.deferred:
            reconsider(units)
        return units.exhausted, units.grad
    return then


def _settle(st: _Stage, seg: Segment, ghost: float, found: list[CulpritToken]) -> None:
    """A candidate's own probe decides it (``_confirm_sample``): a sample or span row, its hot tokens
    (``_descend``: the finer unit that carries it), or nothing."""
    unit = _confirm_sample(st, seg, ghost)
    if unit is DESCENDED:
        _report(st, seg, None, found)
    elif unit is not None:
        _report(st, seg, unit, found)


def _report(st: _Stage, seg: Segment, unit: Culprit | None, found: list[CulpritToken]) -> None:
    """``unit`` names the sample (None: its hot tokens were named instead, ``_descend``): its terms
    leave the search; tokens ``found`` inside it by the search are folded in (their rows go, their
    gradient leaves the running sum: one probe of them)."""
    keys = {(seg.micro_batch, b, t) for b, t in seg.terms}
    if unit is not None:
        st.units.culprits.append(unit)
    st.units.excluded |= keys
    st.hits.terms |= keys
    if not found or unit is None:
        return
    gone = {id(c) for c in found}
    st.hits.tokens[:] = [c for c in st.hits.tokens if id(c) not in gone]
    if st.units.grad is None:
        return
    try:
        g = st.prober.probe_terms(seg.micro_batch, [(c.batch, c.position) for c in found])
    except BudgetExhausted:
        st.units.grad = None  # no longer the explained sum; the search stops here anyway
        raise
    st.prober.sub_(st.units.grad, g)
    del g


def _confirm_sample(st: _Stage, seg: Segment, ghost: float) -> Culprit | object | None:
    """The sample's own probe: a SAMPLE (or a SPAN of it) row when it carries the spike, ``DESCENDED``
    when a few of its tokens carry it (they are in ``hits.tokens``), else None."""
    prober, hits, i = st.prober, st.hits, seg.micro_batch
    g = prober.probe_terms(i, seg.terms)
    n = prober.norm(g)
    if n / math.sqrt(len(seg.terms)) <= st.limit or n * n <= st.part:
        return None
    share = hits.share(g)
    where = {"micro_batch": i if st.labelled else None, "batch": seg.batch, "document": seg.document}
    unit = Culprit("sample", n, share, start=seg.start, end=seg.end, n_terms=len(seg.terms),
                   layer_norms=prober.layer_norms(g), score=ghost, **where)
    st.explain(g)  # the whole sample leaves the remainder, whichever row names it
    del g
    if share is not None and share > 0 and _descend(st, seg, share):
        return DESCENDED
    window = _window(seg, st.scores, st.background)
    if window is None or share is None or share <= 0:
        return unit
    try:
        g_w = prober.probe_terms(i, window)
    except BudgetExhausted:  # the sample stands: a span would only have been finer
        return unit
    share_w = hits.share(g_w)
    if share_w is not None and share_w >= SPAN_SHARE * share:
        unit = Culprit("span", prober.norm(g_w), share_w, start=window[0][1], end=window[-1][1] + 1,
                       n_terms=len(window), layer_norms=prober.layer_norms(g_w), **where)
    return unit


def _descend(st: _Stage, seg: Segment, share: float) -> bool:
    """Step 3's finer answer: the sample's hot terms (above the token threshold; at most ``FEW`` of its
    terms, or ``FEW_MIN``: all of a short completion's may be) probed together; when they hold
    ``SPAN_SHARE`` of the sample's share, each is probed alone and named as a TOKEN (True), as GradLoc
    names every term above its threshold. The decision is on the exact shares, not on the ranking's
    estimates: a culprit token holds ~all of its sample's share, an ordinary sample's hottest terms a
    small part, so the 0.6 line sits far from both, and whether a third stale token of three sits just
    above or just below the threshold changes which tokens are listed, not the level."""
    keys = sorted(((b, t) for b, t in seg.terms if st.scores.get((seg.micro_batch, b, t), 0.0) > st.tau),
                  key=lambda bt: -st.scores[(seg.micro_batch, *bt)])
    few = max(FEW_MIN, FEW * len(seg.terms))
    if len(keys) > few:
        keys = _strongest(keys, [st.scores[(seg.micro_batch, *bt)] for bt in keys], st.hits, share,
                          int(FEW * len(seg.terms)))
    if not keys or len(keys) > few:
        return False
    prober, hits, i = st.prober, st.hits, seg.micro_batch
    try:
        # every term hot (a short completion): the hot set is the sample, whose share is known
        g = prober.probe_terms(i, keys)
        held = share if len(keys) == len(seg.terms) else hits.share(g)
        if held is None or held < SPAN_SHARE * share:
            return False
        rows = []  # each token summarised at once (one gradient buffer besides the probe in flight)
        for k in keys[:-1]:
            g_k = prober.probe_terms(i, [k])
            rows.append((k, prober.summary(g_k, hits.total)))
            prober.sub_(g, g_k)  # the last token's gradient is what is left: no probe for it
            del g_k
    except BudgetExhausted:  # the sample stands: its tokens would only have been finer
        return False
    rows.append((keys[-1], prober.summary(g, hits.total)))
    for k, summary in rows:
        hits.add_summary(i, k, summary)
    return True


def _strongest(keys: list, scores: list[float], hits: Hits, share: float, most: int) -> list:
    """Too many hot terms to name: the strongest few, at most ``most`` (a quarter of the sample's terms),
    whose summed scores (the most their gradients reach if they line up) could still hold ``SPAN_SHARE`` of
    the sample's share; [] when no such few. Attention carries one very heavy term's gradient back to the
    positions before it, whose term scores then clear the threshold at a twentieth of its own: those are
    not culprits, and counting them refused the descent, naming a whole sample for its one token
    (held-out tester, round 12). A coherent document whose every term is hot has no such few: it stays
    the sample. The probe that follows decides on exact shares; this only picks what to probe."""
    need = math.sqrt(max(0.0, SPAN_SHARE * share * hits.total_sq))
    acc = 0.0
    for j, s in enumerate(scores[:most]):
        acc += s
        if acc >= need:
            return keys[:j + 1]
    return []


def _window(seg: Segment, scores: dict[Key, float], background: float) -> list[tuple[int, int]] | None:
    """The shortest run of the sample's terms (in position order) holding ``SPAN_MASS`` of their
    linear excess over the batch's median, grown over neighbours whose excess is a quarter of the
    run's median; when that is 2 to ``SPAN_MAX`` of the sample's terms, else None. On the output
    head's norms when the ghost pass gave them (exact per term), else on the term scores and
    ``background``."""
    if seg.head is not None:
        order = sorted(range(len(seg.terms)), key=lambda j: seg.terms[j][1])
        terms = [seg.terms[j] for j in order]
        w = [max(0.0, seg.head[j] - seg.head_median) for j in order]
    else:
        terms = sorted(seg.terms, key=lambda bt: bt[1])
        w = [max(0.0, scores.get((seg.micro_batch, b, t), 0.0) - background) for b, t in terms]
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
    hot = 0.25 * sorted(w[a:b])[(b - a) // 2]
    while a > 0 and w[a - 1] >= hot:
        a -= 1
    while b < len(w) and w[b] >= hot:
        b += 1
    return terms[a:b] if 2 <= b - a <= SPAN_MAX * len(terms) else None


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
                  labelled: bool) -> tuple[list[dict[str, Any]], list[Culprit]]:
    """Step 5: exact per-sample shares, largest ghost norm first, as far as the budget allows, and
    the samples those shares single out (``share_culprits``). ``share`` is shown within [0, 1] (a
    sample pointing against the step has none); the exact additive value is ``raw_share``."""
    rows = []
    for i, segs in enumerate(segments):
        segs = segs if segs is not None else Segments(i, prober.masks[i])
        norms = segs.norms() or [0.0] * len(segs)
        rows += [(n, s) for n, s in zip(norms, segs.items) if s.terms]
    rows.sort(key=lambda r: -r[0])
    out, units = [], []
    for _, seg in rows[:MAX_SHARE_PROBES]:
        try:
            unit = probe_sample(prober, hits, seg, labelled)
        except BudgetExhausted:
            break
        raw = unit.share
        out.append({"micro_batch": unit.micro_batch, "sample": seg.batch, "document": seg.document,
                    "share": None if raw is None else min(1.0, max(0.0, raw)), "raw_share": raw,
                    "grad_norm": unit.grad_norm})
        units.append(unit)
    order = sorted(range(len(out)), key=lambda j: -(out[j]["raw_share"] or 0.0))
    return [out[j] for j in order], share_culprits([units[j] for j in order], len(rows))


def more_samples(prober: Prober, hits: Hits, segments: list[Segments | None], labelled: bool,
                 explained: set) -> list[Culprit]:
    """Culprits named carry less than ``SCAN_BELOW`` of the step: the samples not yet named whose exact
    ghost norm^2 stands out of the other unnamed samples' (``SHARE_FACTOR`` x their median, at most half
    of them; all of them when three or fewer are left) are probed, and named when each carries two fair
    parts (2/n) of the step or a fifth: two bad samples, the first named by its intensity, the second a
    little under the rule. ``explained``: the term keys of what is named; a sample holding any of them is
    left out (rows never overlap)."""
    rows = [(n, s) for segs in segments if segs is not None and segs.norms() is not None
            for n, s in zip(segs.norms(), segs.items) if s.terms]
    n_samples = len(rows)
    rows = [(n, s) for n, s in rows if not any((s.micro_batch, b, t) in explained for b, t in s.terms)]
    if len(rows) < 2:
        return []
    rows.sort(key=lambda r: -r[0])
    if len(rows) <= 3:  # packed rows of long documents: probing the few left costs less than judging them
        k = len(rows)
    else:
        k, _ = outlier_split(torch.tensor([n * n for n, _ in rows], dtype=torch.float64), SHARE_FACTOR, 0.5,
                             most=0.5)
    out = []
    for _, seg in rows[:k]:
        try:
            unit = probe_sample(prober, hits, seg, labelled)
        except BudgetExhausted:
            break
        if unit.share is not None and unit.share >= min(2.0 / n_samples, 0.2):
            out.append(unit)
    return out


def probe_unit(prober: Prober, hits: Hits, i: int, terms: list, level: str, labelled: bool,
               **where: Any) -> Culprit:
    """One probe of micro-batch ``i``'s ``terms`` as a culprit row at ``level``: its exact norm, per-layer
    norms and additive share (raw: ``floor_rows`` keeps it within [0, 1]); ``where``: ``batch``, ``start``,
    ``end``, ``document``. Raises ``BudgetExhausted`` like the probe."""
    g = prober.probe_terms(i, terms)
    return Culprit(level, prober.norm(g), hits.share(g), micro_batch=i if labelled else None, n_terms=len(terms),
                   layer_norms=prober.layer_norms(g), **where)


def probe_sample(prober: Prober, hits: Hits, seg: Segment, labelled: bool) -> Culprit:
    """``probe_unit`` of a sample (or packed document) segment."""
    return probe_unit(prober, hits, seg.micro_batch, seg.terms, "sample", labelled, batch=seg.batch,
                      start=seg.start, end=seg.end, document=seg.document)


def share_culprits(units: list[Culprit], n_samples: int) -> list[Culprit]:
    """The samples whose EXACT share of the step stands out of the others' (``SHARE_FACTOR`` x the
    median of the rest, at most half of them, all but one of four or fewer: packed rows of long documents
    hold few), each above ``MIN_PART`` of a fair part: named when the
    ranking's per-term intensities missed them (several bad samples lift each other's median; a coherent
    sample's intensity sits just under ``SAMPLE_FACTOR``). "No single culprit" is then said only when
    the shares are flat. ``units``: largest share first."""
    if n_samples < 2 or len(units) < 2:
        return []
    vals = torch.tensor([max(u.share or 0.0, 1e-12) for u in units], dtype=torch.float64)
    n = len(units)  # a few units (packed rows of long documents): all but one may stand out of the last
    most = 0.5 if n > 4 else (n - 1) / n
    k, _ = outlier_split(vals, SHARE_FACTOR, 0.5, most=most)
    # the split takes the smallest gap; a unit after it that still holds a fifth of the step and stands out
    # of the units below it is as much a culprit (two junk documents at 68% and 32% beside a clean one at 0%)
    while 0 < k < int(n * most) and vals[k] >= 0.2 and vals[k] > SHARE_FACTOR * float(vals[k + 1:].median()):
        k += 1
    return [u for u in units[:k] if (u.share or 0.0) > MIN_PART / n_samples]


def no_culprit_note(shares: list[dict[str, Any]], n_samples: int) -> str:
    top = share_list([r for r in shares[:5] if r["share"]], percent=False)
    probed = "" if len(shares) >= n_samples else f" ({len(shares)} of {n_samples} samples probed)"
    return ("no sample, span or token carries the spike: no sample's gradient per term stands out of the others' "
            f"({SAMPLE_FACTOR:g}x their median) and no term is above the threshold; the largest per-sample shares "
            f"of the step's squared gradient norm{probed}: {top or 'n/a'}")
