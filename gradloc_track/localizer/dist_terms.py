"""Every rank's loss terms, samples and micro-batch pieces in one global numbering.

The single-process searches (``search.py``) and level rules (``levels.py``) see a step as
micro-batches of ``(b, t)`` terms grouped into samples (``segments.Segment``). Under
``torch.distributed`` each rank holds its own rows; after the collective ghost pass ONE
``all_gather_object`` gives every rank every rank's terms (with their ghost scores) and samples
(with their exact ghost norms), and this module numbers them so those rules run unchanged on
every rank, in lockstep:

- a global ROW numbers every ``(rank, micro_batch, batch)`` that holds a loss term, in that
  order; a global term is ``(row, t)``; the searches see ONE micro-batch (index 0) of such terms,
  and a sample (a row, or one packed document of it) is a ``Segment`` of that micro-batch;
- a PIECE is one rank's part of one micro-batch, ``(rank, micro_batch)``, in that order: what one
  forward on one rank computed, the unit of the micro-batch level (with one micro-batch per step,
  a rank's whole batch). Its norm for the outlier rule is its gradient's norm over the hooked
  layers, exact, from the same ghost backward (``PieceNorm``: its samples' gradients added
  coherently, as the micro-batch level needs; a probe per piece would cost W*K of them); a
  reported piece's norm and share come from its own probe;
- culprit rows found in these terms are ``place``d back: ``rank``, ``micro_batch`` (None when
  the step had one) and ``batch`` the rank's own row.

Norms and scores are in the optimizer's units (DDP and FSDP2 average over the W ranks: divided by W).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist

from .search import term_scores
from .segments import Segment, Segments

Row = tuple[int, int, int]  # (rank, micro_batch, batch)
DistTerm = tuple[int, int, int, int]  # (rank, micro_batch, batch, position)


class PieceNorm:
    """One rank's part of one micro-batch: the squared norm of its gradient over the layers the
    ghost hooks see (linear: ``||G^T X||^2`` plus the bias's ``||sum G||^2``; embedding: the rows
    of equal ids summed), exact, local (no collective), from the ghost pass's own backward.
    ``GhostMap`` takes it in place of the micro-batch's ``Segments``, which it feeds too."""

    def __init__(self, segments: Segments) -> None:
        self.segments = segments
        self.sq: torch.Tensor | None = None  # () float64 on the gradients' device

    def add(self, g: torch.Tensor, x: torch.Tensor, kind: str, has_bias: bool) -> None:
        self.segments.add(g, x, kind, has_bias)
        g2 = g.reshape(-1, g.shape[-1]).float()  # (B*T, C_out)
        if kind == "embedding":
            ids, inv = torch.unique(x.reshape(-1), return_inverse=True)  # a device sync on CUDA: ghost pass only
            rows = torch.zeros(len(ids), g2.shape[1], device=g2.device)
            sq = rows.index_add_(0, inv.to(g2.device), g2).square().sum()
        else:
            sq = (g2.T @ x.reshape(-1, x.shape[-1]).float()).square().sum()  # one weight-sized temporary
            if has_bias:
                sq = sq + g2.sum(0).square().sum()
        self.sq = sq.double() if self.sq is None else self.sq + sq.double()

    def norm(self) -> float | None:
        return None if self.sq is None else math.sqrt(float(self.sq))  # host sync: once per localization


class GlobalSegments:
    """Every rank's samples as ``Segment`` objects of the one global micro-batch, with their ghost
    norms: what ``levels.candidates`` and ``levels.sample_shares`` read from ``Segments``."""

    def __init__(self) -> None:
        self.items: list[Segment] = []
        self.values: list[float | None] = []  # each sample's ghost norm (None: no hook fired)

    def __len__(self) -> int:
        return len(self.items)

    def add(self, seg: Segment, norm: float | None) -> None:
        self.items.append(seg)
        self.values.append(norm)

    def norms(self) -> list[float] | None:
        return None if any(n is None for n in self.values) else list(self.values)


class GlobalTerms:
    """The global numbering (module doc): rows, terms with their ghost scores, samples, pieces."""

    def __init__(self, world: int, k: int) -> None:
        self.world, self.k = world, k
        self.rows: list[Row] = []
        self.row_of: dict[Row, int] = {}
        self.score: dict[tuple[int, int, int], float] = {}  # (0, row, t) -> ghost score (0 without maps)
        self.segments = GlobalSegments()
        self.pieces = [(r, kk) for r in range(world) for kk in range(k)]
        self.piece_terms: list[list[tuple[int, int]]] = [[] for _ in self.pieces]
        self.piece_norms: list[float] = [0.0] * len(self.pieces)  # over the hooked layers (PieceNorm)

    # -- building, from every rank's part ------------------------------------------------------
    def add_rank(self, r: int, parts: list) -> None:
        for k, idx, vals, samples, piece_norm in parts:
            piece = self.piece_terms[r * self.k + k]
            self.piece_norms[r * self.k + k] = piece_norm or 0.0
            for (b, t), v in zip(idx.tolist(), vals.tolist()):
                row = self.row_of.get((r, k, b))
                if row is None:  # terms come row-major per micro-batch: rows are numbered in order
                    row = self.row_of[(r, k, b)] = len(self.rows)
                    self.rows.append((r, k, b))
                self.score[(0, row, t)] = v
                piece.append((row, t))
            for b, doc, start, end, norm, ts in samples:
                row = self.row_of[(r, k, b)]
                self.segments.add(Segment(0, row, doc, start, end, [(row, t) for t in ts]), norm)

    # -- from the searches' terms to the ranks' -------------------------------------------------
    def to_dist(self, terms) -> list[DistTerm]:
        """Global ``(row, t)`` terms as ``(rank, micro_batch, batch, t)`` (what ``DistProber`` probes)."""
        return [self.rows[row] + (t,) for row, t in terms]

    def of_dist(self, term: DistTerm) -> tuple[int, int]:
        return self.row_of[tuple(term[:3])], term[3]

    def dist_terms(self) -> list[DistTerm]:
        """Every term, in global order (rank, micro-batch, batch, position)."""
        return [self.rows[row] + (t,) for _, row, t in self.score]

    # -- culprits back in the ranks' own indices --------------------------------------------------
    def place(self, c: Any, labelled: bool) -> Any:
        """A sample/span/token row found on a global row: its rank, micro-batch and own row."""
        r, k, b = self.rows[c.batch]
        return dataclasses.replace(c, rank=r, micro_batch=k if labelled else None, batch=b)

    def place_piece(self, c: Any) -> Any:
        """A micro-batch row found on a piece: its rank and micro-batch (0 when the step had one:
        the rank's whole batch)."""
        r, k = self.pieces[c.micro_batch]
        return dataclasses.replace(c, rank=r, micro_batch=k)

    def place_share(self, row: dict, labelled: bool) -> dict:
        r, k, b = self.rows[row["sample"]]
        return {**row, "rank": r, "micro_batch": k if labelled else None, "sample": b}

    def piece_of(self, c: Any) -> int:
        return c.rank * self.k + (c.micro_batch or 0)


def gather_terms(prober: Any, maps: list[torch.Tensor] | None, pieces: list[PieceNorm] | None) -> GlobalTerms:
    """Every rank's loss terms (with their ghost scores; 0 without ``maps``), samples and pieces
    (with their ghost norms, in the optimizer's units) in one ``all_gather_object``."""
    world = dist.get_world_size(prober.group)
    local = []
    for k, mask in enumerate(prober.masks):
        idx = (mask != 0).nonzero().cpu()  # (n, 2); host sync: once per localization
        scores = term_scores(maps[k], mask) if maps is not None else torch.zeros(mask.shape)  # (B, T)
        segs = pieces[k].segments if pieces is not None else None
        norms = segs.norms() if segs is not None else None
        samples = [] if segs is None else [
            (s.batch, s.document, s.start, s.end, None if norms is None else norms[j] / world, [t for _, t in s.terms])
            for j, s in enumerate(segs.items) if s.terms]
        piece = pieces[k].norm() if pieces is not None else None
        local.append((k, idx, scores[idx[:, 0], idx[:, 1]] if len(idx) else torch.zeros(0), samples,
                      None if piece is None else piece / world))
    every: list = [None] * world
    dist.all_gather_object(every, local, group=prober.group)
    out = GlobalTerms(world, prober.k)
    for r, parts in enumerate(every):
        out.add_rank(r, parts)
    return out
