"""The three search strategies over loss terms: GradLoc bisection, ghost ranking, and auto."""
from __future__ import annotations

import math
from typing import Sequence

import torch

from .ghost import GhostMap, adaptive_threshold
from .probe import BudgetExhausted, Grads, Prober
from .result import CulpritToken

Term = tuple[int, int]


def _token(prober: Prober, term: Term, g: Grads, total: Grads | None, total_sq: float, score=None) -> CulpritToken:
    share = prober.dot(g, total) / total_sq if total is not None and total_sq > 0 else None
    return CulpritToken(batch=int(term[0]), position=int(term[1]), grad_norm=prober.norm(g),
                        layer_norms=prober.layer_norms(g), score=score, share=share)


def bisect(prober: Prober, terms: Sequence[Term], tau: float, known: Grads | None = None,
           two_probes: bool = True, tau_prune: float | None = None) -> tuple[list[tuple[Term, Grads]], bool]:
    """Depth-first halving (GradLoc). A range S is kept while ``||g_S|| > tau_prune * sqrt(|S|)``
    (GradLoc's size-aware rule: the norm ``|S|`` terms of per-term norm ``tau_prune`` reach when
    their directions are unrelated); a single term is a hit when its norm exceeds ``tau``. With
    an explicit GradLoc-style threshold both are the same knob. The larger half is visited first.
    ``two_probes=False`` (used by ``auto``) probes one half and gets the other by subtraction
    from the known parent gradient.

    Returns (hits with their exact gradients, budget_exhausted).
    """
    tau_prune = tau if tau_prune is None else tau_prune
    hits: list[tuple[Term, Grads]] = []
    stack: list[tuple[list[Term], Grads | None]] = [(list(terms), known)]
    try:
        while stack:
            S, g_S = stack.pop()
            if len(S) == 1:
                if g_S is None:
                    g_S = prober.probe_terms(S)
                if prober.norm(g_S) > tau:
                    hits.append((S[0], g_S))
                continue
            A, B = S[: len(S) // 2], S[len(S) // 2:]
            g_A = prober.probe_terms(A)
            g_B = prober.probe_terms(B) if two_probes or g_S is None else prober.sub(g_S, g_A)
            kept = [(prober.norm(g), X, g) for X, g in ((A, g_A), (B, g_B)) if prober.norm(g) > tau_prune * math.sqrt(len(X))]
            for _, X, g in sorted(kept, key=lambda k: k[0]):  # larger pushed last = visited first
                stack.append((X, g))
    except BudgetExhausted:
        return hits, True
    return hits, False


def ghost_pass(prober: Prober, model: torch.nn.Module, group_by: str) -> tuple[Grads, torch.Tensor, list[str]]:
    """One full-mask probe with hooks: (total gradient, (L, B, T) layer map, layer names)."""
    with GhostMap(model, group_by, tuple(prober.token_mask.shape)) as gm:
        total = prober.probe(prober.token_mask)
    layer_map, names = gm.result(prober.grouping.layers)
    return total, layer_map, names


def term_scores(layer_map: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) per-term estimate: the root-sum-square over layers at the term's position."""
    scores = layer_map.pow(2).sum(0).sqrt()
    return scores * (token_mask.detach().cpu() != 0)


def prune_level(term_score: dict[Term, float], tau: float, explicit: bool) -> float:
    """Per-term level of the size-aware pruning bound ``level * sqrt(|S|)``.

    GradLoc uses its threshold knob itself, which prunes a range holding a culprit whenever
    ``||g_c|| < tau * sqrt(|S|)`` — culprits only a few times above ``tau`` are lost near the
    root. We use the smaller of ``tau`` and 3x the rms of the terms the ghost ranking calls
    typical (what a range of ``|S|`` ordinary terms reaches), so a range is kept while it is
    noisier than ordinary terms explain. ``explicit`` is kept for callers that want to log it.
    """
    typical = [v for v in term_score.values() if v <= tau]
    noise = 3.0 * math.sqrt(sum(v * v for v in typical) / max(1, len(typical)))
    return min(tau, noise) if noise > 0 else tau


def auto(prober: Prober, model: torch.nn.Module, terms: list[Term], tau: float | None, group_by: str):
    """Ghost ranking, exact confirmation of each candidate, then a remainder check.

    1. one ghost pass (probe 1) ranks every term; ``tau=None`` is set from the ranking scores;
    2. candidates are confirmed in score order with exact single-term probes, stopping at the
       first miss or once scores fall below ``tau / 4`` (the ranking says nothing is left);
    3. the remainder's gradient is ``g_total - sum(g_culprit)`` (no probe): if it passes the
       bisection rule (``||g_R|| <= tau_prune * sqrt(|R|)``) the search is done, else a subtraction-
       bisection searches the remainder within the budget.
    """
    total, layer_map, names = ghost_pass(prober, model, group_by)
    scores = term_scores(layer_map, prober.token_mask)
    term_score = {t: float(scores[t]) for t in terms}
    explicit = tau is not None
    if tau is None:
        tau = adaptive_threshold(torch.tensor([term_score[t] for t in terms]))
    tau_prune = prune_level(term_score, tau, explicit)
    found: list[tuple[Term, Grads]] = []
    exhausted = False
    for t in sorted(terms, key=lambda t: -term_score[t]):
        if term_score[t] < tau / 4:
            break
        try:
            g = prober.probe_terms([t])
        except BudgetExhausted:
            exhausted = True
            break
        if prober.norm(g) > tau:
            found.append((t, g))
        else:
            break
    notes = []
    if not exhausted:
        rest = [t for t in terms if t not in {f for f, _ in found}]
        g_rest = total
        for _, g in found:
            g_rest = prober.sub(g_rest, g)
        if rest and prober.norm(g_rest) > tau_prune * math.sqrt(len(rest)):
            notes.append("ranking left a remainder above the bisection bound; searched it by bisection")
            more, exhausted = bisect(prober, rest, tau, known=g_rest, two_probes=False, tau_prune=tau_prune)
            found += more
    return found, total, layer_map, names, scores, tau, exhausted, notes, term_score
