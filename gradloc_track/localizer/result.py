"""Result types of the localizer, shared by the monitor and the artifact writers.

A spike is explained at the level its cause lives (``LEVELS``, finest first): a few loss terms
(``CulpritToken``), a contiguous span of one sample, a whole sample (a sequence, or a document
inside a packed row), or a micro-batch when nothing finer carries it (``Culprit``). Every row
carries its exact gradient norm and its additive share ``<g_x, g> / ||g||^2`` of the step's
squared gradient norm; rows never overlap, so their shares add up.

What is shown (``floor_rows``, applied where the result is built): a row is a culprit only when
its share is at least ``SHARE_FLOOR`` of the step and ``SHARE_FLOOR_REL`` of the largest row's
(a term 1/20th as heavy as the document that caused the spike is not what caused it); rows
under the floor, negative ones included, go to ``LocateResult.below_floor``. Shares are then
within [0, 1]: an exact share leaves it only through cancellation, when the rest of the step
points against the culprits (a culprit at 1.012 beside a rest at -0.012); the culprits then
explain the whole step, their shares are scaled to sum to 1 and a note gives the exact values
(kept in ``raw_share``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch

LEVELS = ("token", "span", "sample", "micro_batch")
SHARE_FLOOR = 0.001  # of the step's squared gradient norm
SHARE_FLOOR_REL = 0.05  # of the largest row's share


@dataclass
class CulpritToken:
    """One loss term whose own gradient is above the threshold."""

    level: ClassVar[str] = "token"
    document: ClassVar[int | None] = None
    batch: int
    position: int
    grad_norm: float  # exact L2 norm of this term's gradient (from a single-term probe)
    layer_norms: dict[str, float] = field(default_factory=dict)  # layer -> exact norm
    score: float | None = None  # the ranking estimate (ghost map) that led to it, if any
    # <g_term, g_total> / ||g_total||^2: this term's additive share of the spike's squared norm
    share: float | None = None
    micro_batch: int | None = None  # which micro-batch of the step (None: the step had one)
    rank: int | None = None  # which process's batch (None: not a distributed localization)
    nonfinite: bool = False  # named by the non-finite search (``nonfinite.py``): its loss/gradient is NaN/Inf
    raw_share: float | None = None  # the exact additive share when ``share`` was scaled into [0, 1]

    @property
    def start(self) -> int:
        return self.position

    @property
    def end(self) -> int:
        return self.position + 1


@dataclass
class Culprit:
    """A span, a sample (or a packed document) or a micro-batch that carries the spike while no
    few of its terms do (each may sit below the token threshold)."""

    level: str  # "span" | "sample" | "micro_batch"
    grad_norm: float  # exact L2 norm of the unit's gradient (one probe of its terms)
    share: float | None = None  # <g_unit, g_total> / ||g_total||^2
    micro_batch: int | None = None  # None: the step had one micro-batch
    batch: int | None = None  # the sample (row) inside its micro-batch; None for a micro-batch
    start: int | None = None  # positions [start, end) of the unit in its row
    end: int | None = None
    document: int | None = None  # the document id inside a packed row (document_ids given)
    n_terms: int = 0  # loss terms inside the unit
    layer_norms: dict[str, float] = field(default_factory=dict)
    score: float | None = None  # the ghost estimate that made it a candidate
    rank: int | None = None
    nonfinite: bool = False  # named by the non-finite search (``nonfinite.py``): share None
    raw_share: float | None = None  # the exact additive share when ``share`` was scaled into [0, 1]


def floor_rows(rows: list) -> tuple[list, list, list[str]]:
    """(culprits, rows below the floor, notes) from found rows (module doc). Rows without a share
    (``ghost``'s estimates) are kept as they are."""
    known = [r for r in rows if r.share is not None]
    top = max((r.share for r in known), default=0.0)
    floor = max(SHARE_FLOOR, SHARE_FLOOR_REL * top)
    kept = [r for r in rows if r.share is None or r.share >= floor]
    below = [r for r in known if r.share < floor]
    notes = []
    if below:
        notes.append(f"{len(below)} row(s) found under the share floor ({floor:.3g}: {SHARE_FLOOR:g} of the step, "
                     f"{SHARE_FLOOR_REL:g} of the largest row) are not culprits (result.below_floor)")
    total = sum(r.share for r in kept if r.share is not None)
    if total > 1.0:
        exact = ", ".join(f"{r.share:.4g}" for r in kept if r.share is not None)
        notes.append(f"the rest of the step points against the culprits (its share is {1.0 - total:.3g}): their "
                     f"exact shares ({exact}) sum to {total:.4g}; shown scaled to sum to 1 (exact in raw_share)")
        for r in kept:
            if r.share is not None:
                r.raw_share, r.share = r.share, r.share / total
    return kept, below, notes


def budget_note(budget: int, found_any: bool) -> str:
    """What a search stopped by its budget says: never that nothing carries the spike."""
    if found_any:
        return (f"the probe budget ({budget}) ran out: the culprits listed are those confirmed so far; more may "
                "carry the spike (raise locate.budget)")
    return (f"the probe budget ({budget}) ran out before any sample, span or token was confirmed: this does not "
            "mean none carries the spike (raise locate.budget)")


def token_order(c: CulpritToken) -> tuple:
    """Tokens by gradient norm, largest first; ties by rank, micro-batch, row and position, so that one
    process and several list the same tokens in the same order."""
    return (-c.grad_norm, c.rank or 0, c.micro_batch or 0, c.batch, c.position)


def ranked_rows(coarse: list, tokens: list, flagged: list, budget: int | None) -> tuple[list, list, list[str]]:
    """(culprits, rows below the floor, notes) as every search shows them: samples, spans and micro-batches by
    share, then tokens (``token_order``), through the floor (``floor_rows``), then the rows named for their
    data; ``budget``: the probe budget when it ran out (its note), else None."""
    coarse = sorted(coarse, key=lambda c: -(c.share if c.share is not None else -math.inf))
    culprits, below, notes = floor_rows(coarse + sorted(tokens, key=token_order))
    culprits += flagged  # named for their data, under the floor or not
    if budget is not None:
        notes.append(budget_note(budget, bool(culprits)))
    return culprits, below, notes


@dataclass
class StepCheck:
    """Do the probes reproduce the step? The sum of the micro-batches' full-mask probes against
    the gradient the step's own backward left in ``.grad``.

    ``residual``: ``||sum - s * grad|| / ||sum||`` with ``s`` the best scale per tensor when what
    rescaled ``.grad`` is not known (so a clipper's rescaling is not a difference; dropout replayed
    wrong is), the best one scale when it is (``step_check``); ``norm_ratio``:
    ``||grad|| / ||sum||`` (1 unless clipped or the loss was normalised differently); ``scale``:
    the one number with ``grad = scale * sum`` (least squares, float64) when it fits within the
    tolerance, None when it does not (per-tensor rescaling) or the probes do not replay the step:
    the factor that puts a probe's gradient in ``.grad``'s units (spike surgery uses it)."""

    residual: float
    norm_ratio: float
    replayed: bool
    reason: str = ""
    scale: float | None = None
    tol: float = 1e-3  # the residual the check allowed (3e-2 in half precision: its rounding)


@dataclass
class LocateResult:
    tokens: list[CulpritToken]  # culprit tokens, largest grad_norm first
    probes: int  # forward+backward passes used
    method: str
    threshold: float  # per-term threshold actually used
    total_norm: float  # norm of the full-batch gradient (all terms)
    layer_names: list[str] = field(default_factory=list)
    # (B, T) per-term contribution estimate from the ghost pass (CPU float32), for highlighting
    ghost_map: torch.Tensor | None = None
    # (L, B, T) per-layer per-position ghost norms (CPU float32), rows follow layer_names
    layer_map: torch.Tensor | None = None
    budget_exhausted: bool = False
    wall_time_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    # one entry per micro-batch when the step had several (K > 1): the norm of that micro-batch's
    # gradient and its (B_k, T_k) / (L, B_k, T_k) ghost maps (None where no ghost pass ran);
    # ``ghost_map``/``layer_map`` above are then None (shapes may differ across micro-batches)
    micro_batch_norms: list[float] = field(default_factory=list)
    ghost_maps: list[torch.Tensor | None] = field(default_factory=list)
    layer_maps: list[torch.Tensor | None] = field(default_factory=list)
    # every culprit at its level (sample/span/micro-batch rows first, then tokens); None = the tokens
    culprits: list[Culprit | CulpritToken] | None = None
    step_check: StepCheck | None = None  # None: no gradient in .grad to compare with
    # when no culprit was found: {"micro_batch", "sample", "document", "share" (within [0, 1]),
    # "raw_share", "grad_norm"} per sample (exact probes, largest share first), as far as the budget allowed
    sample_shares: list[dict[str, Any]] = field(default_factory=list)
    # on a step whose gradient (or loss) is NaN/Inf: which samples (or the sum) made it so
    # (``nonfinite.NonfiniteFinding``); None on a finite step
    nonfinite: Any = None  # (not imported here: ``nonfinite`` builds on these types)
    # rows the search found whose share is under the floor (``floor_rows``): not culprits
    below_floor: list[Culprit | CulpritToken] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.culprits is None:
            self.culprits = list(self.tokens)

    def culprit_masks(self, token_mask: torch.Tensor | list[torch.Tensor],
                      document_ids: torch.Tensor | list | None = None, rank: int | None = None) -> list[torch.Tensor]:
        """Every culprit's loss terms as masks, one per micro-batch (``token_mask``'s weights where
        a culprit row covers a term, 0 elsewhere): one probe of each gives the culprits' exact
        gradient, e.g. to remove it from the step's (``localizer.surgery``). ``document_ids`` as
        given to ``locate``; ``rank``: under torch.distributed, this rank's part (``token_mask`` is
        this rank's; culprits of other ranks leave it zeros)."""
        masks = [token_mask] if isinstance(token_mask, torch.Tensor) else list(token_mask)
        docs = [document_ids] if isinstance(document_ids, torch.Tensor) or document_ids is None \
            else list(document_ids)
        keep = [torch.zeros_like(m, dtype=torch.bool) for m in masks]
        for c in self.culprits:
            if rank is not None and c.rank is not None and c.rank != rank:
                continue
            k = c.micro_batch or 0
            if c.level == "micro_batch":
                keep[k][:] = True
                continue
            row = keep[k][c.batch]
            inside = torch.zeros_like(row)
            inside[c.start:c.end] = True
            d = docs[k] if k < len(docs) else None
            if c.document is not None and d is not None:
                inside &= d[c.batch].to(row.device) == c.document
            row |= inside
        return [torch.where(kp, m, torch.zeros_like(m)) for kp, m in zip(keep, masks)]

    def for_micro_batch(self, k: int) -> "LocateResult":
        """This result seen as a one-micro-batch result for micro-batch ``k`` (its culprits and maps),
        so single-batch consumers (highlighting, heatmaps) can render one micro-batch at a time."""
        if not self.micro_batch_norms:
            return self
        return replace(self, tokens=[t for t in self.tokens if t.micro_batch == k],
                       culprits=[c for c in self.culprits if c.micro_batch == k],
                       ghost_map=self.ghost_maps[k], layer_map=self.layer_maps[k])

    def as_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "probes": self.probes,
            "threshold": self.threshold,
            "total_norm": self.total_norm,
            "budget_exhausted": self.budget_exhausted,
            "tokens": [
                {"batch": t.batch, "position": t.position, "grad_norm": t.grad_norm,
                 "layer_norms": t.layer_norms, "score": t.score, "micro_batch": t.micro_batch, "rank": t.rank}
                for t in self.tokens
            ],
            "culprits": [_row(c) for c in self.culprits],
            "below_floor": [_row(c) for c in self.below_floor],
            "nonfinite": None if self.nonfinite is None else {
                "where": self.nonfinite.where, "samples": list(self.nonfinite.samples),
                "terms": [list(t) for t in self.nonfinite.terms], "detail": self.nonfinite.detail},
            "step_check": None if self.step_check is None else vars(self.step_check),
            "notes": list(self.notes),
        }


def _row(c: Culprit | CulpritToken) -> dict[str, Any]:
    return {"level": c.level, "micro_batch": c.micro_batch, "batch": c.batch, "start": c.start, "end": c.end,
            "document": c.document, "grad_norm": c.grad_norm, "share": c.share, "raw_share": c.raw_share,
            "rank": c.rank, "nonfinite": c.nonfinite}
